"""The conversation IR: what OpenAI Chat, OpenAI Responses and Anthropic Messages all lower into.

Protocols differ only at the edges; everything from prompt rendering to output decoding works on
these types. JSON values that reach the prompt (tool schemas, historical tool arguments) are kept
as parsed with their member order (Python dicts preserve insertion order), so an unmodified replay
renders byte-identical prompts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Union

Role = Literal["system", "developer", "user", "assistant", "tool"]


@dataclass
class CacheMark:
    """A protocol cache hint on a part: an explicit shared-prefix write candidate after this part."""

    ttl: str | None = None  # Anthropic "5m" / "1h"; advisory


@dataclass
class TextPart:
    text: str
    cache: CacheMark | None = None
    type: Literal["text"] = "text"


@dataclass
class RefusalPart:
    text: str
    type: Literal["refusal"] = "refusal"


@dataclass
class ImagePart:
    """An image input; `source` is a URL or data URI until media/ prepares it."""

    source: str
    detail: str | None = None
    cache: CacheMark | None = None
    param: str | None = field(default=None, compare=False)  # the request field, for media errors
    type: Literal["image"] = "image"


@dataclass
class VideoPart:
    source: str
    cache: CacheMark | None = None
    param: str | None = field(default=None, compare=False)
    type: Literal["video"] = "video"


@dataclass
class ReasoningPart:
    """Visible reasoning of an earlier assistant turn (history)."""

    text: str
    type: Literal["reasoning"] = "reasoning"


@dataclass
class ToolCallPart:
    """A call the assistant made. `arguments` is the parsed JSON object, member order kept; `raw_arguments`
    is the client's exact text when it was a string (replayed as given if it does not parse)."""

    call_id: str
    name: str
    arguments: dict[str, Any]
    namespace: str | None = None
    raw_arguments: str | None = None
    cache: CacheMark | None = None  # Anthropic cache_control on a tool_use block: a write after its message
    type: Literal["tool_call"] = "tool_call"


@dataclass
class ToolResultPart:
    call_id: str
    content: list[Union[TextPart, ImagePart]]
    is_error: bool = False
    cache: CacheMark | None = None
    type: Literal["tool_result"] = "tool_result"


Part = Union[TextPart, RefusalPart, ImagePart, VideoPart, ReasoningPart, ToolCallPart, ToolResultPart]


@dataclass
class Message:
    role: Role
    parts: list[Part] = field(default_factory=list)


def media_parts(messages: list[Message]) -> list[Union[ImagePart, VideoPart]]:
    """Every image and video of a conversation in prompt order, tool-result images included: the
    order the router prepares them in and the prompt builder binds them in."""
    found: list[Union[ImagePart, VideoPart]] = []
    for message in messages:
        for part in message.parts:
            inner = part.content if isinstance(part, ToolResultPart) else [part]
            found += [p for p in inner if isinstance(p, (ImagePart, VideoPart))]
    return found


@dataclass
class ToolDef:
    """A function tool. `parameters` is the JSON Schema as received (member order kept)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    namespace: str | None = None
    cache: CacheMark | None = None  # Anthropic cache_control on a tool definition

    @property
    def identity(self) -> tuple[str | None, str]:
        return (self.namespace, self.name)


@dataclass
class PromptOptions:
    """Template-facing options after protocol validation; None means 'template default'."""

    enable_thinking: bool | None = None
    preserve_thinking: bool | None = None
    reasoning_effort: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs, validated
    # the request field behind a typed option where the protocol names it otherwise (Responses: reasoning.effort),
    # so a conflict's error names the field the client sent
    option_params: dict[str, str] = field(default_factory=dict)
    implicit_cache: bool = True  # OpenAI prompt_cache_options mode:"explicit" turns it off
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # Anthropic assistant prefill


@dataclass
class Conversation:
    messages: list[Message]
    tools: list[ToolDef] = field(default_factory=list)
    tool_choice: Literal["auto", "none"] = "auto"
    allowed_tools: list[tuple[str | None, str]] | None = None  # effective set when restricted
    options: PromptOptions = field(default_factory=PromptOptions)

    def effective_tools(self) -> list[ToolDef]:
        """Tools that may become calls: none with tool_choice none, else the allowed subset."""
        if self.tool_choice == "none":
            return []
        if self.allowed_tools is None:
            return list(self.tools)
        allowed = set(self.allowed_tools)
        return [t for t in self.tools if t.identity in allowed]


@dataclass(frozen=True)
class MediaSpan:
    """One contiguous run of expanded placeholder pads in a prompt: an image, or one temporal group
    (frame pair) of a video. `item` indexes Prompt.media; a video has one span per group, in order."""

    start: int  # token index of the first pad
    grid_thw: tuple[int, int, int]  # the run's patch grid: the image's, or (1, h, w) for a video group
    kind: str  # "image" | "video"
    digest: str  # the prepared media's SHA-256: part of the prefix identity
    item: int

    @property
    def num_tokens(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w // 4  # 2x2 spatial merge


@dataclass
class Prompt:
    """A rendered prompt plus the boundaries the context cache needs (token offsets into token_ids)."""

    token_ids: list[int]
    text: str
    thinking: bool  # the prompt ends inside an open reasoning block
    message_ends: list[int] = field(default_factory=list)
    input_boundary: int | None = None  # stable boundary before the response (contract: input checkpoint)
    cache_candidates: list[int] = field(default_factory=list)  # at most 4, ascending
    media: list[Part] = field(default_factory=list)  # image/video parts bound to placeholders, in order
    media_token_offsets: list[int] = field(default_factory=list)  # index of each media's first pad token in token_ids
    media_spans: list[MediaSpan] = field(default_factory=list)  # the expanded pad runs; empty when not expanded
    preserve_thinking: bool | None = None  # the value the template saw; None: the template's default


# ---- output side -----------------------------------------------------------------------------


@dataclass
class ToolCall:
    call_id: str
    name: str
    arguments: dict[str, Any]  # typed by the declared schema, member order as generated
    namespace: str | None = None

    def arguments_json(self) -> str:
        import json

        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class OutputDelta:
    """One streaming step of decoded output. Exactly one of the fields is set."""

    reasoning: str | None = None
    content: str | None = None
    tool_call_start: ToolCall | None = None  # a call's identity became known (arguments may follow)
    tool_call_arguments: tuple[int, str] | None = None  # (call index, JSON text delta)


@dataclass
class ToolParseStats:
    """Tool-call parse diagnostics for the request log (counts only, never arguments or text)."""

    marker_seen: bool = False  # a complete call marker appeared in the answer
    empty_arguments_omitted: int = 0  # empty blocks of declared non-string parameters
    schema_mismatch_arguments: int = 0  # kept for the tool consumer to reject


@dataclass
class DecodedOutput:
    reasoning: str
    content: str
    tool_calls: list[ToolCall]
    fallback_reason: str = "none"  # none, malformed_structure, duplicate_parameter, invalid_tool_name,
    #                                undeclared_tool, trailing_content
    tool_parse: ToolParseStats = field(default_factory=ToolParseStats)
