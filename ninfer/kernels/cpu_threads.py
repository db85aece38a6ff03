"""The served CPU engine's decode thread count, chosen by timing its own steps (issue 23).

A decode step's threads work in lockstep, and in the served graph the Engine replica shares its cores with the
router, the HTTP proxy and Ray: one descheduled thread stalls the others. Whether every core or one fewer decodes
faster depends on the machine and the context. Through HTTP on two cores:
- an Intel machine with AMX: two threads 66.6 / 58.2 / 53.8 tok/s against one thread's 63.0 / 53.6 / 46.0 at
  128 / 1,000 / 2,000 tokens (bench/results/2026-12-05-cpu-s23/http_threads); s14 had measured the reverse there;
- an AMD Zen 5: one thread 146.9 / 127.4 / 69.1 against two threads' 130.7 / 107.8 / 72.9 at 128 / 1,000 / 6,000
  (bench/results/2026-12-07-cpu-s38).
So no fixed rule holds. The replica tries each candidate count for a few steps per context band and batch size,
decodes on the one whose recent steps took least, and tries the others again now and then, since the load around
it changes. A step's time is its whole cycle, from its start to the next decode step's: the C call alone ran
faster on two threads there (3.6 against 4.7 ms), while the cycle, with the replica's own streaming and the
other processes squeezed between the calls, was shorter on one (s38: choosing by the call gave 116.7 / 130.7 tok/s
at 128 tokens against one thread's 146.9 / 155.0). A cycle whose gap after the call exceeds `max_gap` (the engine
idled, or ran a prefill in between) is not counted.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from statistics import median

log = logging.getLogger("ninfer.engine")


@dataclass
class _Choice:
    """One (context band, batch size)'s state: recent step times per candidate (the last `trial`), the candidates still
    to try (each for `trial` steps timed afresh), the current best, and steps since the last round of tries."""

    times: dict[int, deque]
    pending: list[int]
    best: int
    steps: int = 0
    decided: bool = False  # a round of tries has ended (best is measured, not the default)


class ThreadChooser:
    """Per (context band, batch size): try each candidate count, keep the fastest by step cycle, revisit (above)."""

    def __init__(self, candidates: tuple[int, ...], *, trial: int = 8, revisit: int = 512, max_gap: float = 0.02):
        """candidates: thread counts to choose from (e.g. one fewer than the cores, and all of them); trial: steps a
        try takes (their median decides); revisit: steps of the best between two rounds of tries; max_gap: seconds
        from a step's end to the next step's start beyond which its cycle is not counted."""
        self.max_gap = max_gap
        self._open: tuple[int, int, int, float, float | None] | None = None  # context, batch, threads, start, end
        self.candidates = tuple(sorted(set(c for c in candidates if c >= 1)))
        if not self.candidates:
            raise ValueError("a thread chooser needs at least one thread count")
        self.trial, self.revisit = trial, revisit
        self._choices: dict[tuple[int, int], _Choice] = {}
        self.last = self.candidates[-1]  # the last step's count (the logits' matmul and the attention take it too)

    BANDS = ("0-1k", "1k-2k", "2k-4k", "4k-8k", "8k-16k", "16k+")

    @staticmethod
    def band(context: int) -> int:
        """Context bands (BANDS): below 1k tokens, 1-2k, 2-4k, 4-8k, 8-16k, and beyond."""
        return min((max(context, 0) // 1024).bit_length(), 5)

    def _choice(self, key: tuple[int, int]) -> _Choice:
        choice = self._choices.get(key)
        if choice is None:
            choice = self._choices[key] = _Choice({c: deque(maxlen=self.trial) for c in self.candidates},
                                                  list(self.candidates), self.candidates[-1])
        return choice

    def pick(self, context: int, batch: int = 1) -> int:
        """The thread count for a step of `batch` rows whose longest context is `context` tokens."""
        choice = self._choice((self.band(context), batch))
        self.last = choice.pending[0] if choice.pending else choice.best
        return self.last

    def started(self, context: int, batch: int, threads: int, now: float) -> None:
        """A decode step starts (time.perf_counter()): the step before it, if it ran on, is timed start to start."""
        if self._open is not None and self._open[4] is not None and now - self._open[4] <= self.max_gap:
            c, b, t, start, _ = self._open
            self.record(c, b, t, now - start)
        self._open = (context, batch, threads, now, None)

    def ended(self, now: float) -> None:
        """The step that started last has ended."""
        if self._open is not None:
            self._open = self._open[:4] + (now,)

    def record(self, context: int, batch: int, threads: int, seconds: float) -> None:
        """A step's duration on `threads` threads."""
        choice = self._choice((self.band(context), batch))
        if threads not in choice.times:
            return
        choice.times[threads].append(seconds)
        if choice.pending and threads == choice.pending[0]:
            if len(choice.times[threads]) >= self.trial:  # a try starts with its times cleared
                choice.pending.pop(0)
                if not choice.pending:
                    timed = [c for c in self.candidates if choice.times[c]]
                    best = min(timed, key=lambda c: median(choice.times[c]))
                    log.info("CPU decode threads for %s tokens of context, batch %d: %d (median step cycle %s)",
                             self.BANDS[self.band(context)], batch, best,
                             ", ".join(f"{c}: {1e3 * median(choice.times[c]):.2f} ms" for c in timed))
                    choice.best, choice.steps, choice.decided = best, 0, True
            return
        choice.steps += 1
        if not choice.pending and choice.steps >= self.revisit:  # try the others again, afresh
            choice.pending = [c for c in self.candidates if c != choice.best]
            for c in choice.pending:
                choice.times[c].clear()

    def snapshot(self) -> dict[str, int]:
        """The measured best per band and batch size, e.g. {"band0_b1": 1} (tests; the log has each decision)."""
        return {f"band{b}_b{n}": ch.best for (b, n), ch in sorted(self._choices.items()) if ch.decided}
