"""Turns sampled tokens into committed output: thinking-budget control tokens, stop tokens and strings,
output and context limits, per-channel text events, usage and timings.

It runs on the engine thread after each step; it writes a request's output (output_ids, its
OutputController) and publishes its token events, while request status and resources stay with the
scheduler. A decode row may bring several tokens (speculative decoding): they commit in order and the
first stop ends the run, so exactly the accepted prefix is committed.
"""

from __future__ import annotations

import time

from ninfer.engine import media_inputs
from ninfer.engine.counters import Counters
from ninfer.engine.output_control import ThinkingControl
from ninfer.engine.sequence import Sequence
from ninfer.engine.types import FinishEvent, FinishReason, Timings, TokenEvent, Usage


class OutputProcessor:
    def __init__(self, thinking: ThinkingControl, counters: Counters, *, max_context: int):
        self.thinking = thinking
        self.counters = counters
        self.max_context = max_context
        self.counted: list[tuple[int, int]] = []  # (lane, token) of penalized requests, uploaded once per step

    def commit(self, seq: Sequence, tokens: list[int]) -> tuple[int, FinishReason | None]:
        """Commit `tokens` (a row's samples, in order) until one ends the request; returns how many were
        committed and the finish reason, if any. A pending thinking-budget suffix replaces the samples
        one for one."""
        committed = 0
        for token in tokens:
            forced = bool(seq.forced)
            reason = self._commit_one(seq, seq.forced.popleft() if forced else token, forced)
            committed += 1
            if reason is not None:
                return committed, reason
            if forced or seq.forced:
                break  # the rest of the row was drawn after a token the control suffix replaces
        return committed, None

    def _commit_one(self, seq: Sequence, token: int, forced: bool) -> FinishReason | None:
        now = time.monotonic()
        if seq.t_first is None:
            seq.t_first = now
        seq.t_last = now
        seq.output_ids.append(token)
        self.counters.generation_tokens += 1
        if len(seq.output_ids) > 1:
            self.counters.decode_tokens += 1
        if seq.sampling.penalized:  # only penalties read a lane's counts: the others never count
            self.counted.append((seq.lane, token))
        events, reason = seq.controller.commit(token, forced=forced)
        elapsed_ms = (now - seq.t_admit) * 1000.0 if seq.t_admit else 0.0
        for ev in events:
            if ev.token_ids:
                ev.elapsed_ms = elapsed_ms
            seq.emit(ev)
        if reason is None:
            if len(seq.output_ids) >= seq.max_tokens:
                reason = FinishReason.LENGTH
            elif seq.total_len >= self.max_context:
                reason = FinishReason.CONTEXT
        if reason is None and not seq.forced and seq.controller.budget_exhausted():
            seq.forced.extend(self.thinking.close_suffix)
        return reason

    def take_counted(self) -> list[tuple[int, int]]:
        counted, self.counted = self.counted, []
        return counted

    def flush_tail(self, seq: Sequence, reason: FinishReason) -> None:
        """Held-back text of a request that ends without a stop string."""
        if reason in (FinishReason.LENGTH, FinishReason.CONTEXT, FinishReason.CANCELLED):
            tail = seq.controller.finish_text()
            if tail:
                seq.emit(TokenEvent([], seq.controller.channel, tail))

    def finish_event(self, seq: Sequence, reason: FinishReason, error: str | None = None,
                     speculative: bool = False) -> FinishEvent:
        """speculative: the engine runs a drafter (the event then carries the request's speculative counts)."""
        now = time.monotonic()
        admitted = seq.t_admit or now
        first = seq.t_first or now
        timings = Timings(
            cache_n=seq.cached_tokens,
            prompt_n=seq.prompt_len - seq.cached_tokens,
            prompt_ms=(first - admitted) * 1000.0 if seq.t_admit else 0.0,
            predicted_n=len(seq.output_ids),
            predicted_ms=((seq.t_last or first) - first) * 1000.0,
            draft_n=seq.drafted if seq.spec_rounds else None,
            draft_n_accepted=seq.draft_accepted if seq.spec_rounds else None,
        )
        spec = None
        if speculative:
            spec = {"rounds": seq.spec_rounds, "drafted_tokens": seq.drafted, "accepted_tokens": seq.draft_accepted,
                    "fallback_steps": seq.spec_fallback_steps, "accepted_per_position": list(seq.accepted_per_position)}
        usage = Usage(prompt_tokens=seq.prompt_len, cached_tokens=seq.cached_tokens,
                      completion_tokens=len(seq.output_ids), reasoning_tokens=seq.controller.reasoning_tokens)
        logged = seq.exposure.finish_fields((seq.t_admit or now) - seq.t_submit, seq.preemptions) if seq.exposure else {}
        return FinishEvent(reason, usage, timings, stop_string=seq.controller.stop_string,
                           thinking_budget_applied=seq.controller.budget_applied,
                           preemptions=seq.preemptions, prefix_reuse_path=seq.prefix_path, error=error,
                           speculative=spec, vision_seconds=media_inputs.vision_seconds(seq), **logged)
