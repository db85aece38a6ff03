"""GET /metrics: Prometheus text format 0.0.4 from copied figures, never from the engine thread's work.

Two kinds of figures meet here. Engine figures come from engine snapshots (plain dicts copied on the
caller's thread); each engine replica's series carry a bounded `replica` label (its Serve rank, "0"
in-process). Request figures (outcomes, response failures, TTFT / duration / queue histograms) are
observed by routers (ninfer/server/observer.py) and summed over router replicas.

With Ray Serve a scrape lands on any router replica, so replicas also publish their figures to one
board (ninfer/server/metrics_board.py) that every scrape reads. With no engine figures at all (a dead
or unreachable engine), the endpoint still answers, with ninfer_engine_ready 0.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import Response
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

log = logging.getLogger("ninfer.server")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


# ---- request figures (router side) -----------------------------------------------------------------
@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket; the last one is +Inf
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        index = next((i for i, bound in enumerate(self.bounds) if value <= bound), len(self.bounds))
        self.counts[index] += 1
        self.total += value

    def add(self, other: "Histogram") -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.total += other.total

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        cumulative, running = [], 0
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts):
            running += count
            cumulative.append((bound, running))
        return HistogramMetricFamily(name, doc, buckets=cumulative, sum_value=self.total)


@dataclass
class RequestFigures:
    """What one router saw; plain data so it pickles across Ray and sums across routers."""

    outcomes: dict[str, int] = field(default_factory=dict)
    response_failures: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    duration: Histogram = field(default_factory=lambda: Histogram(DURATION_BUCKETS))
    queue: Histogram = field(default_factory=lambda: Histogram(QUEUE_BUCKETS))

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def copy(self) -> "RequestFigures":
        """A consistent copy for another thread (dict and list copies are atomic under the GIL)."""
        def hist(h: Histogram) -> Histogram:
            return Histogram(h.bounds, list(h.counts), h.total)

        return RequestFigures(dict(self.outcomes), self.response_failures, hist(self.ttft), hist(self.duration),
                              hist(self.queue))

    @classmethod
    def summed(cls, parts: list["RequestFigures"]) -> "RequestFigures":
        total = cls()
        for part in parts:
            for outcome, n in part.outcomes.items():
                total.outcomes[outcome] = total.outcomes.get(outcome, 0) + n
            total.response_failures += part.response_failures
            total.ttft.add(part.ttft)
            total.duration.add(part.duration)
            total.queue.add(part.queue)
        return total


# ---- engine figures ---------------------------------------------------------------------------------
# (metric name, snapshot key, help). Keys missing from a snapshot (no speculative backend yet) read 0.
ENGINE_GAUGES = (
    ("ninfer_requests_running", "running", "Resident requests; prefilling, decode_ready and replaying are subsets"),
    ("ninfer_requests_waiting", "waiting", "Requests waiting for first admission"),
    ("ninfer_requests_paused", "paused", "Requests paused under KV pressure"),
    ("ninfer_requests_prefilling", "prefilling", "Resident requests computing prompt (or replay) chunks"),
    ("ninfer_requests_decode_ready", "decode_ready", "Resident requests that join the next decode batch"),
    ("ninfer_requests_replaying", "replaying", "Resident requests rebuilding committed state by replay"),
    ("ninfer_requests_materializing", "materializing", "Requests whose context is being materialized"),
    ("ninfer_device_kv_used_pages", "kv_pages_used", "KV pages in use, retained history included"),
    ("ninfer_device_kv_capacity_pages", "kv_pages_capacity", "KV pages in the pool"),
    ("ninfer_device_state_used_slots", "state_slots_used", "Recurrent-state slots in use, retained history included"),
    ("ninfer_device_state_capacity_slots", "state_slots_capacity", "Recurrent-state slots on the device"),
    ("ninfer_host_context_used_bytes", "host_context_used_bytes", "Host bytes holding pause snapshots"),
    ("ninfer_host_context_reserved_bytes", "host_context_reserved_bytes",
     "Host bytes reserved for transfers in flight (already included in used)"),
    ("ninfer_host_context_capacity_bytes", "host_context_capacity_bytes", "Host budget for pause snapshots"),
    ("ninfer_host_context_peak_bytes", "host_context_peak_bytes", "Highest host snapshot occupancy so far"),
    ("ninfer_prefix_cache_retained_checkpoints", "retained_checkpoints", "Prefixes retained for reuse"),
)
ENGINE_COUNTERS = (
    ("ninfer_prompt_tokens", "prompt_tokens", "Prompt tokens, counted once at initial binding"),
    ("ninfer_prompt_tokens_cached", "cached_prompt_tokens", "Prompt tokens reused from retained prefixes"),
    ("ninfer_prefill_tokens", "prefill_tokens", "Prompt tokens computed by initial prefill"),
    ("ninfer_replayed_tokens", "replayed_tokens", "Tokens recomputed to restore paused requests"),
    ("ninfer_generation_tokens", "generation_tokens", "Committed output tokens, thinking and control tokens included"),
    ("ninfer_decode_tokens", "decode_tokens", "Output tokens committed by decode rounds (all but the first)"),
    ("ninfer_decode_rounds", "decode_steps", "Decode batch rounds"),
    ("ninfer_spec_decode_rounds", "spec_decode_rounds", "Speculative verification rounds"),
    ("ninfer_spec_decode_draft_tokens", "spec_decode_draft_tokens", "Drafted speculative tokens"),
    ("ninfer_spec_decode_accepted_tokens", "spec_decode_accepted_tokens", "Accepted speculative tokens"),
    ("ninfer_spec_decode_fallback_steps", "spec_decode_fallback_steps", "Speculative rounds that fell back"),
    ("ninfer_preemptions", "preemptions", "Pauses under KV pressure"),
    ("ninfer_snapshot_restores", "snapshot_restores", "Paused requests restored from a host snapshot"),
    ("ninfer_replay_restores", "replay_restores", "Paused requests restored by replay"),
    ("ninfer_paused_seconds", "paused_seconds", "Time requests spent paused"),
    ("ninfer_prefix_cache_hits", "prefix_hits", "Admissions that reused a retained prefix"),
    ("ninfer_prefix_cache_misses", "prefix_misses", "Admissions without a reusable prefix"),
    ("ninfer_prefix_cache_captures", "prefix_captures", "Prefixes captured for reuse"),
    ("ninfer_prefix_cache_evictions", "prefix_evictions", "Retained prefixes evicted"),
    ("ninfer_device_wait_seconds", "device_wait_seconds", "Engine-thread time blocked on device results"),
)


def _engine_families(engines: dict[str, dict[str, Any]]) -> list[Metric]:
    replicas = sorted(engines)
    families: list[Metric] = []
    for name, key, doc in ENGINE_GAUGES:
        family = GaugeMetricFamily(name, doc, labels=["replica"])
        for r in replicas:
            family.add_metric([r], float(engines[r].get(key, 0)))
        families.append(family)
    for name, key, doc in ENGINE_COUNTERS:
        family = CounterMetricFamily(name, doc, labels=["replica"])
        for r in replicas:
            family.add_metric([r], float(engines[r].get(key, 0)))
        families.append(family)
    moved = CounterMetricFamily("ninfer_context_transfer_bytes", "Context payload bytes moved, by resource and "
                                "direction", labels=["replica", "resource", "direction"])
    phases = CounterMetricFamily("ninfer_host_work_seconds", "Engine-thread host time by exclusive phase",
                                 labels=["replica", "phase"])
    ready = GaugeMetricFamily("ninfer_engine_replica_ready", "1 while this engine replica accepts work",
                              labels=["replica"])
    for r in replicas:
        for label, value in sorted(engines[r].get("context_transfer_bytes", {}).items()):
            resource, direction = label.rsplit("_", 1)
            moved.add_metric([r, resource, direction], float(value))
        for phase, seconds in engines[r].get("host_work_seconds", {}).items():
            phases.add_metric([r, phase], float(seconds))
        ready.add_metric([r], 1.0 if engines[r].get("ready") else 0.0)
    return [*families, moved, phases, ready]


def _request_families(figures: RequestFigures) -> list[Metric]:
    outcomes = CounterMetricFamily("ninfer_requests", "Generation requests that entered preparation, by outcome",
                                   labels=["outcome"])
    for outcome, n in sorted(figures.outcomes.items()):
        outcomes.add_metric([outcome], float(n))
    failures = CounterMetricFamily("ninfer_response_failures", "Responses that failed after the engine outcome",
                                   value=float(figures.response_failures))
    return [
        outcomes, failures,
        figures.ttft.family("ninfer_time_to_first_token_seconds",
                            "From entering preparation to the first committed token"),
        figures.duration.family("ninfer_request_duration_seconds",
                                "From entering preparation to the outcome (settled outcomes, cancellation included)"),
        figures.queue.family("ninfer_request_queue_seconds", "From engine submission to first admission"),
    ]


@dataclass(frozen=True)
class ServerFacts:
    """Fixed at startup: the model's identity and the limits, for info and limit gauges."""

    model_id: str
    architecture: str
    kv_cache: str
    speculative: str
    max_concurrency: int
    max_context: int

    @classmethod
    def of(cls, cfg, model, max_context: int) -> "ServerFacts":
        """From the ServerConfig and the ModelIdentity (ninfer/server/request_log.py)."""
        return cls(model_id=model.model_id, architecture=model.architecture, kv_cache=cfg.kv_dtype,
                   speculative=cfg.spec or "off", max_concurrency=cfg.max_concurrency, max_context=max_context)


