"""Anthropic Messages: the request schema, and parse_body, which validates a decoded body against it.

The pydantic models are the wire contract (types, ranges, required fields). Block and tool types
the server cannot execute still parse, into a catch-all model that keeps only their `type`, so the
lowering can refuse them with the missing capability named instead of a generic "unknown type".
Unknown top-level fields are advisory and ignored, as Anthropic clients send many of them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from ninfer.protocol.errors import from_validation_error, invalid

TOOL_NAME = r"^[A-Za-z0-9_-]{1,128}$"


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, protected_namespaces=())


def _tagged(supported: tuple[str, ...], *, untyped: str | None = None):
    """A discriminator that routes supported `type` values to their model and everything else to 'other'.

    Tags are spelled `type=<kind>` so that none equals a field name: error paths are rebuilt by walking
    the location through the received JSON, and a tag named like a field (text, thinking) would be taken
    for it.
    """

    def tag(value: Any) -> str:
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        if kind is None and untyped is not None:
            kind = untyped
        return _tag_name(kind if isinstance(kind, str) and kind in supported else "other")

    return Discriminator(tag)


def _tag_name(kind: str) -> str:
    return f"type={kind}"


def _tag(kind: str) -> Tag:
    return Tag(_tag_name(kind))


class CacheControl(_Model):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class OtherBlock(_Model):
    """A block type this server does not execute (documents, server-tool results, ...); refused by name."""

    type: str


# ---- content blocks --------------------------------------------------------------------------


class TextBlock(_Model):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: Any = None  # citation metadata of earlier answers: not prompt content


class Base64Source(_Model):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class URLSource(_Model):
    type: Literal["url"]
    url: str


class FileSource(_Model):
    type: Literal["file"]
    file_id: str


ImageSource = Annotated[Union[Base64Source, URLSource, FileSource], Field(discriminator="type")]


class ImageBlock(_Model):
    type: Literal["image"]
    source: ImageSource
    cache_control: CacheControl | None = None


class ThinkingBlock(_Model):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None  # transport metadata; required by Anthropic, optional here


class RedactedThinkingBlock(_Model):
    type: Literal["redacted_thinking"]
    data: str


class ToolUseBlock(_Model):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(pattern=TOOL_NAME)
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: dict[str, Any] | None = None


ResultContentBlock = Annotated[
    Union[Annotated[TextBlock, _tag("text")], Annotated[ImageBlock, _tag("image")],
          Annotated[OtherBlock, _tag("other")]],
    _tagged(("text", "image")),
]


class ToolResultBlock(_Model):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: Union[str, list[ResultContentBlock], None] = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


_BLOCKS = ("text", "image", "thinking", "redacted_thinking", "tool_use", "tool_result")
Block = Annotated[
    Union[Annotated[TextBlock, _tag("text")], Annotated[ImageBlock, _tag("image")],
          Annotated[ThinkingBlock, _tag("thinking")], Annotated[RedactedThinkingBlock, _tag("redacted_thinking")],
          Annotated[ToolUseBlock, _tag("tool_use")], Annotated[ToolResultBlock, _tag("tool_result")],
          Annotated[OtherBlock, _tag("other")]],
    _tagged(_BLOCKS),
]
Content = Union[str, list[Block]]


# ---- messages --------------------------------------------------------------------------------


class UserMessage(_Model):
    role: Literal["user"]
    content: Content


class AssistantMessage(_Model):
    role: Literal["assistant"]
    content: Content


class SystemMessage(_Model):
    """An inline system message (beta wire form); it keeps its position in the conversation."""

    role: Literal["system"]
    content: Content


Message = Annotated[Union[UserMessage, AssistantMessage, SystemMessage], Field(discriminator="role")]


# ---- tools -----------------------------------------------------------------------------------


class CustomTool(_Model):
    type: Literal["custom"] | None = None
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    input_examples: list[dict[str, Any]] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None
    defer_loading: bool | None = None
    allowed_callers: list[str] | None = None
    eager_input_streaming: bool | None = None  # a streaming granularity hint; input always arrives whole


class OtherTool(_Model):
    """Anthropic-provided tools, server tools and toolsets: refused by type."""

    type: str


Tool = Annotated[Union[Annotated[CustomTool, _tag("custom")], Annotated[OtherTool, _tag("other")]],
                 _tagged(("custom",), untyped="custom")]


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


# ---- thinking and output ---------------------------------------------------------------------


class ThinkingEnabled(_Model):
    type: Literal["enabled"]
    budget_tokens: int
    display: Literal["summarized", "omitted"] | None = None


class ThinkingAdaptive(_Model):
    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(_Model):
    type: Literal["disabled"]


class ThinkingOther(_Model):
    type: str


Thinking = Annotated[
    Union[Annotated[ThinkingEnabled, _tag("enabled")], Annotated[ThinkingAdaptive, _tag("adaptive")],
          Annotated[ThinkingDisabled, _tag("disabled")], Annotated[ThinkingOther, _tag("other")]],
    _tagged(("enabled", "adaptive", "disabled")),
]


class OutputConfig(_Model):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: Any = None


class Metadata(_Model):
    user_id: str | None = None  # Claude Code sends a JSON document as this string; advisory


class MessagesBody(_Model):
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    system: Union[str, list[TextBlock], None] = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=20)
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None
    metadata: Metadata | None = None
    service_tier: str | None = None
    inference_geo: str | None = None
    container: Any = None
    mcp_servers: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # ninfer extension, shared with Chat Completions
    preserve_thinking: bool | None = None  # ninfer extension


def parse_body(body: Any) -> MessagesBody:
    """Validate a decoded JSON body; raises ProtocolError naming the first offending field."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_type")
    try:
        return MessagesBody.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc.errors(), body, {"role": "unsupported_role"}) from None
