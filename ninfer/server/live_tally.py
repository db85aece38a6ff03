"""Usage and timings of one generation as the router sees its engine events arrive.

Two readers need them before (or instead of) the engine's own FinishEvent: Chat Completions'
timings_per_token chunks, and a Responses answer that the router ends itself at its first tool call.
Hidden commits (held back by stop-string, UTF-8 or tool-call buffering) still advance the counts.
"""

from __future__ import annotations

from typing import Any

from ninfer.engine.types import Channel, FinishEvent, FinishReason, ProgressEvent, Timings, TokenEvent, Usage


class LiveTally:
    def __init__(self, prompt_tokens: int):
        self.prompt_tokens = prompt_tokens
        self.admitted = False
        self.total = 0  # the prompt length the engine reported on admission
        self.cached = 0
        self.tokens = 0
        self.reasoning = 0
        self.forced = False  # thinking-budget control tokens were committed: the budget was applied
        # the first and last commit, in ms since admission on the engine's clock (TokenEvent.elapsed_ms), so the
        # snapshots agree with the engine's terminal timings however the events were batched on their way here
        self.first_ms: float | None = None
        self.last_ms: float | None = None

    def observe(self, ev: Any) -> None:
        if isinstance(ev, ProgressEvent) and not self.admitted:
            self.admitted = True
            self.total, self.cached = ev.total, ev.cache
        elif isinstance(ev, TokenEvent):
            self.tokens += len(ev.token_ids)
            self.forced = self.forced or ev.forced
            if ev.channel == Channel.REASONING:
                self.reasoning += len(ev.token_ids)
            if ev.token_ids and ev.elapsed_ms is not None:
                if self.first_ms is None:
                    self.first_ms = ev.elapsed_ms
                self.last_ms = ev.elapsed_ms

    def _timings(self, prompt_n: int) -> Timings:
        first = self.first_ms or 0.0
        return Timings(cache_n=self.cached, prompt_n=prompt_n, prompt_ms=first,
                       predicted_n=self.tokens, predicted_ms=(self.last_ms or first) - first)

    def timings(self) -> dict[str, Any]:
        """Cumulative timings so far, in the shape of the engine's terminal timings."""
        return self._timings(self.total - self.cached).as_dict()

    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.cached, self.tokens, self.reasoning)

    def stop(self) -> FinishEvent:
        """A stop finish as the engine would have reported it at the last commit seen here."""
        return FinishEvent(FinishReason.STOP, self.usage(), self._timings(self.prompt_tokens - self.cached),
                           thinking_budget_applied=self.forced,
                           prefix_reuse_path="checkpoint" if self.cached else "root")
