"""Where one thread's wall time goes: its Python stack sampled every `interval` seconds from a side thread
(sys._current_frames), counted by innermost frame, innermost ninfer frame and innermost ninfer/engine frame. A poor man's py-spy for
machines without it: a blocking call (a CUDA graph launch, a device read back) shows as the Python line
that made it."""

from __future__ import annotations

import collections
import sys
import threading
import time


def _where(frame) -> str:
    code = frame.f_code
    return f"{code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno} {code.co_name}"


class StackSampler:
    def __init__(self, thread: threading.Thread, interval: float = 0.0005):
        self.ident, self.interval = thread.ident, interval
        self.leaf: collections.Counter = collections.Counter()
        self.ours: collections.Counter = collections.Counter()
        self.engine: collections.Counter = collections.Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "StackSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            frame = sys._current_frames().get(self.ident)
            if frame is not None:
                self.samples += 1
                self.leaf[_where(frame)] += 1
                f = frame
                while f is not None and "/ninfer/" not in f.f_code.co_filename:
                    f = f.f_back
                self.ours[_where(f) if f is not None else "(outside ninfer)"] += 1
                while f is not None and "/ninfer/engine/" not in f.f_code.co_filename:
                    f = f.f_back
                self.engine[_where(f) if f is not None else "(outside ninfer/engine)"] += 1
            time.sleep(self.interval)

    def top(self, n: int) -> dict:
        """The n most sampled frames of each kind, as shares of all samples."""
        total = max(self.samples, 1)
        return {"samples": self.samples,
                "leaf": {k: round(v / total, 3) for k, v in self.leaf.most_common(n)},
                "ninfer": {k: round(v / total, 3) for k, v in self.ours.most_common(n)},
                "engine": {k: round(v / total, 3) for k, v in self.engine.most_common(n)}}
