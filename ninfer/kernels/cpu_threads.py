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

from ninfer.timed_choice import TimedChoice


class ThreadChooser(TimedChoice):
    """Per (context band, batch size): try each candidate count, keep the fastest by step cycle, revisit (above)."""

    def __init__(self, candidates: tuple[int, ...], *, trial: int = 8, revisit: int = 512, max_gap: float = 0.02):
        """candidates: thread counts to choose from (e.g. one fewer than the cores, and all of them), tried fewest
        first; the rest as TimedChoice's."""
        counts = tuple(sorted(set(c for c in candidates if c >= 1)))
        if not counts:
            raise ValueError("a thread chooser needs at least one thread count")
        super().__init__(counts, what="CPU decode threads", trial=trial, revisit=revisit, max_gap=max_gap)
        self.last = self.candidates[-1]  # the last step's count (the logits' matmul and the attention take it too)

    BANDS = ("0-1k", "1k-2k", "2k-4k", "4k-8k", "8k-16k", "16k+")

    @staticmethod
    def band(context: int) -> int:
        """Context bands (BANDS): below 1k tokens, 1-2k, 2-4k, 4-8k, 8-16k, and beyond."""
        return min((max(context, 0) // 1024).bit_length(), 5)

    def describe(self, key: tuple[int, int]) -> str:
        return f"{self.BANDS[key[0]]} tokens of context, batch {key[1]}"

    def pick(self, context: int, batch: int = 1) -> int:
        """The thread count for a step of `batch` rows whose longest context is `context` tokens."""
        self.last = self.choose((self.band(context), batch))
        return self.last

    def started(self, context: int, batch: int, threads: int, now: float) -> None:
        """A decode step starts (time.perf_counter()): the step before it, if it ran on, is timed start to start."""
        self.begin((self.band(context), batch), threads, now)

    def ended(self, now: float) -> None:
        """The step that started last has ended."""
        self.end(now)

    def record(self, context: int, batch: int, threads: int, seconds: float) -> None:
        """A step's duration on `threads` threads."""
        self.add((self.band(context), batch), threads, seconds)

    def snapshot(self) -> dict[str, int]:
        """The measured best per band and batch size, e.g. {"band0_b1": 1} (tests; the log has each decision)."""
        return {f"band{b}_b{n}": best for (b, n), best in sorted(self.decided().items())}
