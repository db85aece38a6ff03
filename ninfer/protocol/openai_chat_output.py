"""OpenAI Chat Completions output shapes: the aggregate object and the stream's chunks.

Engine events arrive as committed tokens with text per channel; the chat frontend's output decoder
turns that text into reasoning, content and tool-call deltas. This module only shapes them.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from ninfer.engine.types import FinishEvent, FinishReason, ProgressEvent


def new_completion_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def adopt_call_id(call) -> str:
    """Give a decoded call an id (once) when the model gave none, which both output paths then show."""
    if not call.call_id:
        call.call_id = new_call_id()
    return call.call_id


def finish_reason(reason: FinishReason, has_tool_calls: bool) -> str:
    """Output-limit and context finishes are `length` even after a call; cancelled reads as `stop`."""
    if reason in (FinishReason.LENGTH, FinishReason.CONTEXT):
        return "length"
    return "tool_calls" if has_tool_calls else "stop"


def usage_json(fin: FinishEvent) -> dict[str, Any]:
    u = fin.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": min(u.cached_tokens, u.prompt_tokens)},
            "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens}}


def tool_call_json(call, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": adopt_call_id(call), "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments_json()}}
    if index is not None:
        out["index"] = index
    return out


@dataclass
class Identity:
    model: str
    id: str = field(default_factory=new_completion_id)
    created: int = field(default_factory=lambda: int(time.time()))

    def base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def aggregate(identity: Identity, decoded, fin: FinishEvent) -> dict[str, Any]:
    calls = list(decoded.tool_calls)
    message: dict[str, Any] = {"role": "assistant", "content": decoded.content, "refusal": None}
    if decoded.reasoning:
        message["reasoning_content"] = decoded.reasoning
    if calls:
        message["content"] = decoded.content or None
        message["tool_calls"] = [tool_call_json(c) for c in calls]
    choice = {"index": 0, "message": message, "logprobs": None,
              "finish_reason": finish_reason(fin.reason, bool(calls))}
    return {**identity.base("chat.completion"), "choices": [choice], "usage": usage_json(fin),
            "timings": fin.timings.as_dict()}


class ChunkWriter:
    """Builds the stream's chunk payloads in contract order: role, progress, deltas, finish, usage."""

    def __init__(self, identity: Identity, *, include_usage: bool):
        self.identity = identity
        self.include_usage = include_usage
        self.calls = 0

    def chunk(self, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        out = {**self.identity.base("chat.completion.chunk"),
               "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if self.include_usage:
            out["usage"] = None  # OpenAI's shape: null on every chunk before the usage chunk
        out.update(extra)
        return out

    def role(self) -> dict[str, Any]:
        return self.chunk({"role": "assistant", "content": ""})

    def progress(self, ev: ProgressEvent) -> dict[str, Any]:
        return self.chunk({}, prompt_progress={"total": ev.total, "cache": ev.cache, "processed": ev.processed,
                                               "time_ms": int(ev.time_ms)})

    def delta(self, d, timings: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """One output-decoder delta as a chunk (None for an empty one); text chunks carry `timings`
        (timings_per_token: the cumulative timings seen so far) when given."""
        extra = {"timings": timings} if timings is not None else {}
        if d.reasoning:
            return self.chunk({"reasoning_content": d.reasoning}, **extra)
        if d.content:
            return self.chunk({"content": d.content}, **extra)
        if d.tool_call_start is not None:
            call = d.tool_call_start
            self.calls += 1
            entry = {"index": self.calls - 1, "id": adopt_call_id(call), "type": "function",
                     "function": {"name": call.name, "arguments": ""}}
            return self.chunk({"tool_calls": [entry]})
        if d.tool_call_arguments is not None:
            index, text = d.tool_call_arguments
            return self.chunk({"tool_calls": [{"index": index, "function": {"arguments": text}}]}) if text else None
        return None

    def finish(self, decoded, fin: FinishEvent) -> list[dict[str, Any]]:
        """The finish chunk, then the usage chunk when asked; terminal timings ride on the last one."""
        timings = fin.timings.as_dict()
        reason = finish_reason(fin.reason, bool(decoded.tool_calls))
        if not self.include_usage:
            return [self.chunk({}, reason, timings=timings)]
        usage_chunk = {**self.identity.base("chat.completion.chunk"), "choices": [], "usage": usage_json(fin),
                       "timings": timings}
        return [self.chunk({}, reason), usage_chunk]
