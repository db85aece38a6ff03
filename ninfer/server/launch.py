"""`ninfer serve ARTIFACT [flags]`: the reference's flags onto ServerConfig, then the same Ray Serve app.

Flags are generated from ServerConfig's fields (one flag per field, `--max-context` for
`max_context`), so the CLI and the YAML args cannot drift apart; values are validated by the model.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import ValidationError

from ninfer.config import ServerConfig

# Help for every flag, in the contract's order; (metavar, help).
FLAG_HELP: dict[str, tuple[str | None, str]] = {
    "host": ("H", "listen address"),
    "port": ("N", "listen port"),
    "api_key": ("KEY", "require this bearer token or x-api-key value (/health and CORS preflight stay open); "
                       "unset: $NINFER_API_KEY if set"),
    "model_id": ("ID", "public OpenAI model alias (default: the artifact's name, else its architecture)"),
    "max_context": ("N", "logical context ceiling of each sequence, in tokens"),
    "kv_capacity": ("N|auto", "shared KV pool in tokens (default: follows --max-context)"),
    "max_concurrency": ("N", "resident execution lanes, 1..8"),
    "max_pending_requests": ("N", "requests allowed to wait for admission beyond the lanes"),
    "pending_timeout_ms": ("N", "deadline for preparation plus admission, in ms"),
    "prefill_chunk": ("N", "prefill chunk, in tokens"),
    "log_stats_interval_ms": ("N", "throughput report interval in ms; 0 disables it"),
    "log_level": (None, "stderr verbosity"),
    "device": ("N", "CUDA device index"),
    "context_cost_presets": ("FILE", "measured pause-route costs (JSON: transfer GiB/s by hardware, prefill tok/s "
                                     "by hardware and signature; the engine's startup record names both); a "
                                     "malformed file aborts startup"),
    "max_request_mib": ("N", "request body limit in MiB, enforced before JSON parsing"),
    "media_cache_mib": ("N", "LRU-retained prepared media payloads in MiB (vision only)"),
    "media_live_mib": ("N", "all live prepared media payloads in MiB (vision only)"),
    "media_preprocess_threads": ("N", "media preprocessing workers; 0 picks from host cores (vision only)"),
    "request_log_jsonl": ("FILE", "append full-precision JSONL server/request records (its folder must exist)"),
    "response_store_max_records": ("N", "locally retained Responses objects"),
    "response_store_max_mib": ("N", "local Response store budget in MiB"),
    "kv_dtype": (None, "KV-cache storage: bf16 (unquantized, the model's dtype); fp8 (e4m3) or int8, each token "
                       "quantized per KV head with an fp32 scale (~51%% of bf16's bytes per token, ~2x the "
                       "tokens; error within half a step: int8 amax/254, fp8 1/16 of the value); nvfp4, 4-bit "
                       "E2M1 values with an E4M3 scale per 16 and an fp32 scale per head (~29%%, ~3.5x the "
                       "tokens; error within half a step of each 16-block's grid, under 18%% of the block's "
                       "amax); k8v4, int8 K and nvfp4 V (~40%%, ~2.5x the tokens)"),
    "spec": (None, "speculative backend: mtp (the artifact's MTP head), dflash or dflash2 (its block drafter)"),
    "draft_tokens": ("N", "draft tokens: MTP 1..5, DFlash/DFlash2 1..15"),
    "lm_head_draft": (None, "load the optimized proposal head"),
    "default_max_tokens": ("N", "output limit when a request omits one"),
    "default_thinking_budget": ("N", "thinking-token cap for requests that start in thinking mode"),
    "vision": (None, "accept image and video input (the artifact's vision tower is loaded)"),
    "no_cuda_graph": (None, "disable CUDA Graph decode"),
    "no_prefix_reuse": (None, "disable compatible-prefix caching"),
    "device_state_slots": ("N", "extra device state slots beyond --max-concurrency (default: --max-concurrency)"),
    "host_context_mib": ("N", "host budget in MiB for pause snapshots; 0: replay only (default: 8 GiB + 8 state images)"),
    "no_thinking": (None, "disable thinking by default (requests may enable it)"),
    "preserve_thinking": (None, "keep closed-turn assistant reasoning in prompts by default"),
    "cors": (None, "permissive browser CORS headers"),
    "temperature": ("F", "process-level temperature override"),
    "top_p": ("F", "process-level top-p override"),
    "top_k": ("N", "process-level top-k override, 0..20 (0 selects the cap of 20)"),
    "min_p": ("F", "process-level min-p override"),
    "presence_penalty": ("F", "process-level presence-penalty override"),
    "frequency_penalty": ("F", "process-level frequency-penalty override"),
    "seed": ("N", "seed for requests that omit one (default: a fresh random seed per request)"),
    "greedy": (None, "force exact argmax for all requests"),
    "chat_template": ("FILE", "local Jinja chat template instead of the artifact's"),
    "dtype": (None, "weights and compute dtype (auto: bf16 on CUDA, fp32 on CPU; int8: CPU int8 weight-only "
                    "matmuls with bf16 activations)"),
    "page_size": ("N", "KV page size in tokens"),
}


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("artifact", help="the .ninfer model artifact to serve")
    for name, info in ServerConfig.model_fields.items():
        if name == "artifact":
            continue
        metavar, text = FLAG_HELP[name]
        flag = "--" + name.replace("_", "-")
        default = info.default
        shown = "unset" if default is None else ("off" if default is False else default)
        if info.annotation is bool:
            parser.add_argument(flag, dest=name, action="store_true", default=None, help=f"{text} (default: off)")
            continue
        choices = _choices(info.annotation)
        if "(default:" not in text:  # a few fields describe a derived default themselves
            text = f"{text} (default: {shown})"
        parser.add_argument(flag, dest=name, metavar=None if choices else metavar, choices=choices, default=None,
                            help=text)


def _choices(annotation: Any) -> list[str] | None:
    """The values of a Literal field (optional or not), for argparse choices; None for anything else."""
    members = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    values: list[str] = []
    for member in members:
        if member is type(None):
            continue
        if get_origin(member) is not Literal:
            return None
        values += get_args(member)
    return values or None


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    given = {k: v for k, v in vars(args).items() if k in ServerConfig.model_fields and v is not None}
    try:
        return ServerConfig(**given)
    except ValidationError as exc:
        raise SystemExit("ninfer serve: " + flag_errors(exc.errors())) from None


def flag_errors(errors: list[dict[str, Any]]) -> str:
    """Pydantic errors as flag messages; a value failing every member of a union reads as one line."""
    by_flag: dict[str, list[str]] = {}
    for err in errors:
        loc = err["loc"][0] if err["loc"] else None
        flag = "--" + str(loc).replace("_", "-") if loc else "options"
        by_flag.setdefault(flag, []).append(err["msg"].removeprefix("Value error, "))
    return "; ".join(f"{flag}: {' or '.join(msgs)}" for flag, msgs in by_flag.items())


def check_listen_address(host: str, port: int) -> None:
    """An address this host cannot listen on (not its own, or a port in use) is one line before Ray starts, not
    the Serve proxy's tracebacks after it. Serve binds the port itself later, so this socket is closed at once."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
            probe.bind(address)
    except OSError as exc:
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})") from None


