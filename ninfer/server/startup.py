"""From a validated ServerConfig to running parts: capability gate, engine settings, logging.

Both front doors (`serve run configs/*.yaml` and `ninfer serve ...`) pass through here, so an
option this build cannot honour fails the same way in both, with the flag named.
"""

from __future__ import annotations

import logging
import os
import time

from ninfer.config import ServerConfig
from ninfer.engine.context_cost_registry import read_presets
from ninfer.engine.engine import EngineSettings
from ninfer.forward import KV_DTYPES
from ninfer.server.gc_freeze import freeze_startup_objects
from ninfer.server.oplog import configure_logging
from ninfer.server.request_log import check_log_path

log = logging.getLogger("ninfer.server")


DEFAULT_DRAFTS = {"mtp": 3, "dflash": 7, "dflash2": 7}  # without --draft-tokens


class UnsupportedOptionError(ValueError):
    """A startup option that names a capability this build does not provide yet."""


def unimplemented_options(cfg: ServerConfig) -> list[str]:
    problems = []
    if cfg.kv_dtype not in KV_DTYPES:
        problems.append(f"--kv-dtype {cfg.kv_dtype}: {cfg.kv_dtype} KV storage is unsupported in this build "
                        f"(supported: {', '.join(KV_DTYPES)})")
    return problems


def check_implemented(cfg: ServerConfig) -> None:
    """The startup gate both front doors pass: unsupported options, missing artifact components, a malformed
    cost registry, a request-log file that cannot be appended to and a chat template that cannot be read or
    compiled all stop startup here, before Ray starts."""
    problems = unimplemented_options(cfg)
    if problems:
        raise UnsupportedOptionError("cannot start: " + "; ".join(problems))
    check_components(cfg)
    if cfg.context_cost_presets is not None:
        read_presets(cfg.context_cost_presets)  # a malformed registry aborts startup (ContextCostError)
    if cfg.request_log_jsonl is not None:
        check_log_path(cfg.request_log_jsonl, cfg.artifact)
    if cfg.chat_template is not None:  # unreadable or not compiling: one line here, not a replica's traceback
        from ninfer.chat import ChatTemplateError, load_chat_template

        try:
            load_chat_template(cfg.chat_template)
        except ChatTemplateError as exc:
            raise ChatTemplateError(f"--chat-template {cfg.chat_template}: {exc}") from None


def check_components(cfg: ServerConfig) -> None:
    """The artifact holds what the selected capabilities load (read from its header only): the drafter of
    --spec, the proposal head of --lm-head-draft, the vision tower of --vision."""
    from ninfer.artifact.container import Artifact

    if not (cfg.spec or cfg.vision) or not os.path.exists(cfg.artifact):
        return  # a missing file fails the load with its own message
    have = Artifact(cfg.artifact).manifest.components
    wanted = [(cfg.spec, "--spec " + str(cfg.spec)), ("draft_head" if cfg.lm_head_draft else None, "--lm-head-draft"),
              ("vision" if cfg.vision else None, "--vision")]
    missing = [f"{flag} needs the artifact's {part!r} component" for part, flag in wanted if part and part not in have]
    if missing:
        where = []
        if any(part and part != "vision" and part not in have for part, _ in wanted):
            where.append("README 'Speculative decoding' says how to add drafter components")
        if cfg.vision and "vision" not in have:
            where.append("a vision tower comes with `ninfer convert hf` of a checkpoint that has one (README "
                         "'Making artifacts')")
        raise UnsupportedOptionError(f"cannot start: {cfg.artifact}: " + "; ".join(missing) +
                                     f" (it has: {', '.join(sorted(have))}); " + "; ".join(where))


