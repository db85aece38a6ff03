"""The Engine deployment: one resident engine per replica, streaming token events to the router."""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

from ray import serve

from ninfer.config import ServerConfig
from ninfer.engine.types import EngineError, EngineRequest
from ninfer.server.engine_client import EngineFailure, engine_event_batches, engine_events
from ninfer.server.metrics_board import BoardPublisher, replica_label
from ninfer.server.request_log import ModelIdentity, RequestLog, server_start_fields
from ninfer.server.startup import configure_logging, freeze_startup_objects, load_engine_for
from ninfer.server.stats import StatsReporter

log = logging.getLogger("ninfer.server")


@serve.deployment(name="Engine", num_replicas=1, max_ongoing_requests=1024, ray_actor_options={"num_cpus": 1})
class EngineDeployment:
    def __init__(self, config: dict[str, Any]):
        import ray

        cfg = ServerConfig(**config)
        configure_logging(cfg.log_level, serve_replica=True)
        self.replica = replica_label()  # this replica's figures carry it in /metrics and the request log
        # A replica given a GPU sees only that one, as device 0 (`ninfer serve --device N` makes Ray see GPU N).
        self.engine = load_engine_for(cfg, device_index=0 if ray.get_gpu_ids() else None)
        self.request_log = RequestLog.for_config(cfg)  # this replica's own writer: throughput records
        if self.request_log is not None:
            self.request_log.write("server_start", **server_start_fields(
                cfg, ModelIdentity.of(cfg), role="engine", replica=self.replica, engine=self.engine.snapshot(),
                report=self.engine.startup_report()))
        self.stats = StatsReporter(self.engine.snapshot, cfg.log_stats_interval_ms, request_log=self.request_log,
                                   replica=self.replica).start()
        app_name = serve.get_replica_context().app_name
        self.publisher = BoardPublisher(app_name, "engine", self.replica, self.snapshot).start()
        # a full garbage collection over start-up's objects would pause the engine loop mid-step
        log.info("engine replica %s: %d start-up objects frozen out of the garbage collector's scans", self.replica,
                 freeze_startup_objects())

    async def stream(self, request: EngineRequest) -> AsyncIterator[Any]:
        """ACCEPTED, then engine events one at a time; a cancelled handle call cancels the request (frees its
        pages)."""
        async for item in engine_events(self.engine, request):
            yield item

    async def stream_batches(self, request: EngineRequest) -> AsyncIterator[list[Any]]:
        """`stream` in lists, each what the engine committed since the router last took one (the router's call:
        a speculative round's tokens cross as one object)."""
        async for batch in engine_event_batches(self.engine, request):
            yield batch

    def reserve(self, request_id: str) -> EngineFailure | None:
        """A lifetime slot for a request the router is about to prepare; its refusal as data (it crosses Ray)."""
        try:
            self.engine.reserve(request_id)
        except EngineError as exc:
            return EngineFailure.of(exc)
        return None

    def release(self, request_id: str) -> None:
        self.engine.release(request_id)

    def ready(self) -> bool:
        return bool(self.engine.healthy)

    def snapshot(self) -> dict[str, Any]:
        return {**self.engine.snapshot(), "replica": self.replica}

    def __del__(self):
        if not hasattr(self, "publisher"):  # __init__ failed (its error is what Serve reports)
            return
        log.info("engine replica %s shutting down", self.replica)
        self.publisher.stop()
        self.stats.stop()
        self.engine.shutdown()
        if self.request_log is not None:
            self.request_log.close()
