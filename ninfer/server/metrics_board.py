"""Ray Serve: every replica publishes its figures to one board, so a /metrics scrape on any router
replica sees all of them.

Engine replicas publish their snapshots (labelled by Serve rank) and router replicas their request
figures, once a second, to one small named actor. A replica that stops publishing drops out after
BOARD_TTL_S. Publishing and reading never touch an engine thread: snapshots are copied dicts.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Callable

from ninfer.server.metrics import EngineClientFeed, RequestFigures

log = logging.getLogger("ninfer.server")

BOARD_TTL_S = 10.0
PUBLISH_INTERVAL_S = 1.0


class SnapshotBoard:
    """The latest figures each replica published, by kind ("engine", "router") and replica key."""

    def __init__(self, ttl_s: float = BOARD_TTL_S):
        self.ttl_s = ttl_s
        self._items: dict[tuple[str, str], tuple[float, Any]] = {}

    def publish(self, kind: str, key: str, payload: Any) -> None:
        self._items[(kind, key)] = (time.monotonic(), payload)

    def collect(self, kind: str) -> dict[str, Any]:
        now = time.monotonic()
        self._items = {k: v for k, v in self._items.items() if now - v[0] <= self.ttl_s}
        return {key: payload for (k, key), (_, payload) in self._items.items() if k == kind}


def board_actor(app_name: str):
    """The app's board: a named actor created by whichever replica asks first (detached, so it does
    not die with that replica; it goes with the Ray cluster)."""
    import ray

    return ray.remote(num_cpus=0)(SnapshotBoard).options(
        name=f"ninfer-metrics-{app_name}", namespace="ninfer", get_if_exists=True, lifetime="detached").remote()


class BoardPublisher:
    """Publishes `payload()` once a second from a daemon thread; finds the board again if it is lost."""

    def __init__(self, app_name: str, kind: str, key: str, payload: Callable[[], Any],
                 interval_s: float = PUBLISH_INTERVAL_S):
        self.app_name, self.kind, self.key, self.payload = app_name, kind, key, payload
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ninfer-metrics-{kind}", daemon=True)

    def start(self) -> "BoardPublisher":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        import ray

        board = None
        while not self._stop.wait(self.interval_s):
            try:
                board = board or board_actor(self.app_name)
                ray.get(board.publish.remote(self.kind, self.key, self.payload()), timeout=10)
            except Exception:  # the board died or is restarting: look it up again next time
                log.debug("metrics: publishing to the board failed", exc_info=True)
                board = None


class BoardFeed:
    """A router replica's view: every engine replica and router from the board, its own figures live."""

    def __init__(self, app_name: str, router_key: str, figures: RequestFigures, fallback: EngineClientFeed):
        self.app_name, self.router_key, self.figures, self.fallback = app_name, router_key, figures, fallback
        self._board = None

    async def _collect(self, kind: str) -> dict[str, Any]:
        try:
            self._board = self._board or board_actor(self.app_name)
            return await asyncio.wait_for(self._board.collect.remote(kind), timeout=5)
        except Exception:
            log.debug("metrics: the board is unavailable", exc_info=True)
            self._board = None
            return {}

    async def engines(self) -> dict[str, dict[str, Any]]:
        # Right after startup nothing is published yet: ask one replica directly.
        return await self._collect("engine") or await self.fallback.engines()

    async def requests(self) -> RequestFigures:
        others = [f for key, f in (await self._collect("router")).items() if key != self.router_key]
        return RequestFigures.summed([*others, self.figures])


def serve_router_feed(engine, figures: RequestFigures) -> BoardFeed:
    """Inside a Serve router replica: publish this replica's request figures, read everyone's."""
    from ray import serve

    ctx = serve.get_replica_context()
    BoardPublisher(ctx.app_name, "router", ctx.replica_tag, figures.copy).start()
    return BoardFeed(ctx.app_name, ctx.replica_tag, figures, EngineClientFeed(engine, figures))


def replica_label() -> str:
    """This Serve replica's rank (bounded: 0..replicas-1), or its unique tag on Ray without ranks."""
    from ray import serve

    ctx = serve.get_replica_context()
    rank = getattr(getattr(ctx, "rank", None), "rank", getattr(ctx, "rank", None))
    return str(rank) if isinstance(rank, int) else ctx.replica_tag
