"""One generation's engine events through the output decoder, ending in an Outcome.

Every generation endpoint reads the engine through this, for its JSON and its SSE answers alike.
With parallel_tool_calls:false and a callable tool (Responses), the answer ends once its first tool
call closes: the rest of the request is cancelled in the engine, and the Outcome's FinishEvent (a
stop) is made from what the router saw committed up to that point.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, TypeVar

from ninfer.chat.ir import DecodedOutput, OutputDelta, Prompt
from ninfer.chat.qwen_tool_parser import TOOL_CLOSE, TOOL_OPEN
from ninfer.engine.types import Channel, FinishEvent, FinishReason, ProgressEvent, TokenEvent, Usage
from ninfer.server.live_tally import LiveTally

T = TypeVar("T")


class GenerationFailed(Exception):
    """The engine finished the request with an error after accepting it, or never finished it."""


@dataclass
class Outcome:
    decoded: DecodedOutput
    finish: FinishEvent  # the engine's, or for an answer the router ended, the one made from what it saw
    tail: list[OutputDelta] = field(default_factory=list)  # what the decoder held back until the end

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


class Generation:
    def __init__(self, events: AsyncIterator[Any], decoder, prompt: Prompt, *, single_call: bool = False):
        self.events = events
        self.decoder = decoder
        self.prompt = prompt
        self.cutoff = FirstCallCutoff() if single_call else None
        self.tally = LiveTally(len(prompt.token_ids))
        self.outcome: Outcome | None = None

    async def admitted(self) -> None:
        """Wait until the engine admits the request (its first progress event: every server request asks for
        progress) or ends it; what was read stays for `steps`. Raises the engine's refusal (a queue timeout)."""
        held: list[list[Any]] = []
        async for batch in self.events:
            held.append(batch)
            if any(isinstance(ev, (ProgressEvent, FinishEvent)) for ev in batch):
                break
        self.events = prepended(held, self.events)

    async def steps(self) -> AsyncIterator[list[ProgressEvent | OutputDelta]]:
        """Progress events and live decoder deltas, a list per engine event list (a streamed response writes
        each list at once); `outcome` is set once they end.

        Raises EngineError (a refusal after the stream opened) or GenerationFailed."""
        async for batch in self.events:
            out: list[ProgressEvent | OutputDelta] = []
            for ev in batch:
                self.tally.observe(ev)
                if isinstance(ev, ProgressEvent):
                    out.append(ev)
                elif isinstance(ev, TokenEvent) and ev.text:
                    text = ev.text
                    kept = self.cutoff.keep(text) if self.cutoff and ev.channel != Channel.REASONING else None
                    out += self.decoder.feed(text if kept is None else kept, ev.channel)
                    if kept is not None:
                        await self.events.aclose()  # cancels the rest of the request in the engine
                        self._finish(self.tally.stop())
                        if out:
                            yield out
                        return
                elif isinstance(ev, FinishEvent):
                    if ev.reason is FinishReason.ERROR:
                        if out:
                            yield out
                        raise GenerationFailed(f"generation failed in the engine: {ev.error}")
                    self._finish(ev)
                    if out:
                        yield out
                    return
            if out:
                yield out
        raise GenerationFailed("the engine stream ended without a finish")

    def _finish(self, fin: FinishEvent) -> None:
        tail, decoded = self.decoder.finish()
        self.outcome = Outcome(decoded, fin, tail)


async def prepended(first: list[T], rest: AsyncIterator[T]) -> AsyncIterator[T]:
    """The items of `first`, then those of `rest`; closing this closes `rest` (for engine events, that cancels the
    request in the engine). What a consumer read ahead goes back in front of the stream this way."""
    try:
        for item in first:
            yield item
        async for item in rest:
            yield item
    finally:
        await rest.aclose()
