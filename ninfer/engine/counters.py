"""What the engine thread counts for metrics and the request log: token and pressure counters, and
engine-thread wall time by phase. Only the engine thread writes; readers copy."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Counters:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    prefill_tokens: int = 0
    replayed_tokens: int = 0
    generation_tokens: int = 0
    decode_tokens: int = 0
    replay_restores: int = 0
    requests: dict[str, int] = field(default_factory=dict)
    decode_steps: int = 0
    prefill_chunks: int = 0
    snapshot_restores: int = 0
    transfer_bytes_d2h: int = 0
    transfer_bytes_h2d: int = 0
    paused_seconds: float = 0.0
    spec_rounds: int = 0  # decode rows that carried drafts
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_fallback_steps: int = 0  # decode rows of a speculative engine that carried none
    # ---- observability (metrics and the request log) ----
    host_context_peak_bytes: int = 0
    # StateImage copies: into a checkpoint (captured), from one into a request (adopted), a pause's to the host
    # and back (to_host / from_host); a finished request's slot handed to the cache moves nothing (not counted)
    state_images: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("captured", "adopted", "to_host", "from_host"), 0))
    tail_page_copies: int = 0  # copy-on-write KV pages of a reused prefix
    context_transfer_bytes: dict[str, int] = field(  # "<resource>_<direction>": main_kv|state|backend_kv x d2h|h2d|d2d
        default_factory=lambda: {f"{r}_{d}": 0 for r in ("main_kv", "state", "backend_kv") for d in ("d2h", "h2d", "d2d")})


    def count_round(self, drafted: int, accepted: int) -> None:
        self.spec_rounds += 1
        self.spec_drafted_tokens += drafted
        self.spec_accepted_tokens += accepted


HOST_PHASES = ("engine_boundary", "program_submit", "program_post", "engine_commit_output", "engine_maintenance")
WORK_CLASSES = ("decode", "prefill", "control")


class HostWork:
    """Engine-thread wall time for metrics: five mutually exclusive host phases plus blocking device waits,
    each also split by work class (the prefill step, the decode step, and control: everything else).

    Only the engine thread writes; readers copy the dicts. Inside a step, time no named phase claims
    (captures, retention, starvation handling) counts as engine_maintenance.
    """

    def __init__(self) -> None:
        self.phase_seconds = dict.fromkeys(HOST_PHASES, 0.0)
        self.device_wait_seconds = 0.0
        self.class_seconds = {f"{c}_{k}": 0.0 for c in WORK_CLASSES for k in ("host", "device_wait")}
        self._work_class = "control"
        self._claimed = 0.0
        # subsets of the phases above, never added to their total: the engine thread's request-log bookkeeping
        self.detail_seconds = {"request_observation": 0.0}
        self.detail_invocations = {"request_observation": 0}

    def _book(self, phase: str, seconds: float) -> None:
        if phase == "device_wait":
            self.device_wait_seconds += seconds
            self.class_seconds[f"{self._work_class}_device_wait"] += seconds
        else:
            self.phase_seconds[phase] += seconds
            self.class_seconds[f"{self._work_class}_host"] += seconds

    @contextmanager
    def phase(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            self._claimed += spent
            self._book(phase, spent)

    @contextmanager
    def detail(self, name: str):
        """Time a part of whatever phase is under way (a subset, booked beside it)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.detail_seconds[name] += time.perf_counter() - start
            self.detail_invocations[name] += 1

    def run_step(self, work_class: str, step: Callable[[], bool]) -> bool:
        """Run one engine step; a step that found nothing to do books no time."""
        start, self._work_class, self._claimed = time.perf_counter(), work_class, 0.0
        try:
            worked = step()
            if worked:
                self._book("engine_maintenance", max(time.perf_counter() - start - self._claimed, 0.0))
            return worked
        finally:
            self._work_class = "control"

    def snapshot(self) -> dict[str, object]:
        return {"host_work_seconds": dict(self.phase_seconds), "device_wait_seconds": self.device_wait_seconds,
                "work_class_seconds": dict(self.class_seconds), "host_detail_seconds": dict(self.detail_seconds),
                "host_detail_invocations": dict(self.detail_invocations)}
