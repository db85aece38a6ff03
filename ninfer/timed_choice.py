"""A choice between ways of running the same step, made by timing the steps themselves.

Where the faster way depends on the machine and its load (the CPU engine's decode threads; whether the GPU engine
queues a verify round before the last one is read back), the engine tries each candidate for a few steps per key
(a context band and batch size, say), runs the one whose recent steps cycled fastest, and tries the others again
now and then. A step's time is its whole cycle, from its start to the next step's start: what the engine does
between two steps is part of the price. A cycle whose gap after the step exceeds `max_gap` (the engine idled, or
ran other work in between) is not counted.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from statistics import median
from typing import Hashable

log = logging.getLogger("ninfer.engine")


@dataclass
class _Choice:
    """One key's state: recent step times per candidate (the last `trial`), the candidates still to try (each for
    `trial` steps timed afresh), the current best, and steps since the last round of tries."""

    times: dict[Hashable, deque]
    pending: list
    best: Hashable
    steps: int = 0
    decided: bool = False  # a round of tries has ended (best is measured, not the default)


class TimedChoice:
    """Per key: try each candidate, keep the fastest by step cycle, try the others again every `revisit` steps."""

    def __init__(self, candidates: tuple, *, what: str, trial: int = 8, revisit: int = 512, max_gap: float = 0.02):
        """candidates: the ways to choose from, in order of trial (the last is the default before any is measured);
        what: how the log names the choice; trial: steps a try takes (their median decides); revisit: steps of the
        best between two rounds of tries; max_gap: seconds from a step's end to the next step's start beyond which
        its cycle is not counted."""
        if not candidates:
            raise ValueError(f"a choice of {what} needs at least one candidate")
        self.candidates = tuple(dict.fromkeys(candidates))
        self.what, self.trial, self.revisit, self.max_gap = what, trial, revisit, max_gap
        self._choices: dict[Hashable, _Choice] = {}
        self._open: tuple[Hashable, Hashable, float, float | None] | None = None  # key, candidate, start, end

    def describe(self, key: Hashable) -> str:
        """The key as the log names it."""
        return str(key)

    def _choice(self, key: Hashable) -> _Choice:
        choice = self._choices.get(key)
        if choice is None:
            choice = self._choices[key] = _Choice({c: deque(maxlen=self.trial) for c in self.candidates},
                                                  list(self.candidates), self.candidates[-1])
        return choice

    def choose(self, key: Hashable):
        """The candidate for the next step of this key: the one under trial, else the best."""
        choice = self._choice(key)
        return choice.pending[0] if choice.pending else choice.best

    def begin(self, key: Hashable, candidate, now: float) -> None:
        """A step starts (time.perf_counter()): the step before it, if it ran on, is timed start to start."""
        if self._open is not None and self._open[3] is not None and now - self._open[3] <= self.max_gap:
            key0, cand0, start, _ = self._open
            self.add(key0, cand0, now - start)
        self._open = (key, candidate, now, None)

    def end(self, now: float) -> None:
        """The step that started last has ended."""
        if self._open is not None:
            self._open = self._open[:3] + (now,)

    def add(self, key: Hashable, candidate, seconds: float) -> None:
        """A step's cycle under `candidate`."""
        choice = self._choice(key)
        if candidate not in choice.times:
            return
        choice.times[candidate].append(seconds)
        if choice.pending and candidate == choice.pending[0]:
            if len(choice.times[candidate]) >= self.trial:  # a try starts with its times cleared
                choice.pending.pop(0)
                if not choice.pending:
                    timed = [c for c in self.candidates if choice.times[c]]
                    best = min(timed, key=lambda c: median(choice.times[c]))
                    log.info("%s for %s: %s (median step cycle %s)", self.what, self.describe(key), best,
                             ", ".join(f"{c}: {1e3 * median(choice.times[c]):.2f} ms" for c in timed))
                    choice.best, choice.steps, choice.decided = best, 0, True
            return
        choice.steps += 1
        if not choice.pending and choice.steps >= self.revisit:  # try the others again, afresh
            choice.pending = [c for c in self.candidates if c != choice.best]
            for c in choice.pending:
                choice.times[c].clear()

    def decided(self) -> dict:
        """The measured best per key (keys with a round of tries ended)."""
        return {key: ch.best for key, ch in self._choices.items() if ch.decided}

    def medians(self) -> dict:
        """Per decided key, each candidate's median step cycle in its last try (seconds): what the choice rests on."""
        return {key: {c: median(t) for c, t in ch.times.items() if t} for key, ch in self._choices.items() if ch.decided}
