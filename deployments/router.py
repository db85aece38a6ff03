"""The Router deployment: the HTTP ingress (the FastAPI app of ninfer.server) over the other deployments."""

from __future__ import annotations

from typing import Any

from ray import serve

from ninfer.config import ServerConfig
from ninfer.server.app import create_app
from ninfer.server.context import build_context
from ninfer.server.engine_client import RayEngineClient
from ninfer.server.startup import configure_logging


@serve.deployment(name="Router", num_replicas=1, max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0.25})
@serve.ingress()
class Router:
    def __init__(self, config: dict[str, Any], engine, store, media):
        cfg = ServerConfig(**config)
        configure_logging(cfg.log_level)
        self.ctx = build_context(cfg, RayEngineClient(engine))
        self.store, self.media = store, media  # used by the Responses API and vision as they land

    def __serve_build_asgi_app__(self):
        return create_app(self.ctx, behind_serve_proxy=True)  # Serve's proxy stamps x-request-id
