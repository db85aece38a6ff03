"""The semantic SSE events of a streamed Response (contract: Responses streaming).

Reasoning and answer text stream as they are decoded; function calls are known only once the
output ends, so their Items (added, argument delta, done) come right before the terminal event.
The terminal Response is built first and every `*.done` event repeats its Items, so concatenated
deltas always equal the final Items. Sequence numbers count every event from zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ninfer.chat.ir import OutputDelta
from ninfer.protocol.responses_output import (
    OutputIds,
    ResponseFrame,
    message_item,
    output_text_part,
    reasoning_item,
)

TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete"}  # anything else: failed


@dataclass
class _OpenText:
    """A reasoning or message Item whose one text part is streaming."""

    item_id: str
    index: int
    kind: str  # "reasoning" or "message"
    text: str = ""
    closed: bool = False

    def part(self, text: str) -> dict[str, Any]:
        return {"type": "reasoning_text", "text": text} if self.kind == "reasoning" else output_text_part(text)

    @property
    def delta_type(self) -> str:
        return "response.reasoning_text.delta" if self.kind == "reasoning" else "response.output_text.delta"

    @property
    def done_type(self) -> str:
        return "response.reasoning_text.done" if self.kind == "reasoning" else "response.output_text.done"


class ResponseEvents:
    def __init__(self, frame: ResponseFrame, ids: OutputIds, *, sealed: bool):
        self.frame = frame
        self.ids = ids
        self.sealed = sealed
        self.sequence = 0
        self.next_index = 0
        self.reasoning: _OpenText | None = None
        self.message: _OpenText | None = None

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return payload

    def start(self) -> list[dict[str, Any]]:
        snapshot = self.frame.in_progress()
        return [self.event("response.created", response=snapshot),
                self.event("response.in_progress", response=snapshot)]

    def delta(self, d: OutputDelta) -> list[dict[str, Any]]:
        """Events for one live decoder delta (tool calls wait for `finish`)."""
        if d.reasoning:
            if self.message is not None:
                raise RuntimeError("reasoning arrived after the answer began")
            events = self._open("reasoning") if self.reasoning is None else []
            return events + self._text(self.reasoning, d.reasoning)  # type: ignore[arg-type]
        if d.content:
            events = self._close(self.reasoning, self._reasoning_item("completed")) if self.reasoning else []
            if self.message is None:
                events += self._open("message")
            return events + self._text(self.message, d.content)  # type: ignore[arg-type]
        return []

    def finish(self, response: dict[str, Any]) -> list[dict[str, Any]]:
        """Close every Item as the terminal `response` holds it, add the calls, then the terminal event."""
        events: list[dict[str, Any]] = []
        for item in response["output"]:
            if item["type"] in ("reasoning", "message"):
                state = self.reasoning if item["type"] == "reasoning" else self.message
                if state is None:
                    events += self._open(item["type"])
                    state = self.reasoning if item["type"] == "reasoning" else self.message
                final = item["content"][0]["text"] if item["content"] else ""
                if not final.startswith(state.text):  # type: ignore[union-attr]
                    raise RuntimeError("streamed text disagrees with the final output")
                events += self._text(state, final[len(state.text):])  # type: ignore[union-attr, arg-type]
                events += self._close(state, item)
            else:
                events += self._function_call(item)
        kind = TERMINAL.get(response["status"], "response.failed")
        return events + [self.event(kind, response=response)]

    def failed(self, code: str | None, message: str) -> dict[str, Any]:
        return self.event("response.failed", response=self.frame.failed(code, message))

    # ---- Items ---------------------------------------------------------------------------------

    def _reasoning_item(self, status: str) -> dict[str, Any]:
        assert self.reasoning is not None
        return reasoning_item(self.reasoning.item_id, self.reasoning.text, status, self.sealed)

    def _open(self, kind: str) -> list[dict[str, Any]]:
        item_id = self.ids.reasoning if kind == "reasoning" else self.ids.message
        state = _OpenText(item_id, self.next_index, kind)
        self.next_index += 1
        if kind == "reasoning":
            self.reasoning, item = state, reasoning_item(item_id, None, "in_progress")
        else:
            self.message, item = state, message_item(item_id, None, "in_progress")
        return [self.event("response.output_item.added", output_index=state.index, item=item),
                self.event("response.content_part.added", item_id=item_id, output_index=state.index,
                           content_index=0, part=state.part(""))]

    def _text(self, state: _OpenText, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        state.text += text
        extra = {"logprobs": []} if state.kind == "message" else {}
        return [self.event(state.delta_type, item_id=state.item_id, output_index=state.index, content_index=0,
                           delta=text, **extra)]

    def _close(self, state: _OpenText, item: dict[str, Any]) -> list[dict[str, Any]]:
        if state.closed:
            return []
        state.closed = True
        extra = {"logprobs": []} if state.kind == "message" else {}
        return [self.event(state.done_type, item_id=state.item_id, output_index=state.index, content_index=0,
                           text=state.text, **extra),
                self.event("response.content_part.done", item_id=state.item_id, output_index=state.index,
                           content_index=0, part=state.part(state.text)),
                self.event("response.output_item.done", output_index=state.index, item=item)]

    def _function_call(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        index = self.next_index
        self.next_index += 1
        added = {**item, "status": "in_progress", "arguments": ""}
        return [self.event("response.output_item.added", output_index=index, item=added),
                self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                           delta=item["arguments"]),
                self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                           name=item["name"], arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=index, item=item)]
