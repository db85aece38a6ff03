"""Responses output: the status of a finish, usage, the output Items and the Response object.

Output Items appear in the one order a turn can be replayed in: reasoning, then the assistant
message, then function calls. Their ids are handed out by `OutputIds` as each Item appears, so a
stream's events and its terminal Response name the same Items.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from ninfer.chat.ir import DecodedOutput, ToolCall
from ninfer.engine.types import FinishReason, Usage
from ninfer.protocol.reasoning_seal import seal
from ninfer.protocol.responses_items import new_item_id


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(24)


def response_status(reason: FinishReason) -> str:
    """Output-limit and context finishes are incomplete; model and string stops complete."""
    if reason in (FinishReason.LENGTH, FinishReason.CONTEXT):
        return "incomplete"
    if reason is FinishReason.CANCELLED:
        return "cancelled"
    return "completed"


def usage_json(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": min(usage.cached_tokens, usage.prompt_tokens)},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


@dataclass
class OutputIds:
    reasoning: str = field(default_factory=lambda: new_item_id("rs"))
    message: str = field(default_factory=lambda: new_item_id("msg"))
    calls: list[str] = field(default_factory=list)

    def call(self, index: int) -> str:
        while len(self.calls) <= index:
            self.calls.append(new_item_id("fc"))
        return self.calls[index]


def has_message(decoded: DecodedOutput, status: str) -> bool:
    """A message holds the answer text; an empty one only stands for a completed turn with no other Item."""
    if decoded.content:
        return True
    return not decoded.reasoning and not decoded.tool_calls and status == "completed"


def output_items(decoded: DecodedOutput, status: str, ids: OutputIds, *, sealed: bool) -> list[dict[str, Any]]:
    done = "completed" if status == "completed" else "incomplete"
    items: list[dict[str, Any]] = []
    if decoded.reasoning:
        followed = bool(decoded.content or decoded.tool_calls)  # reasoning that led somewhere is complete
        items.append(reasoning_item(ids.reasoning, decoded.reasoning, "completed" if followed else done, sealed))
    if has_message(decoded, status):
        items.append(message_item(ids.message, decoded.content, done))
    for index, call in enumerate(decoded.tool_calls):
        items.append(function_call_item(ids.call(index), call, "completed"))
    return items


def reasoning_item(item_id: str, text: str | None, status: str, sealed: bool = False) -> dict[str, Any]:
    """`text` None: the in-progress shape, before any reasoning arrived."""
    item = {"id": item_id, "type": "reasoning", "status": status, "summary": [],
            "content": [] if text is None else [{"type": "reasoning_text", "text": text}]}
    if sealed and text is not None:
        item["encrypted_content"] = seal(text)
    return item


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [] if text is None else [output_text_part(text)]}


def function_call_item(item_id: str, call: ToolCall, status: str, arguments: str | None = None) -> dict[str, Any]:
    item = {"id": item_id, "type": "function_call", "status": status, "call_id": call.call_id, "name": call.name}
    if call.namespace:
        item["namespace"] = call.namespace
    item["arguments"] = call.arguments_json() if arguments is None else arguments
    return item


def history_items(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output Items as a continuation replays them: the raw text already holds what the seal holds."""
    return [{k: v for k, v in item.items() if k != "encrypted_content"} for item in output]


@dataclass
class ResponseFrame:
    """The parts of one Response object fixed at creation: id, time and the echoed request values."""

    echo: dict[str, Any]
    id: str = field(default_factory=new_response_id)
    created_at: int = field(default_factory=lambda: int(time.time()))

    def object(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
               error: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            **self.echo, "output": output, "usage": usage,
        }

    def in_progress(self) -> dict[str, Any]:
        return self.object("in_progress", [], None)

    def failed(self, code: str | None, message: str) -> dict[str, Any]:
        return self.object("failed", [], None, {"code": code, "message": message})
