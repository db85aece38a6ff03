"""--log-stats-interval-ms: a persistent throughput record per interval, next to the engine.

Each interval compares two engine snapshots: a rounded stderr record, and with --request-log-jsonl a
full-precision `throughput` event. Fully idle intervals are omitted from both; 0 disables the report.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from ninfer.server.request_log import RequestLog, is_idle, throughput_fields

log = logging.getLogger("ninfer.stats")


def throughput_line(before: dict[str, Any], after: dict[str, Any], seconds: float) -> str | None:
    """One record from two engine snapshots; None for a fully idle interval."""
    if is_idle(before, after):
        return None
    prefill = after["prefill_tokens"] - before["prefill_tokens"]
    decode = after["decode_tokens"] - before["decode_tokens"]
    replay = after["replayed_tokens"] - before["replayed_tokens"]
    steps = after["decode_steps"] - before["decode_steps"]
    host = sum(after["host_work_seconds"].values()) - sum(before["host_work_seconds"].values())
    batch = decode / steps if steps else 0.0
    terminal = f", answers pending {after['terminal_pending']}" if after.get("terminal_pending") else ""
    return (f"throughput: prefill {prefill / seconds:.1f} tok/s, decode {decode / seconds:.1f} tok/s, "
            f"replay {replay} tok, avg batch {batch:.2f} | running {after['running']} "
            f"(prefill {after['prefilling']}, decode {after['decode_ready']}), waiting {after['waiting']}, "
            f"paused {after['paused']}{terminal}, kv pages {after['kv_pages_used']}/{after['kv_pages_capacity']} | "
            f"host active {host:.2f} s ({100 * host / seconds:.0f}%)")


class StatsReporter:
    def __init__(self, snapshot: Callable[[], dict[str, Any]], interval_ms: int, *,
                 request_log: RequestLog | None = None, replica: str | None = None):
        self.snapshot = snapshot
        self.interval_s = interval_ms / 1000.0
        self.request_log = request_log
        self.replica = replica
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
        before, t_before = self.snapshot(), time.monotonic()
        while not self._stop.wait(self.interval_s):
            after, t_after = self.snapshot(), time.monotonic()
            self.report(before, after, t_after - t_before)
            before, t_before = after, t_after

    def report(self, before: dict[str, Any], after: dict[str, Any], seconds: float) -> None:
        line = throughput_line(before, after, seconds)
        if line is None:
            return
        log.info(line)
        if self.request_log is not None:
            self.request_log.write("throughput", **throughput_fields(before, after, seconds, self.replica))
