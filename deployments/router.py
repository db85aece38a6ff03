"""The Router deployment: the HTTP ingress (the FastAPI app of ninfer.server) over the other deployments."""

from __future__ import annotations

from typing import Any

from ray import serve

from ninfer.config import ServerConfig
from ninfer.server.app import create_app
from ninfer.server.context import build_context
from ninfer.server.engine_client import RayEngineClient
from ninfer.server.media_client import RayMediaClient
from ninfer.server.messages import count_message_tokens
from ninfer.server.metrics_board import serve_router_feed
from ninfer.server.observer import RequestObserver
from ninfer.server.request_body import check_unicode
from ninfer.server.startup import configure_logging
from ninfer.store import RayResponseStore


@serve.deployment(name="Router", num_replicas=1, max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0.25})
@serve.ingress()
class Router:
    def __init__(self, config: dict[str, Any], engine, store, media):
        cfg = ServerConfig(**config)
        configure_logging(cfg.log_level, serve_replica=True)
        # like the store, media preparation is one deployment every router replica reaches by handle
        self.ctx = build_context(cfg, RayEngineClient(engine), media=RayMediaClient(media) if cfg.vision else None)
        self.store = RayResponseStore(store)

    def __serve_build_asgi_app__(self):
        # This replica's request log writer and request figures; /metrics reads every replica's figures.
        observer = RequestObserver.for_config(self.ctx.config, role="router",
                                              replica=serve.get_replica_context().replica_tag)
        # Serve's proxy stamps x-request-id
        return create_app(self.ctx, behind_serve_proxy=True, response_store=self.store, observer=observer,
                          metrics_feed=serve_router_feed(self.ctx.engine, observer.figures))

    async def count_tokens(self, body: dict[str, Any]) -> int:
        """POST /v1/messages/count_tokens for handle callers (`serve.get_app_handle("ninfer")`): the same
        validation and prompt; a bad body raises the ProtocolError the route would render."""
        check_unicode(body)  # what read_json checks for HTTP bodies
        return await count_message_tokens(self.ctx, body)
