"""Anthropic Messages output shapes: the aggregate message and the SSE block lifecycle.

The chat frontend's output decoder already splits reasoning, answer text and tool calls; this module
only shapes them. Every thinking block's signature is the raw reasoning sealed (reasoning_seal): with
display "omitted" it is the only copy the client holds, and either way a replay restores the exact
prompt without server-side state, across restarts.

Usage is checkpoint-native: input_tokens is the part of the prompt the engine computed,
cache_read_input_tokens the exact prefix it reused; cache creation is not measured, so it is
reported as unknown (null).
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field
from typing import Any

from ninfer.chat.ir import DecodedOutput, OutputDelta, ToolCall
from ninfer.engine.types import FinishEvent, FinishReason
from ninfer.protocol.reasoning_seal import seal

Event = tuple[str, dict[str, Any]]  # (SSE event name, payload whose "type" is that name)

_ALPHABET = string.ascii_letters + string.digits
_STOP_REASONS = {
    FinishReason.STOP_STRING: "stop_sequence",
    FinishReason.LENGTH: "max_tokens",
    FinishReason.CONTEXT: "model_context_window_exceeded",
}


def _token(n: int = 24) -> str:
    return "".join(secrets.choice(_ALPHABET) for _ in range(n))


def new_message_id() -> str:
    return "msg_" + _token()


def adopt_tool_use_id(call: ToolCall) -> str:
    """Give a decoded call an Anthropic-style id (once), which both output paths then show."""
    if not call.call_id.startswith("toolu_"):
        call.call_id = "toolu_" + _token()
    return call.call_id


@dataclass
class Identity:
    model: str  # the client's label, echoed
    id: str = field(default_factory=new_message_id)


def usage_json(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, Any]:
    cached = min(cached_tokens, prompt_tokens)
    return {"input_tokens": prompt_tokens - cached, "cache_creation_input_tokens": None,
            "cache_read_input_tokens": cached, "output_tokens": output_tokens}


def final_usage(fin: FinishEvent) -> dict[str, Any]:
    u = fin.usage
    return usage_json(u.prompt_tokens, u.cached_tokens, u.completion_tokens)


def stop_fields(fin: FinishEvent, has_tool_calls: bool) -> dict[str, Any]:
    """Output-limit and context finishes win over a parsed call, as the call may be cut short."""
    if fin.reason in _STOP_REASONS:
        reason = _STOP_REASONS[fin.reason]
    else:
        reason = "tool_use" if has_tool_calls else "end_turn"
    return {"stop_reason": reason, "stop_sequence": fin.stop_string if reason == "stop_sequence" else None}


def thinking_block(reasoning: str, sealed: bool) -> dict[str, Any]:
    return {"type": "thinking", "thinking": "" if sealed else reasoning, "signature": seal(reasoning)}


def tool_use_block(call: ToolCall, *, streaming: bool = False) -> dict[str, Any]:
    return {"type": "tool_use", "id": adopt_tool_use_id(call), "name": call.name,
            "input": {} if streaming else call.arguments}


def message_json(identity: Identity, decoded: DecodedOutput, fin: FinishEvent, *, sealed: bool) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if decoded.reasoning:
        content.append(thinking_block(decoded.reasoning, sealed))
    if decoded.content:
        content.append({"type": "text", "text": decoded.content})
    content += [tool_use_block(call) for call in decoded.tool_calls]
    return {"id": identity.id, "type": "message", "role": "assistant", "model": identity.model, "content": content,
            **stop_fields(fin, bool(decoded.tool_calls)), "usage": final_usage(fin)}


class EventWriter:
    """Decoder deltas -> Anthropic SSE events, one open content block at a time.

    A thinking block's signature seals everything it streamed, so its signature_delta comes just
    before the block closes; with display "omitted" the reasoning itself is never streamed.
    """

    def __init__(self, identity: Identity, *, sealed: bool):
        self.identity = identity
        self.sealed = sealed
        self.started = False
        self._index = -1
        self._open: str | None = None  # kind of the open block
        self._reasoning: list[str] = []

    def start(self, prompt_tokens: int, cached_tokens: int) -> list[Event]:
        """message_start, once the engine admitted the request and its reused prefix is known."""
        self.started = True
        message = {"id": self.identity.id, "type": "message", "role": "assistant", "model": self.identity.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": usage_json(prompt_tokens, cached_tokens, 0)}
        return [("message_start", {"type": "message_start", "message": message})]

    def delta(self, d: OutputDelta) -> list[Event]:
        if d.reasoning:
            events = self._ensure_open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self._reasoning.append(d.reasoning)
            if not self.sealed:
                events.append(self._delta({"type": "thinking_delta", "thinking": d.reasoning}))
            return events
        if d.content:
            events = self._ensure_open("text", {"type": "text", "text": ""})
            return events + [self._delta({"type": "text_delta", "text": d.content})]
        if d.tool_call_start is not None:
            return self._close() + self._open_block("tool_use", tool_use_block(d.tool_call_start, streaming=True))
        if d.tool_call_arguments is not None and d.tool_call_arguments[1]:
            return [self._delta({"type": "input_json_delta", "partial_json": d.tool_call_arguments[1]})]
        return []

    def finish(self, fin: FinishEvent, has_tool_calls: bool) -> list[Event]:
        return self._close() + [
            ("message_delta", {"type": "message_delta", "delta": stop_fields(fin, has_tool_calls),
                               "usage": final_usage(fin)}),
            ("message_stop", {"type": "message_stop"}),
        ]

    def _ensure_open(self, kind: str, block: dict[str, Any]) -> list[Event]:
        return [] if self._open == kind else self._close() + self._open_block(kind, block)

    def _open_block(self, kind: str, block: dict[str, Any]) -> list[Event]:
        self._index += 1
        self._open = kind
        return [("content_block_start", {"type": "content_block_start", "index": self._index, "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> Event:
        return ("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        events = []
        if self._open == "thinking":
            events.append(self._delta({"type": "signature_delta", "signature": seal("".join(self._reasoning))}))
        events.append(("content_block_stop", {"type": "content_block_stop", "index": self._index}))
        self._open = None
        return events