def run(cfg: ServerConfig) -> int:
    """Start a local Ray, deploy the graph on cfg.host:cfg.port, serve until SIGINT/SIGTERM."""
    from ninfer.artifact.container import Artifact
    from ninfer.server.proxy_edge import PROXY_CALLBACK, PROXY_CALLBACK_ENV
    from ninfer.server.request_log import ARGV_ENV, redact_argv
    from ninfer.server.startup import check_implemented, configure_logging

    check_implemented(cfg)
    Artifact(cfg.artifact)  # a missing or corrupt file fails here, before Ray starts
    check_listen_address(cfg.host, cfg.port)
    configure_logging(cfg.log_level)
    log = logging.getLogger("ninfer.server")
    os.environ[ARGV_ENV] = json.dumps(redact_argv(sys.argv, cfg.api_key))  # for server_start; replicas inherit it
    if not sys.stderr.isatty():  # Ray colours the replica prefixes it relays to us; redirected stderr stays plain
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")

    import ray
    from ray import serve

    from deployments.app import APP_NAME, build_application

    # Serve's HTTP proxy loads ninfer's edge (TCP keepalive, fresh x-request-id): the local Ray started below
    # gives its actors this environment
    os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
    if cfg.device and "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(cfg.device)  # Ray (and so the engine replica) sees GPU N only
    stop = threading.Event()
    ray.init(include_dashboard=False, log_to_driver=True)
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, whose core replaces SIGTERM's (an abort)
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": cfg.host, "port": cfg.port})
        serve.run(build_application(cfg), name=APP_NAME, route_prefix="/")
        log.info("serving %s on http://%s:%d (auth %s)", cfg.artifact, cfg.host, cfg.port,
                 "on" if cfg.api_key else "off")
        stop.wait()
        log.info("shutting down")
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
