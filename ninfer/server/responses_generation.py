"""One Response's generation: engine events through the output decoder, ending in an Outcome.

Shared by the JSON and the SSE paths. With parallel_tool_calls:false and a callable tool, the
answer ends once its first tool call closes: the rest of the request is cancelled in the engine
and usage is what the router saw committed up to that point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator

from ninfer.chat.ir import DecodedOutput, OutputDelta
from ninfer.chat.qwen_tool_parser import TOOL_CLOSE, TOOL_OPEN
from ninfer.engine.types import Channel, FinishEvent, FinishReason, ProgressEvent, TokenEvent, Usage


class GenerationFailed(Exception):
    """The engine finished the request with an error after accepting it."""


@dataclass
class Outcome:
    decoded: DecodedOutput
    reason: FinishReason
    usage: Usage


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
    """Usage as the router saw it, for an answer the router itself ended."""

    def __init__(self, prompt_tokens: int):
        self.prompt_tokens = prompt_tokens
        self.cached = 0
        self.tokens = 0
        self.reasoning = 0
        self.admitted = False

    def observe(self, ev: Any) -> None:
        if isinstance(ev, ProgressEvent) and not self.admitted:
            self.admitted, self.cached = True, ev.cache
        elif isinstance(ev, TokenEvent):
            self.tokens += len(ev.token_ids)
            if ev.channel == Channel.REASONING:
                self.reasoning += len(ev.token_ids)

    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.cached, self.tokens, self.reasoning)


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
                    self._finish(FinishReason.STOP, self.seen.usage())
                    return
            elif isinstance(ev, FinishEvent):
                if ev.reason is FinishReason.ERROR:
                    raise GenerationFailed(f"generation failed in the engine: {ev.error}")
                self._finish(ev.reason, ev.usage)
                return
        raise GenerationFailed("the engine stream ended without a finish")

    def _finish(self, reason: FinishReason, usage: Usage) -> None:
        _, decoded = self.decoder.finish()  # the tail is in `decoded`; Response Items are built from it
        self.outcome = Outcome(decoded, reason, usage)
