"""--log-stats-interval-ms: a persistent throughput record per interval, next to the engine."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

log = logging.getLogger("ninfer.stats")


def throughput_line(before: dict[str, Any], after: dict[str, Any], seconds: float) -> str | None:
    """One record from two engine snapshots; None for a fully idle interval."""
    prefill = after["prefill_tokens"] - before["prefill_tokens"]
    decode = after["decode_tokens"] - before["decode_tokens"]
    replay = after["replayed_tokens"] - before["replayed_tokens"]
    steps = after["decode_steps"] - before["decode_steps"]
    busy = after["running"] or after["waiting"] or after["paused"]
    if not (prefill or decode or replay or busy):
        return None
    batch = decode / steps if steps else 0.0
    return (f"throughput: prefill {prefill / seconds:.1f} tok/s, decode {decode / seconds:.1f} tok/s, "
            f"replay {replay} tok, avg batch {batch:.2f} | running {after['running']} "
            f"(prefill {after['prefilling']}, decode {after['decode_ready']}), waiting {after['waiting']}, "
            f"paused {after['paused']}, kv pages {after['kv_pages_used']}/{after['kv_pages_capacity']}")


class StatsReporter:
    def __init__(self, snapshot: Callable[[], dict[str, Any]], interval_ms: int):
        self.snapshot = snapshot
        self.interval_s = interval_ms / 1000.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "StatsReporter":
        if self.interval_s > 0:  # 0 disables the report
            self._thread = threading.Thread(target=self._run, name="ninfer-stats", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        before = self.snapshot()
        while not self._stop.wait(self.interval_s):
            after = self.snapshot()
            line = throughput_line(before, after, self.interval_s)
            if line:
                log.info(line)
            before = after
