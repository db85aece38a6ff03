"""One Response's generation: engine events through the output decoder, ending in an Outcome.

Shared by the JSON and the SSE paths. With parallel_tool_calls:false and a callable tool, the
answer ends once its first tool call closes: the rest of the request is cancelled in the engine,
and the Outcome's FinishEvent (a stop) is made from what the router saw committed up to that point.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from ninfer.chat.ir import DecodedOutput, OutputDelta
from ninfer.chat.qwen_tool_parser import TOOL_CLOSE, TOOL_OPEN
from ninfer.engine.types import Channel, FinishEvent, FinishReason, ProgressEvent, Timings, TokenEvent, Usage


class GenerationFailed(Exception):
    """The engine finished the request with an error after accepting it."""


@dataclass
class Outcome:
    decoded: DecodedOutput
    finish: FinishEvent  # the engine's, or for an answer the router ended, the one made from what it saw

    @property
    def reason(self) -> FinishReason:
        return self.finish.reason

    @property
    def usage(self) -> Usage:
        return self.finish.usage


class FirstCallCutoff:
    """Where the answer's first tool call closes (Qwen's call markers)."""

    def __init__(self) -> None:
        self.answer = ""

    def keep(self, text: str) -> str | None:
        """The part of `text` up to and including the first call's closing marker, None while it is open."""
        before = len(self.answer)
        self.answer += text
        start = self.answer.find(TOOL_OPEN)
        end = self.answer.find(TOOL_CLOSE, start) if start >= 0 else -1
        if end < 0:
            return None
        return text[: max(0, end + len(TOOL_CLOSE) - before)]


class _Seen:
    """Usage and timings as the router saw them, for an answer the router itself ended."""

    def __init__(self, prompt_tokens: int):
        self.prompt_tokens = prompt_tokens
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
            self.t_admit, self.cached = now - ev.time_ms / 1000.0, ev.cache
        elif isinstance(ev, TokenEvent):
            self.tokens += len(ev.token_ids)
            self.forced = self.forced or ev.forced
            if ev.channel == Channel.REASONING:
                self.reasoning += len(ev.token_ids)
            if ev.token_ids:
                if self.t_first is None:
                    self.t_first = now
                self.t_last = now

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


class Generation:
    def __init__(self, events: AsyncIterator[Any], decoder, *, prompt_tokens: int, single_call: bool):
        self.events = events
        self.decoder = decoder
        self.cutoff = FirstCallCutoff() if single_call else None
        self.seen = _Seen(prompt_tokens)
        self.outcome: Outcome | None = None

    async def deltas(self) -> AsyncIterator[OutputDelta]:
        """Live decoder deltas; `outcome` is set once they end. Raises EngineError / GenerationFailed."""
        async for ev in self.events:
            self.seen.observe(ev)
            if isinstance(ev, TokenEvent) and ev.text:
                text = ev.text
                kept = self.cutoff.keep(text) if self.cutoff and ev.channel != Channel.REASONING else None
                for d in self.decoder.feed(text if kept is None else kept, ev.channel):
                    yield d
                if kept is not None:
                    await self.events.aclose()  # cancels the rest of the request in the engine
                    self._finish(self.seen.stop())
                    return
            elif isinstance(ev, FinishEvent):
                if ev.reason is FinishReason.ERROR:
                    raise GenerationFailed(f"generation failed in the engine: {ev.error}")
                self._finish(ev)
                return
        raise GenerationFailed("the engine stream ended without a finish")

    def _finish(self, fin: FinishEvent) -> None:
        _, decoded = self.decoder.finish()  # the tail is in `decoded`; Response Items are built from it
        self.outcome = Outcome(decoded, fin)