def render(facts: ServerFacts, engines: dict[str, dict[str, Any]], requests: RequestFigures) -> bytes:
    info = InfoMetricFamily("ninfer_model", "Served model and backend identity",
                            value={"model": facts.model_id, "architecture": facts.architecture,
                                   "kv_cache": facts.kv_cache, "speculative": facts.speculative})
    limits = [GaugeMetricFamily("ninfer_max_concurrency", "Resident execution lanes", value=facts.max_concurrency),
              GaugeMetricFamily("ninfer_max_context_tokens", "Per-request context ceiling in tokens",
                                value=facts.max_context)]
    ready = bool(engines) and all(s.get("ready") for s in engines.values())
    readiness = GaugeMetricFamily("ninfer_engine_ready", "1 while every known engine replica accepts work",
                                  value=1.0 if ready else 0.0)
    families = [info, *limits, readiness, *_engine_families(engines), *_request_families(requests)]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)


class _Families:
    """A collector over families built from copies: collecting reads nothing live."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return iter(self.families)


# ---- where a scrape gets its figures ---------------------------------------------------------------
class MetricsFeed(Protocol):
    async def engines(self) -> dict[str, dict[str, Any]]: ...

    async def requests(self) -> RequestFigures: ...


class EngineClientFeed:
    """One engine behind the router's engine client (in-process, or a single replica's handle)."""

    def __init__(self, engine, figures: RequestFigures):
        self.engine = engine
        self.figures = figures

    async def engines(self) -> dict[str, dict[str, Any]]:
        try:
            snap = await self.engine.snapshot()
        except Exception:  # a dead or unreachable engine: the endpoint stays readable, not ready
            log.debug("metrics: engine snapshot unavailable", exc_info=True)
            return {}
        return {str(snap.get("replica", "0")): snap}

    async def requests(self) -> RequestFigures:
        return self.figures


async def metrics_endpoint(request: Request) -> Response:
    state = request.app.state
    engines = await state.metrics_feed.engines()
    requests = await state.metrics_feed.requests()
    return Response(render(state.server_facts, engines, requests), media_type=CONTENT_TYPE)

