"""Lowering: the conversation IR into the messages and tools a chat template reads.

The shapes are the Hugging Face chat-template conventions (OpenAI-style dicts). Every client string
is made inert here (see control_tokens), and every place a cache write may land is recorded as a
site in the lowered messages, so the prompt builder can find it in the rendered text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from ninfer.chat import ir
from ninfer.chat.control_tokens import ControlTokens
from ninfer.chat.errors import InvalidPromptError

ERROR_RESULT_PREFIX = "Error: "  # how a tool result with is_error reads to the model


def prompt_tool_name(namespace: str | None, name: str) -> str:
    """The one name a template and the model know a tool by: namespace members are flattened."""
    return f"{namespace}__{name}" if namespace else name


@dataclass(frozen=True)
class Site:
    """Where a part ends in the lowered messages: in string content (item None) or in a content item."""

    message: int
    item: int | None
    offset: int | None  # characters into the string / item text; None: right after the (media) item


@dataclass(frozen=True)
class CacheSpot:
    """A place a shared-prefix write may go, in prompt order."""

    kind: Literal["part", "message_end", "tool"]
    explicit: bool
    site: Site | None = None  # kind "part"
    message: int | None = None  # kind "message_end": index of the lowered message
    tool: int | None = None  # kind "tool": index into the rendered tools


@dataclass
class Lowered:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    media: list[ir.Part] = field(default_factory=list)  # image/video parts in rendering order
    spots: list[CacheSpot] = field(default_factory=list)

    @property
    def roles(self) -> list[str]:
        return [m["role"] for m in self.messages]


class _Content:
    """Builds one message's content: a string, or content items when media is present.

    Adjacent text parts join without separators into one text run (the template would print them
    back to back anyway), so a control spelling split across parts is still seen whole.
    """

    def __init__(self, controls: ControlTokens):
        self._controls = controls
        self._segments: list[list[str] | str] = []  # a text run (list of pieces) or a media kind
        self.has_media = False

    def add_text(self, text: str) -> tuple[int, int]:
        if not self._segments or not isinstance(self._segments[-1], list):
            self._segments.append([])
        run = self._segments[-1]
        assert isinstance(run, list)
        run.append(text)
        return len(self._segments) - 1, sum(map(len, run))

    def add_media(self, kind: str) -> int:
        self.has_media = True
        self._segments.append(kind)
        return len(self._segments) - 1

    def end(self) -> tuple[int, int | None] | None:
        if not self._segments:
            return None
        last = self._segments[-1]
        return len(self._segments) - 1, (sum(map(len, last)) if isinstance(last, list) else None)

    @property
    def empty(self) -> bool:
        return not self._segments

    def site(self, message: int, segment: int, offset: int | None) -> Site:
        return Site(message, segment if self.has_media else None, offset)

    def value(self) -> str | list[dict[str, Any]]:
        if not self.has_media:
            return self._controls.inert("".join(self._segments[0])) if self._segments else ""
        items: list[dict[str, Any]] = []
        for seg in self._segments:
            if isinstance(seg, list):
                items.append({"type": "text", "text": self._controls.inert("".join(seg))})
            else:
                items.append({"type": seg})
        return items


class _Lowering:
    def __init__(self, conversation: ir.Conversation, controls: ControlTokens, developer_as_system: bool):
        self.conv = conversation
        self.controls = controls
        self.developer_as_system = developer_as_system
        self.out = Lowered(messages=[], tools=None)
        # Sites are recorded against content builders and resolved once each message is final.
        self._pending: list[tuple[_Content, int, int | None, bool]] = []  # (content, segment, offset, explicit)

    def run(self) -> Lowered:
        self._tools()
        for i, message in enumerate(self.conv.messages):
            if message.role == "assistant":
                self._assistant(message, f"messages[{i}]")
            else:
                self._turn(message, f"messages[{i}]")
        return self.out

    # ---- tools ----------------------------------------------------------------------------

    def _tools(self) -> None:
        if not self.conv.tools:
            return
        seen: dict[str, ir.ToolDef] = {}
        rendered = []
        for k, tool in enumerate(self.conv.tools):
            name = prompt_tool_name(tool.namespace, tool.name)
            if name in seen:
                raise InvalidPromptError(f"tools {seen[name].identity} and {tool.identity} share the name {name!r}",
                                         param=f"tools[{k}]")
            seen[name] = tool
            function: dict[str, Any] = {"name": self.controls.inert(name)}
            if tool.description is not None:
                function["description"] = self.controls.inert(tool.description)
            if tool.parameters is not None:
                function["parameters"] = self.controls.inert_value(tool.parameters)
            rendered.append({"type": "function", "function": function})
            if tool.cache is not None:
                self.out.spots.append(CacheSpot("tool", explicit=True, tool=k))
        self.out.tools = rendered

    # ---- messages -------------------------------------------------------------------------

    def _role(self, role: str) -> str:
        return "system" if role == "developer" and self.developer_as_system else role

    def _emit(self, message: dict[str, Any], content: _Content) -> int:
        index = len(self.out.messages)
        message["content"] = content.value()
        self.out.messages.append(message)
        for builder, segment, offset, explicit in self._pending:
            if builder is content:
                self.out.spots.append(CacheSpot("part", explicit, site=content.site(index, segment, offset)))
        self._pending = [p for p in self._pending if p[0] is not content]
        return index

    def _add_part(self, content: _Content, part: ir.Part) -> None:
        """Text, refusal or media into `content`, recording where the part ends when it is cacheable."""
        if isinstance(part, (ir.TextPart, ir.RefusalPart)):
            segment, offset = content.add_text(part.text)
            if isinstance(part, ir.TextPart):
                self._pending.append((content, segment, offset, part.cache is not None))
        else:
            assert isinstance(part, (ir.ImagePart, ir.VideoPart))
            segment = content.add_media(part.type)
            self.out.media.append(part)
            self._pending.append((content, segment, None, part.cache is not None))

    def _turn(self, message: ir.Message, param: str) -> None:
        """A system/developer/user/tool turn; each tool result becomes a template tool message of its own."""
        role = self._role(message.role)
        content = _Content(self.controls)
        emitted = False
        for j, part in enumerate(message.parts):
            if isinstance(part, ir.ToolResultPart):
                if not content.empty:
                    self._emit({"role": role}, content)
                    content = _Content(self.controls)
                self._tool_result(part)
                emitted = True
            elif isinstance(part, (ir.TextPart, ir.RefusalPart, ir.ImagePart, ir.VideoPart)):
                self._add_part(content, part)
            else:
                raise InvalidPromptError(f"a {message.role} message cannot carry a {part.type} part",
                                         param=f"{param}.content[{j}]")
        if not content.empty or not emitted:
            self._emit({"role": role}, content)

    def _tool_result(self, part: ir.ToolResultPart) -> None:
        content = _Content(self.controls)
        if part.is_error:
            content.add_text(ERROR_RESULT_PREFIX)
        for inner in part.content:
            self._add_part(content, inner)
        end = content.end()
        if end is not None:
            self._pending.append((content, end[0], end[1], part.cache is not None))
        self._emit({"role": "tool", "tool_call_id": self.controls.inert(part.call_id)}, content)

    def _assistant(self, message: ir.Message, param: str) -> None:
        """Reasoning, then content, then calls: the only order a template can render an assistant turn in."""
        content = _Content(self.controls)
        reasoning: list[str] = []
        calls: list[dict[str, Any]] = []
        cached_call = False
        stage = 0
        for j, part in enumerate(message.parts):
            rank = {"reasoning": 0, "tool_call": 2, "tool_result": 3}.get(part.type, 1)
            if rank == 3:
                raise InvalidPromptError("an assistant message cannot carry a tool result", param=f"{param}.content[{j}]")
            if rank < stage:
                raise InvalidPromptError(
                    "assistant history must read reasoning, then content, then tool calls; this order cannot be "
                    "rendered", param=f"{param}.content[{j}]", code="invalid_assistant_history")
            stage = rank
            if isinstance(part, ir.ReasoningPart):
                reasoning.append(part.text)
            elif isinstance(part, ir.ToolCallPart):
                calls.append(self._call(part))
                cached_call = cached_call or part.cache is not None
            else:
                self._add_part(content, part)
        lowered: dict[str, Any] = {"role": "assistant"}
        if reasoning:
            lowered["reasoning_content"] = self.controls.inert("".join(reasoning))
        if calls:
            lowered["tool_calls"] = calls
        index = self._emit(lowered, content)
        if cached_call:
            self.out.spots.append(CacheSpot("message_end", explicit=True, message=index))

    def _call(self, part: ir.ToolCallPart) -> dict[str, Any]:
        name = prompt_tool_name(part.namespace, part.name)
        return {"id": self.controls.inert(part.call_id), "type": "function",
                "function": {"name": self.controls.inert(name),
                             "arguments": self.controls.inert_value(_arguments(part))}}


def _arguments(part: ir.ToolCallPart) -> Any:
    """The parsed object, member order kept; client text that is not a JSON object is replayed as given."""
    if part.raw_arguments is not None:
        try:
            parsed = json.loads(part.raw_arguments)
        except ValueError:
            return part.raw_arguments
        if not isinstance(parsed, dict):
            return part.raw_arguments
    return part.arguments


def lower(conversation: ir.Conversation, controls: ControlTokens, *, developer_as_system: bool) -> Lowered:
    if not conversation.messages:
        raise InvalidPromptError("a conversation needs at least one message", param="messages")
    return _Lowering(conversation, controls, developer_as_system).run()
