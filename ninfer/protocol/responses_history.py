"""From a flat Item history to conversation turns (contract: the Responses input Item contract).

Contiguous assistant-owned Items (reasoning, assistant messages, function calls) form one assistant
turn, which a chat template can only render as reasoning, then content, then calls; an order that
would need rearranging is refused. Function results must directly follow the turn that made the
calls; they are matched by call_id and put in call order, because the Qwen prompt shows results
without ids and the model pairs them with calls by position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ninfer.chat import ir
from ninfer.protocol.errors import ProtocolError, invalid
from ninfer.protocol.responses_items import Item

_STAGE = {"reasoning": 0, "message": 1, "function_call": 2}
_STAGE_NAMES = ("reasoning", "assistant message content", "function_call")


def invalid_tool_history(message: str, param: str) -> ProtocolError:
    return invalid(message, param, "invalid_tool_history")


@dataclass
class _Turn:
    message: ir.Message
    where: str
    calls: list[tuple[ir.ToolCallPart, str]] = field(default_factory=list)  # (call, its Item's path)
    result: Item | None = None  # a function_call_output Item

    @property
    def call_id(self) -> str:
        assert self.result is not None
        return self.result.parts[0].call_id  # type: ignore[union-attr]


def conversation_messages(items: list[Item]) -> list[ir.Message]:
    """The IR messages of a complete Item history (a stored chain followed by the new input)."""
    return _order_results(_group(items))


def has_user_query(messages: list[ir.Message]) -> bool:
    return any(m.role == "user" for m in messages)


def _group(items: list[Item]) -> list[_Turn]:
    turns: list[_Turn] = []
    assistant: _Turn | None = None
    stage = 0
    for item in items:
        if not item.assistant_owned:
            assistant = None
            if item.kind == "function_call_output":
                turns.append(_Turn(ir.Message("tool", list(item.parts)), item.where, result=item))
            else:
                turns.append(_Turn(ir.Message(item.role, list(item.parts)), item.where))  # type: ignore[arg-type]
            continue
        rank = _STAGE[item.kind]
        if assistant is None:
            assistant, stage = _Turn(ir.Message("assistant", []), item.where), rank
            turns.append(assistant)
        elif rank < stage:
            raise invalid(f"{item.where}: {_STAGE_NAMES[rank]} cannot follow {_STAGE_NAMES[stage]} in one assistant "
                          "turn; the representable order is reasoning, then message content, then function calls",
                          item.where, "invalid_assistant_history")
        stage = rank
        assistant.message.parts.extend(item.parts)
        if item.kind == "function_call":
            assistant.calls.append((item.parts[0], item.where))  # type: ignore[arg-type]
    return turns


def _order_results(turns: list[_Turn]) -> list[ir.Message]:
    owners: dict[str, str] = {}
    for turn in turns:
        for call, where in turn.calls:
            if call.call_id in owners:
                raise invalid_tool_history(f"{where}: call_id {call.call_id!r} is already used by {owners[call.call_id]}",
                                           f"{where}.call_id")
            owners[call.call_id] = where
    out: list[ir.Message] = []
    i = 0
    while i < len(turns):
        turn = turns[i]
        if turn.result is not None:
            known = turn.call_id in owners
            raise invalid_tool_history(
                f"{turn.where}: the result for call_id {turn.call_id!r} " + (
                    "must directly follow the assistant turn that made the call" if known
                    else "answers no function_call in the conversation"), f"{turn.where}.call_id")
        out.append(turn.message)
        i += 1
        if turn.calls:
            results, i = _results_for(turn, turns, i)
            if results:
                out.append(ir.Message("tool", results))
    return out


def _results_for(turn: _Turn, turns: list[_Turn], i: int) -> tuple[list[ir.Part], int]:
    """The results following `turn`, in call order; they must answer its first N calls."""
    position = {call.call_id: k for k, (call, _) in enumerate(turn.calls)}
    slots: list[_Turn | None] = [None] * len(turn.calls)
    while i < len(turns) and turns[i].result is not None:
        result = turns[i]
        k = position.get(result.call_id)
        param = f"{result.where}.call_id"
        if k is None:
            raise invalid_tool_history(f"{result.where}: call_id {result.call_id!r} is not one of the calls of the "
                                       "assistant turn it follows", param)
        if slots[k] is not None:
            raise invalid_tool_history(f"{result.where}: call_id {result.call_id!r} already has a result", param)
        call = turn.calls[k][0]
        asserted = result.result.asserted  # type: ignore[union-attr]
        if asserted is not None and asserted != (call.namespace, call.name):
            raise invalid_tool_history(f"{result.where}: the name does not match the function of call_id "
                                       f"{result.call_id!r}", f"{result.where}.name")
        slots[k] = result
        i += 1
    answered = sum(slot is not None for slot in slots)
    if any(slot is None for slot in slots[:answered]):
        missing = turn.calls[slots.index(None)][0].call_id
        raise invalid_tool_history(f"{turn.where}: results must answer the first calls in order; call_id {missing!r} "
                                   "has none while a later call does", turn.where)
    return [slot.message.parts[0] for slot in slots[:answered]], i  # type: ignore[union-attr]
