"""Conversation structure of Anthropic history: joined turns, tool results in call order, prefill.

Consecutive user or assistant messages form one turn (joined without separators). After an
assistant turn that calls tools, the next user turn must open with exactly one tool_result per call;
results are then put in call order, which is the only order the prompt can show them in. A history
that opens with results (cut off, or imported from elsewhere) is accepted as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ninfer.chat import ir
from ninfer.protocol.errors import invalid

HISTORY = "invalid_tool_history"


@dataclass
class Turn:
    role: str
    parts: list[ir.Part] = field(default_factory=list)
    params: list[str] = field(default_factory=list)  # the wire path of each part
    message_params: list[str] = field(default_factory=list)  # the wire messages joined into this turn
    thinking_params: list[str] = field(default_factory=list)  # thinking blocks, kept or not (prefill rule)

    def add(self, part: ir.Part, param: str) -> None:
        self.parts.append(part)
        self.params.append(param)

    def calls(self) -> list[ir.ToolCallPart]:
        return [p for p in self.parts if isinstance(p, ir.ToolCallPart)]


def join(turns: list[Turn]) -> list[Turn]:
    """Consecutive user or assistant turns as one; system turns keep their own position."""
    out: list[Turn] = []
    for turn in turns:
        last = out[-1] if out else None
        if last is not None and last.role == turn.role and turn.role in ("user", "assistant"):
            last.parts += turn.parts
            last.params += turn.params
            last.message_params += turn.message_params
            last.thinking_params += turn.thinking_params
        else:
            out.append(turn)
    return out


_ASSISTANT_RANK = {"reasoning": 0, "text": 1, "tool_call": 2}


def check_assistant_order(turn: Turn) -> None:
    """Thinking, then text, then tool_use: the only order a Qwen assistant turn can be rendered in."""
    rank = 0
    for part, param in zip(turn.parts, turn.params):
        now = _ASSISTANT_RANK[part.type]
        if now < rank:
            raise invalid(f"{param}: an assistant turn must read thinking, then text, then tool_use; this "
                          f"{'thinking' if part.type == 'reasoning' else part.type} block comes too late to be "
                          "rendered", param, "invalid_assistant_history")
        rank = now


def order_tool_results(turns: list[Turn]) -> None:
    """Check every tool_result against the calls it answers and reorder them to call order, in place."""
    conversation_started = False
    previous: Turn | None = None
    for k, turn in enumerate(turns):
        if turn.role == "assistant":
            _unique_call_ids(turn)
            following = turns[k + 1] if k + 1 < len(turns) else None
            if turn.calls() and following is not None and following.role != "user":
                raise invalid(f"{turn.message_params[-1]}: the tool_use blocks of this turn need their tool_result "
                              f"blocks in the next user message", turn.message_params[-1], HISTORY)
        elif turn.role == "user":
            results = _leading_results(turn)
            calls = previous.calls() if previous is not None and previous.role == "assistant" else []
            if calls:
                _match(turn, results, calls)
            elif results and conversation_started:
                raise invalid(f"{turn.params[0]}: a tool_result must answer a tool_use of the assistant turn "
                              f"right before it", turn.params[0], HISTORY)
        conversation_started = conversation_started or turn.role in ("user", "assistant")
        previous = turn


def _unique_call_ids(turn: Turn) -> None:
    seen: set[str] = set()
    for part, param in zip(turn.parts, turn.params):
        if isinstance(part, ir.ToolCallPart):
            if part.call_id in seen:
                raise invalid(f"{param}.id: tool_use id {part.call_id!r} is used twice in one turn", f"{param}.id",
                              HISTORY)
            seen.add(part.call_id)


def _leading_results(turn: Turn) -> list[ir.ToolResultPart]:
    """The tool_result blocks opening the turn; one after other content cannot be placed."""
    results: list[ir.ToolResultPart] = []
    other_seen = False
    for part, param in zip(turn.parts, turn.params):
        if isinstance(part, ir.ToolResultPart):
            if other_seen:
                raise invalid(f"{param}: tool_result blocks must come before any other content of the user turn",
                              param, HISTORY)
            results.append(part)
        else:
            other_seen = True
    return results


def _match(turn: Turn, results: list[ir.ToolResultPart], calls: list[ir.ToolCallPart]) -> None:
    """Exactly one result per call; the turn's results are rewritten in call order."""
    by_id: dict[str, tuple[ir.ToolResultPart, str]] = {}
    order = [c.call_id for c in calls]
    for part, param in zip(turn.parts, turn.params):
        if not isinstance(part, ir.ToolResultPart):
            break
        where = f"{param}.tool_use_id"
        if part.call_id not in order:
            raise invalid(f"{where}: {part.call_id!r} answers no tool_use of the preceding assistant turn "
                          f"(its ids: {', '.join(order)})", where, HISTORY)
        if part.call_id in by_id:
            raise invalid(f"{where}: tool_use {part.call_id!r} has more than one tool_result", where, HISTORY)
        by_id[part.call_id] = (part, param)
    missing = [call_id for call_id in order if call_id not in by_id]
    if missing:
        where = turn.message_params[0]
        raise invalid(f"{where}: every tool_use needs a tool_result at the start of the next user message; "
                      f"missing: {', '.join(missing)}", where, HISTORY)
    n = len(results)
    turn.parts[:n] = [by_id[call_id][0] for call_id in order]
    turn.params[:n] = [by_id[call_id][1] for call_id in order]


def check_prefill(turn: Turn, thinking_enabled: bool) -> None:
    """A final assistant turn is continued as written: text only, and not with thinking switched on."""
    where = turn.message_params[-1]
    if turn.thinking_params:
        raise invalid(f"{turn.thinking_params[0]}: an assistant prefill cannot contain thinking",
                      turn.thinking_params[0], "invalid_prefill")
    for part, param in zip(turn.parts, turn.params):
        if not isinstance(part, ir.TextPart):
            kind = "tool_use blocks" if isinstance(part, ir.ToolCallPart) else f"{part.type} content"
            raise invalid(f"{param}: an assistant prefill cannot contain {kind}", param, "invalid_prefill")
    if thinking_enabled:
        raise invalid(f"{where}: an assistant prefill cannot be continued with thinking enabled; the prefill "
                      "would have to follow a reasoning block the model never wrote", "thinking", "invalid_prefill")
