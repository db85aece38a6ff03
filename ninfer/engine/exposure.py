"""One request's view of the engine's time, for the request log's request_done (contract, "Structured request
log": engine_timing, first_output_timing, generation.scheduling, work, context_transfers).

The engine thread's wall time is booked once, by phase (counters.HostWork); each engine iteration's share of it
is added to every request that took part in that iteration's step, since in a compact batch each of them waits
for the whole round. So these figures explain one request's latency and must not be summed across requests.
Kept only while the request log is on (EngineSettings.scheduling_events).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ninfer.engine.counters import HOST_PHASES, HostWork

RESOURCES = ("main_kv", "state", "backend_kv")
DIRECTIONS = ("d2h", "h2d", "d2d")


def host_marks(work: HostWork) -> tuple[float, ...]:
    """The engine's cumulative host phases and device wait, to take an iteration's share by difference."""
    return (*work.phase_seconds.values(), work.device_wait_seconds)


class StreamInterval:
    """The device time of work queued on the current stream between `__init__` and `stop`: a pair of CUDA events
    (read once both completed, so never a wait), or on the CPU, where the work runs as it is called, the clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.stream = torch.cuda.current_stream(device)
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record(self.stream)
        else:
            self.t_start = self.t_end = time.perf_counter()

    def stop(self) -> "StreamInterval":
        if self.cuda:
            self.end.record(self.stream)
        else:
            self.t_end = time.perf_counter()
        return self

    def seconds(self) -> float | None:
        """None while the device has not reached the end mark."""
        if not self.cuda:
            return self.t_end - self.t_start
        return self.start.elapsed_time(self.end) / 1000.0 if self.end.query() else None


def _total(intervals: list[StreamInterval]) -> float | None:
    times = [i.seconds() for i in intervals]
    return None if None in times else sum(times)


@dataclass
class _Transfers:
    """A request's own copies in one direction: bytes by resource, the copies, their device intervals."""

    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RESOURCES, 0))
    intervals: list[StreamInterval] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"bytes": dict(self.bytes), "copies": len(self.intervals), "seconds": _total(self.intervals)}


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
    prefill_tokens: int = 0  # prompt tokens it computed (counters.prefill_tokens' share; replay apart)
    paused_seconds: float = 0.0
    transfer_bytes: dict[str, int] = field(default_factory=lambda: {"d2h": 0, "h2d": 0})
    first_output: dict[str, Any] | None = None
    # work.gpu_seconds: the device intervals of its prompt chunks' forwards and their drafter work
    prefill_intervals: list[StreamInterval] = field(default_factory=list)
    transfers: dict[str, _Transfers] = field(default_factory=lambda: {d: _Transfers() for d in DIRECTIONS})

    def transferred(self, direction: str, interval: StreamInterval, **moved: int) -> None:
        """One completed copy of this request's context (`moved`: bytes by resource)."""
        record = self.transfers[direction]
        record.intervals.append(interval)
        for resource, nbytes in moved.items():
            record.bytes[resource] += nbytes

    def work(self) -> dict[str, Any]:
        """gpu_seconds: the device time of the request's prefill intervals (null if one has not completed)."""
        return {"gpu_seconds": _total(self.prefill_intervals), "prefill_intervals": len(self.prefill_intervals)}

    def context_transfers(self) -> dict[str, Any]:
        return {d: t.as_dict() for d, t in self.transfers.items()}

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

    def finish_fields(self, queue_wait: float, preemptions: int) -> dict[str, Any]:
        """The FinishEvent's request-log fields."""
        return {"engine_timing": self.engine_timing(queue_wait), "first_output_timing": self.first_output,
                "scheduling": self.scheduling(preemptions), "work": self.work(),
                "context_transfers": self.context_transfers()}

    def scheduling(self, preemptions: int) -> dict[str, Any]:
        return {"preemptions": preemptions, "snapshot_restores": self.snapshot_restores,
                "replay_restores": self.replay_restores, "replayed_tokens": self.replayed_tokens,
                "paused_seconds": self.paused_seconds, "transfer_bytes": dict(self.transfer_bytes)}