def engine_settings(cfg: ServerConfig) -> EngineSettings:
    return EngineSettings(
        max_context=cfg.max_context, kv_capacity=cfg.kv_capacity or cfg.max_context, kv_dtype=cfg.kv_dtype,
        max_concurrency=cfg.max_concurrency,
        max_pending_requests=cfg.max_pending_requests, pending_timeout_ms=cfg.pending_timeout_ms,
        prefill_chunk=cfg.prefill_chunk, page_size=cfg.page_size, state_slots=cfg.state_slots,
        default_max_tokens=cfg.default_max_tokens, default_thinking_budget=cfg.default_thinking_budget,
        sampling_overrides=cfg.process_sampling_overrides(), greedy=cfg.greedy, seed=cfg.seed,
        prefix_reuse=not cfg.no_prefix_reuse, no_cuda_graph=cfg.no_cuda_graph,
        host_context_bytes=None if cfg.host_context_mib is None else cfg.host_context_mib * 1024 * 1024,
        context_cost_presets=cfg.context_cost_presets,
        scheduling_events=cfg.request_log_jsonl is not None,  # request_scheduling records need them
        vision=cfg.vision, spec=cfg.spec, draft_tokens=cfg.draft_tokens or DEFAULT_DRAFTS.get(cfg.spec, 0),
        lm_head_draft=cfg.lm_head_draft, adaptive_drafts=True,
    )


def engine_cpu_threads() -> int:
    """Threads of a CPU engine's decode steps inside the served graph where it does not time them
    (engine_thread_chooser, the default since s38): NINFER_CPU_THREADS, else one fewer than the
    cores this process may run on from three cores, and every core on one or two. The router, the HTTP proxy and
    Ray's own processes need CPU too, and a decode step's threads work in lockstep: one of them descheduled stalls
    the others (bench/results/2026-12-03-cpu-s14). On two cores, though, one decode thread halves the step's
    bandwidth and costs more than the stalls: through HTTP, three alternating rounds, 66.6 / 58.2 / 53.8 tok/s
    with two threads against 63.0 / 53.6 / 46.0 with one at 128 / 1,000 / 2,000 tokens
    (bench/results/2026-12-05-cpu-s23/http_threads; s14 had measured the reverse at 128 tokens on an older step).
    Prefill, compute-bound and long, takes every core."""
    cores = _cores()
    return int(os.environ.get("NINFER_CPU_THREADS", "0")) or (cores if cores <= 2 else cores - 1)


def engine_thread_chooser():
    """The served CPU engine's decode threads chosen by timing its steps (ninfer.kernels.cpu_threads): between one
    fewer than its cores and all of them; None where NINFER_CPU_THREADS fixes the count or there is one core."""
    from ninfer.kernels.cpu_threads import ThreadChooser

    cores = _cores()
    if os.environ.get("NINFER_CPU_THREADS") or cores < 2:
        return None
    return ThreadChooser((cores - 1, cores))


def _cores() -> int:
    """Cores this process may run on."""
    return len(os.sched_getaffinity(0))


def load_engine_for(cfg: ServerConfig, *, device_index: int | None = None, threads: int | None = None):
    """Load the artifact's engine with the config's settings, on CUDA device --device when there is one.

    `device_index` overrides --device where the process only sees the GPU it was given (a Ray replica).
    """
    import torch

    from ninfer.engine.loader import load_engine, pick_device

    device = pick_device(cfg.device if device_index is None else device_index)
    if device.type == "cpu":
        # Ray sets OMP threads from a replica's num_cpus; the engine sets its own: torch's (prefill) every core,
        # the native decode step's engine_cpu_threads()
        from ninfer.kernels import cpu_native

        torch.set_num_threads(threads or _cores())
        cpu_native.decode_threads = threads or engine_cpu_threads()
        cpu_native.thread_chooser = None if threads else engine_thread_chooser()
        if cpu_native.thread_chooser is not None:
            log.info("CPU decode threads: chosen among %s by timing the steps",
                     "/".join(map(str, cpu_native.thread_chooser.candidates)))
    log.info("loading %s on %s", cfg.artifact, device)
    started = time.monotonic()
    engine = load_engine(cfg.artifact, engine_settings(cfg), device=device, dtype=cfg.dtype)
    snap = engine.snapshot()
    kv = engine.runner.cache
    log.info("engine ready in %.1f s: %d lanes, KV %d pages of %d tokens (%s, %.1f MiB), %d state slots, "
             "prefix reuse %s", time.monotonic() - started, cfg.max_concurrency, snap["kv_pages_capacity"],
             cfg.page_size, cfg.kv_dtype, kv.kv_bytes / 2**20, snap["state_slots_capacity"],
             "off" if cfg.no_prefix_reuse else "on")
    return engine


__all__ = ["UnsupportedOptionError", "check_implemented", "configure_logging", "engine_settings",
           "engine_cpu_threads", "freeze_startup_objects", "load_engine_for", "unimplemented_options"]
