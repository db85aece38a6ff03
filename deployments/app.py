"""Builds the Ray Serve graph from config args (`serve run configs/*.yaml`, `ninfer serve ...`).

    HTTP -> Router (FastAPI ingress) -> Engine (1 replica; a GPU when the cluster has one)
                                     -> ResponseStore (1 actor)
                                     -> MediaPreprocessor (CPU pool)

The args are ServerConfig fields; they are validated here, with the artifact's header, so a bad or
not-yet-implemented option or a missing artifact fails before any replica starts. HTTP host and port
belong to Serve's http_options in a YAML config.
"""

from __future__ import annotations

from typing import Any

from ninfer.config import ServerConfig
from ninfer.server.startup import check_implemented

APP_NAME = "ninfer"


def _has_gpu() -> bool:
    import ray

    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    import torch

    return torch.cuda.is_available()


def build_application(cfg: ServerConfig):
    from deployments.engine import EngineDeployment
    from deployments.media import MediaPreprocessorDeployment
    from deployments.router import Router
    from deployments.store import ResponseStoreDeployment
    from ninfer.artifact.container import Artifact

    check_implemented(cfg)
    Artifact(cfg.artifact)  # a missing or corrupt file fails the build once, not each replica start in a loop
    config = cfg.model_dump()
    engine = EngineDeployment
    if _has_gpu():
        engine = engine.options(ray_actor_options={"num_cpus": 1, "num_gpus": 1})
    return Router.bind(
        config,
        engine.bind(config),
        ResponseStoreDeployment.bind(cfg.response_store_max_records, cfg.response_store_max_mib),
        MediaPreprocessorDeployment.bind(cfg.media_cache_mib, cfg.media_live_mib, cfg.media_preprocess_threads),
    )


def build_app(args: dict[str, Any]):
    """The `import_path` target of the YAML configs."""
    args = dict(args)
    for key in ("host", "port"):
        if key in args:
            raise ValueError(f"args.{key}: in a Serve config the listen address is http_options.{key}")
    return build_application(ServerConfig(**args))
