"""From a validated ServerConfig to running parts: capability gate, engine settings, logging.

Both front doors (`serve run configs/*.yaml` and `ninfer serve ...`) pass through here, so an
option this build cannot honour fails the same way in both, with the flag named.
"""

from __future__ import annotations

import logging
import os
import sys

from ninfer.config import ServerConfig
from ninfer.engine.engine import EngineSettings


class UnsupportedOptionError(ValueError):
    """A startup option that names a capability this build does not provide yet."""


def unimplemented_options(cfg: ServerConfig) -> list[str]:
    problems = []
    if cfg.spec is not None:
        problems.append(f"--spec {cfg.spec}: speculative decoding is not implemented yet")
    if cfg.draft_tokens is not None:
        problems.append("--draft-tokens: speculative decoding is not implemented yet")
    if cfg.lm_head_draft:
        problems.append("--lm-head-draft: speculative decoding is not implemented yet")
    if cfg.vision:
        problems.append("--vision: image and video input is not implemented yet")
    if cfg.kv_dtype != "bf16":
        problems.append(f"--kv-dtype {cfg.kv_dtype}: only bf16 KV storage is implemented")
    if cfg.kv_capacity == "auto":
        problems.append("--kv-capacity auto: sizing from free device memory is not implemented yet; give a token count")
    if cfg.request_log_jsonl is not None:
        problems.append("--request-log-jsonl: the JSONL request log is not implemented yet")
    if cfg.context_cost_presets is not None:
        problems.append("--context-cost-presets: context-cost presets are not implemented yet")
    return problems


def check_implemented(cfg: ServerConfig) -> None:
    problems = unimplemented_options(cfg)
    if problems:
        raise UnsupportedOptionError("cannot start: " + "; ".join(problems))


def engine_settings(cfg: ServerConfig) -> EngineSettings:
    return EngineSettings(
        max_context=cfg.max_context, kv_capacity=cfg.resolved_kv_capacity(), max_concurrency=cfg.max_concurrency,
        max_pending_requests=cfg.max_pending_requests, pending_timeout_ms=cfg.pending_timeout_ms,
        prefill_chunk=cfg.prefill_chunk, page_size=cfg.page_size, state_slots=cfg.state_slots,
        default_max_tokens=cfg.default_max_tokens, default_thinking_budget=cfg.default_thinking_budget,
        sampling_overrides=cfg.process_sampling_overrides(), greedy=cfg.greedy, seed=cfg.seed,
        prefix_reuse=not cfg.no_prefix_reuse, no_cuda_graph=cfg.no_cuda_graph,
        host_context_bytes=None if cfg.host_context_mib is None else cfg.host_context_mib * 1024 * 1024,
    )


def load_engine_for(cfg: ServerConfig, *, device_index: int | None = None, threads: int | None = None):
    """Load the artifact's engine with the config's settings, on CUDA device --device when there is one.

    `device_index` overrides --device where the process only sees the GPU it was given (a Ray replica).
    """
    import torch

    from ninfer.engine.loader import load_engine, pick_device

    device = pick_device(cfg.device if device_index is None else device_index)
    if device.type == "cpu":
        # Ray sets OMP threads from a replica's num_cpus; the engine uses the cores it may run on.
        torch.set_num_threads(threads or max(1, len(os.sched_getaffinity(0))))
    return load_engine(cfg.artifact, engine_settings(cfg), device=device, dtype=cfg.dtype)


TRACE = 5
_LEVELS = {"trace": TRACE, "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL, "off": logging.CRITICAL + 10}


def configure_logging(level: str) -> None:
    """Operational records on stderr: `YYYY-MM-DD HH:MM:SS.mmm LEVEL message`, no prompts or text."""
    logging.addLevelName(TRACE, "TRACE")
    logger = logging.getLogger("ninfer")
    logger.setLevel(_LEVELS[level])
    if not any(getattr(h, "_ninfer", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s.%(msecs)03d %(levelname)s %(message)s",
                                               datefmt="%Y-%m-%d %H:%M:%S"))
        handler._ninfer = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
