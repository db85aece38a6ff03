"""Usage and timings of one generation as the router sees its engine events arrive.

Two readers need them before (or instead of) the engine's own FinishEvent: Chat Completions'
timings_per_token chunks, and a Responses answer that the router ends itself at its first tool call.
Hidden commits (held back by stop-string, UTF-8 or tool-call buffering) still advance the counts.
"""

from __future__ import annotations

import time
from typing import Any

from ninfer.engine.types import Channel, FinishEvent, FinishReason, ProgressEvent, Timings, TokenEvent, Usage


class LiveTally:
    def __init__(self, prompt_tokens: int):
        self.prompt_tokens = prompt_tokens
        self.total = 0  # the prompt length the engine reported on admission
        self.cached = 0
        self.tokens = 0
        self.reasoning = 0
        self.forced = False  # thinking-budget control tokens were committed: the budget was applied
        self.t_admit: float | None = None
        self.t_first: float | None = None
        self.t_last: float | None = None

    def observe(self, ev: Any) -> None:
        now = time.monotonic()
        if isinstance(ev, ProgressEvent) and self.t_admit is None:
            self.t_admit = now - ev.time_ms / 1000.0
            self.total, self.cached = ev.total, ev.cache
        elif isinstance(ev, TokenEvent):
            self.tokens += len(ev.token_ids)
            self.forced = self.forced or ev.forced
            if ev.channel == Channel.REASONING:
                self.reasoning += len(ev.token_ids)
            if ev.token_ids:
                if self.t_first is None:
                    self.t_first = now
                self.t_last = now

    def timings(self) -> dict[str, Any]:
        """Cumulative timings so far, in the shape of the engine's terminal timings."""
        admit = self.t_admit or time.monotonic()
        first = self.t_first or admit
        return Timings(cache_n=self.cached, prompt_n=self.total - self.cached, prompt_ms=(first - admit) * 1000.0,
                       predicted_n=self.tokens, predicted_ms=((self.t_last or first) - first) * 1000.0).as_dict()

    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.cached, self.tokens, self.reasoning)

    def stop(self) -> FinishEvent:
        """A stop finish as the engine would have reported it here (its timings from arrival times)."""
        now = time.monotonic()
        first = self.t_first if self.t_first is not None else now
        last = self.t_last if self.t_last is not None else first
        timings = Timings(cache_n=self.cached, prompt_n=self.prompt_tokens - self.cached,
                          prompt_ms=(first - self.t_admit) * 1000.0 if self.t_admit is not None else 0.0,
                          predicted_n=self.tokens, predicted_ms=(last - first) * 1000.0)
        return FinishEvent(FinishReason.STOP, self.usage(), timings, thinking_budget_applied=self.forced,
                           prefix_reuse_path="checkpoint" if self.cached else "root")
