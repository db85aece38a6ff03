"""Per-request output control on the engine thread: channels, stop tokens and strings, thinking budget.

Each committed token goes through `commit`. Text is decoded incrementally per channel; the
longest tail that could still become a stop string is held back, so a stop string split across
tokens is found and never shown.
"""

from __future__ import annotations

from ninfer.engine.types import Channel, FinishReason, ThinkingControl, TokenEvent


def stop_holdback(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


class OutputController:
    def __init__(self, tokenizer, *, stops: list[str], eos_ids: set[int], thinking: ThinkingControl,
                 thinking_open: bool, thinking_budget: int | None):
        self._tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.eos_ids = eos_ids
        self.control = thinking
        self.channel = Channel.REASONING if thinking_open and thinking.think_end_id is not None else Channel.ANSWER
        self.budget = thinking_budget if self.channel is Channel.REASONING else None
        self.reasoning_tokens = 0  # every token committed while reasoning, the close marker included
        self.model_reasoning_tokens = 0  # sampled reasoning tokens, the budget's unit
        self.budget_applied = False
        self._decoder = tokenizer.incremental_decoder()
        self._pending = ""  # decoded text held back for stop matching
        self.stop_string: str | None = None

    @property
    def thinking_open(self) -> bool:
        return self.channel is Channel.REASONING

    def _emit_text(self, delta: str, final: bool = False) -> tuple[str, bool]:
        """Add decoded text; returns (text safe to show, whether a stop string matched)."""
        text = self._pending + delta
        if self.stops:
            hits = [(text.find(s), s) for s in self.stops if s in text]
            if hits:
                index, stop = min(hits)
                self._pending = ""
                self.stop_string = stop
                return text[:index], True
        hold = 0 if final else stop_holdback(text, self.stops)
        self._pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], False

    def _close_channel(self) -> str:
        """Flush what the reasoning channel still holds when </think> arrives."""
        shown, _ = self._emit_text(self._decoder.flush(), final=True)
        self._decoder = self._tokenizer.incremental_decoder()
        return shown

    def commit(self, token_id: int, forced: bool = False) -> tuple[list[TokenEvent], FinishReason | None]:
        """Account one committed token; returns the events to publish and a finish reason, if any."""
        channel = self.channel
        events: list[TokenEvent] = []
        if channel is Channel.REASONING:
            self.reasoning_tokens += 1
            if not forced:
                self.model_reasoning_tokens += 1
        if token_id in self.eos_ids:
            tail, _ = self._emit_text(self._decoder.flush(), final=True)
            events.append(TokenEvent([token_id], channel, tail, forced))
            return events, FinishReason.STOP
        if token_id == self.control.think_end_id and channel is Channel.REASONING:
            events.append(TokenEvent([token_id], channel, self._close_channel(), forced))
            self.channel = Channel.ANSWER
            return events, None
        if token_id == self.control.think_start_id:
            return [TokenEvent([token_id], channel, "", forced)], None
        shown, stopped = self._emit_text(self._decoder.push([token_id]))
        events.append(TokenEvent([token_id], channel, shown, forced))
        return events, FinishReason.STOP_STRING if stopped else None

    def budget_exhausted(self) -> bool:
        """True once when the model's reasoning reached the cap while thinking is still open."""
        if self.budget is None or self.budget_applied or not self.thinking_open:
            return False
        if self.model_reasoning_tokens >= self.budget and self.control.close_suffix:
            self.budget_applied = True
            return True
        return False

    def finish_text(self) -> str:
        """Held-back text released at a length/context finish (no stop string matched)."""
        shown, _ = self._emit_text(self._decoder.flush(), final=True)
        return shown
