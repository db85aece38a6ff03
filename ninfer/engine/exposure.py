"""One request's view of the engine's time, for the request log's request_done (contract, "Structured request
log": engine_timing, first_output_timing, generation.scheduling).

The engine thread's wall time is booked once, by phase (counters.HostWork); each engine iteration's share of it
is added to every request that took part in that iteration's step, since in a compact batch each of them waits
for the whole round. So these figures explain one request's latency and must not be summed across requests.
Kept only while the request log is on (EngineSettings.scheduling_events).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ninfer.engine.counters import HOST_PHASES, HostWork


def host_marks(work: HostWork) -> tuple[float, ...]:
    """The engine's cumulative host phases and device wait, to take an iteration's share by difference."""
    return (*work.phase_seconds.values(), work.device_wait_seconds)


@dataclass
class RequestExposure:
    host: list[float] = field(default_factory=lambda: [0.0] * len(HOST_PHASES))
    device_wait: float = 0.0
    decode_host: float = 0.0
    decode_device_wait: float = 0.0
    decode_rounds: int = 0
    prefill_units: int = 0  # prompt chunks computed
    control_units: int = 0  # replay chunks: committed state rebuilt after a pause
    # request-owned scheduling (generation.scheduling)
    snapshot_restores: int = 0
    replay_restores: int = 0
    replayed_tokens: int = 0
    paused_seconds: float = 0.0
    transfer_bytes: dict[str, int] = field(default_factory=lambda: {"d2h": 0, "h2d": 0})
    first_output: dict[str, Any] | None = None

    def add(self, before: tuple[float, ...], after: tuple[float, ...], *, decode: bool, unit: str | None) -> None:
        """One iteration's share: `before`/`after` are host_marks around it. `unit`: the work it did (decode, prefill,
        control), None for the part of an iteration before the request finished in it (its time, no unit)."""
        delta = [b - a for a, b in zip(before, after)]
        for i, seconds in enumerate(delta[:-1]):
            self.host[i] += seconds
        self.device_wait += delta[-1]
        if decode:
            self.decode_host += sum(delta[:-1])
            self.decode_device_wait += delta[-1]
        if unit == "decode":
            self.decode_rounds += 1
        elif unit == "prefill":
            self.prefill_units += 1
        elif unit == "control":
            self.control_units += 1

    def engine_timing(self, queue_wait: float) -> dict[str, Any]:
        host = dict(zip(HOST_PHASES, self.host))
        return {"queue_wait_seconds": queue_wait, "device_wait_exposed_seconds": self.device_wait,
                "host_exposed_seconds": {**host, "total": sum(self.host)},
                "decode": {"host_exposed_seconds": self.decode_host, "device_wait_seconds": self.decode_device_wait,
                           "rounds": self.decode_rounds},
                "units": {"prefill": self.prefill_units, "control": self.control_units}}

    def freeze_first_output(self, *, t_submit: float, t_admit: float | None, computed: int) -> None:
        """The observations at the request's first committed output (once)."""
        if self.first_output is not None:
            return
        elapsed = time.monotonic() - t_submit
        queue = (t_admit - t_submit) if t_admit is not None else elapsed
        self.first_output = {
            "elapsed_seconds": elapsed, "initial_queue_seconds": queue, "paused_seconds": self.paused_seconds,
            "resident_seconds": max(elapsed - queue - self.paused_seconds, 0.0),
            "engine": {"host_exposed_seconds": sum(self.host), "device_wait_exposed_seconds": self.device_wait},
            "prefill": {"units": self.prefill_units, "computed_tokens": computed},
            "replay": {"units": self.control_units, "tokens": self.replayed_tokens},
        }

    def scheduling(self, preemptions: int) -> dict[str, Any]:
        return {"preemptions": preemptions, "snapshot_restores": self.snapshot_restores,
                "replay_restores": self.replay_restores, "replayed_tokens": self.replayed_tokens,
                "paused_seconds": self.paused_seconds, "transfer_bytes": dict(self.transfer_bytes)}
