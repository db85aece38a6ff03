"""--request-log-jsonl FILE: the machine-readable measurement log, one JSON object per line.

Every process that writes (a router, an engine replica, or one in-process server) opens the file in
append mode with its own server_instance_id and starts with a server_start record. Each record is one
os.write on an O_APPEND descriptor: it reaches the file at once (nothing buffered to flush) and lines
from several processes never interleave. The request events themselves are built by the observer
(ninfer/server/observer.py); this module owns the file, the record envelope, server_start, throughput,
and argv redaction. The schema is ninfer/server/request_log.schema.json.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ninfer.config import ServerConfig

log = logging.getLogger("ninfer.server")

ARTIFACT_TYPE = "ninfer_serve_request_log"
SCHEMA_VERSION = 24
SCHEMA_PATH = Path(__file__).with_name("request_log.schema.json")
REDACTED = "<redacted>"
ARGV_ENV = "NINFER_ARGV"  # the launcher's redacted command line, inherited by Ray replicas


class RequestLogError(ValueError):
    """--request-log-jsonl names a path the server must not or cannot append to."""


def check_log_path(path: str, artifact: str) -> Path:
    """Fail startup for a missing parent folder, a folder, the model artifact itself, or a file that cannot be
    opened for append (opened, created as the writer would, and closed)."""
    target = _checked_target(path, artifact)
    os.close(_open_for_append(target, path))
    return target


def _checked_target(path: str, artifact: str) -> Path:
    target = Path(path).expanduser()
    if not target.parent.is_dir():
        raise RequestLogError(f"--request-log-jsonl {path}: the folder {target.parent} does not exist")
    if target.is_dir():
        raise RequestLogError(f"--request-log-jsonl {path}: is a folder")
    if os.path.realpath(target) == os.path.realpath(Path(artifact).expanduser()):
        raise RequestLogError(f"--request-log-jsonl {path}: is the model artifact")
    return target


def _open_for_append(target: Path, path: str) -> int:
    try:
        return os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as exc:
        raise RequestLogError(f"--request-log-jsonl {path}: cannot open for append ({exc.strerror})") from None


class RequestLog:
    """One process's writer: a process-unique instance id and monotonic request ids within it."""

    def __init__(self, path: str, artifact: str):
        target = _checked_target(path, artifact)
        self._fd = _open_for_append(target, path)
        self.path = str(target)
        self.instance_id = f"serve-{os.getpid()}-{time.time_ns() // 1000}"
        self._request_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._failed = False

    @classmethod
    def for_config(cls, cfg: ServerConfig) -> "RequestLog | None":
        return cls(cfg.request_log_jsonl, cfg.artifact) if cfg.request_log_jsonl else None

    def next_request_id(self) -> int:
        with self._lock:
            return next(self._request_ids)

    def write(self, event: str, **fields: Any) -> None:
        record = {"artifact_type": ARTIFACT_TYPE, "schema_version": SCHEMA_VERSION, "event": event,
                  "timestamp_unix_ms": time.time_ns() // 1_000_000, "server_instance_id": self.instance_id, **fields}
        try:
            line = (json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n").encode()
            with self._lock:
                os.write(self._fd, line)
        except (OSError, ValueError) as exc:  # measurement must never fail a request; say so once
            if not self._failed:
                self._failed = True
                log.error("request log %s: cannot write a %s record (%s)", self.path, event, type(exc).__name__)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


# ---- argv ----------------------------------------------------------------------------------------
def redact_argv(argv: list[str], api_key: str | None) -> list[str]:
    """The API key never reaches the log: `--api-key KEY`, `--api-key=KEY` and any other mention."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
        elif arg == "--api-key":
            out.append(arg)
            hide_next = True
        elif arg.startswith("--api-key="):
            out.append("--api-key=" + REDACTED)
        elif api_key and api_key in arg:
            out.append(arg.replace(api_key, REDACTED))
        else:
            out.append(arg)
    return out


def config_argv(cfg: ServerConfig) -> list[str]:
    """The `ninfer serve` command line equivalent to a config (YAML-started apps have no argv of ours)."""
    argv = ["ninfer", "serve", cfg.artifact]
    defaults = ServerConfig(artifact=cfg.artifact)
    for name in ServerConfig.model_fields:
        value = getattr(cfg, name)
        if name == "artifact" or value == getattr(defaults, name):
            continue
        flag = "--" + name.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv


def server_argv(cfg: ServerConfig) -> list[str]:
    launched = os.environ.get(ARGV_ENV)
    argv = json.loads(launched) if launched else config_argv(cfg)
    return redact_argv(argv, cfg.api_key)


# ---- server_start and throughput -----------------------------------------------------------------
@dataclass(frozen=True)
class ModelIdentity:
    """What the artifact's metadata says about the served model (read once; no weights)."""

    model_id: str  # the public alias
    name: str
    architecture: str
    sampling_presets: dict[str, dict[str, float]]

    @classmethod
    def of(cls, cfg: ServerConfig) -> "ModelIdentity":
        path = Path(cfg.artifact)
        return _identity(str(path.resolve()), path.stat().st_mtime_ns, cfg.model_id)


@functools.lru_cache(maxsize=16)
def _identity(path: str, mtime_ns: int, model_id: str | None) -> ModelIdentity:
    """Cached per artifact version: tests and notebooks build many apps over one artifact."""
    from ninfer.artifact.container import Artifact

    artifact = Artifact(path)
    return ModelIdentity(model_id=model_id or artifact.public_name, name=artifact.name,
                         architecture=artifact.architecture, sampling_presets=artifact.manifest.sampling_presets)


def server_start_fields(cfg: ServerConfig, model: ModelIdentity, *, role: str, replica: str | None,
                        engine: dict[str, Any] | None = None, report: dict[str, Any] | None = None) -> dict[str, Any]:
    """`role`: router, engine or server (both in one process). `engine` is an engine snapshot and `report` its
    startup_report (memory, formats, environment), given where the engine lives."""
    artifact = Path(cfg.artifact)
    overrides = cfg.process_sampling_overrides()
    presets = model.sampling_presets
    fields: dict[str, Any] = {
        "process": {"role": role, "replica": replica, "pid": os.getpid()},
        "server": {
            "host": cfg.host, "port": cfg.port, "public_model_id": model.model_id,
            "api_key_configured": cfg.api_key is not None, "cors_enabled": cfg.cors,
            "max_request_bytes": cfg.max_request_mib * 1024 * 1024, "request_log_jsonl": cfg.request_log_jsonl,
            "default_output_tokens": cfg.default_max_tokens,
            "default_thinking": False if cfg.no_thinking else None,
            "default_thinking_budget": cfg.default_thinking_budget,
            "default_preserve_thinking": True if cfg.preserve_thinking else None,
        },
        "artifact": {"path": str(artifact), "size_bytes": artifact.stat().st_size if artifact.exists() else None,
                     "architecture": model.architecture, "name": model.name},
        "engine": {
            "device": cfg.device, "dtype": cfg.dtype, "max_context": cfg.max_context,
            "kv_capacity_mode": "auto" if cfg.kv_capacity == "auto" else "explicit",
            "kv_capacity": (engine or {}).get("kv_capacity_tokens", cfg.resolved_kv_capacity()),
            "page_size": cfg.page_size,
            "max_concurrency": cfg.max_concurrency, "max_pending_requests": cfg.max_pending_requests,
            "pending_timeout_ms": cfg.pending_timeout_ms, "prefill_chunk": cfg.prefill_chunk,
            "log_stats_interval_ms": cfg.log_stats_interval_ms, "kv_cache": cfg.kv_dtype, "vision": cfg.vision,
            "cuda_graph": not cfg.no_cuda_graph, "prefix_reuse": not cfg.no_prefix_reuse,
            "speculative_backend": cfg.spec, "speculative_draft_window": cfg.draft_tokens,
            "total_device_state_slots": cfg.state_slots,
        },
        "sampling_defaults": {
            "thinking": presets.get("thinking", {}), "non_thinking": presets.get("non_thinking", {}),
            "server_overrides": {n: overrides.get(n) for n in
                                 ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty")}
                                | {"seed": cfg.seed},
            "omitted_seed": "random" if cfg.seed is None else "server", "greedy": cfg.greedy,
        },
        "argv": server_argv(cfg),
    }
    if engine is not None:
        fields["resources"] = {
            "kv_pages_capacity": engine["kv_pages_capacity"], "state_slots_capacity": engine["state_slots_capacity"],
            "host_context_capacity_bytes": engine["host_context_capacity_bytes"],
            "kv_capacity_tokens": engine.get("kv_capacity_tokens"),
            "kv_sizing": engine.get("kv_sizing"),  # the --kv-capacity auto ledger (bytes), else null
        }
    if report is not None:
        fields.update(report)
    return fields


def _delta(before: dict[str, Any], after: dict[str, Any], key: str) -> Any:
    return after[key] - before[key]


def _dict_delta(before: dict[str, Any], after: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v - before[key].get(k, 0) for k, v in after[key].items()}


def is_idle(before: dict[str, Any], after: dict[str, Any]) -> bool:
    """No token work, nobody resident or waiting, and no context-cache or transfer activity."""
    counted = ("prefill_tokens", "decode_tokens", "replayed_tokens", "prefix_captures", "prefix_evictions",
               "preemptions", "snapshot_restores", "replay_restores")
    busy = after["running"] or after["waiting"] or after["paused"]
    moved = any(_dict_delta(before, after, "context_transfer_bytes").values())
    return not (busy or moved or any(_delta(before, after, k) for k in counted))


def throughput_fields(before: dict[str, Any], after: dict[str, Any], seconds: float,
                      replica: str | None) -> dict[str, Any]:
    """One interval from two engine snapshots: counter deltas, end-of-interval gauges, raw seconds."""
    prefill = _delta(before, after, "prefill_tokens")
    decode = _delta(before, after, "decode_tokens")
    rounds = _delta(before, after, "decode_steps")
    phases = _dict_delta(before, after, "host_work_seconds")
    transfers = _dict_delta(before, after, "context_transfer_bytes")
    host, device_wait = sum(phases.values()), _delta(before, after, "device_wait_seconds")
    detail = _dict_delta(before, after, "host_detail_seconds")
    calls = _dict_delta(before, after, "host_detail_invocations")
    return {
        "replica": replica,
        "interval_seconds": seconds,
        "tokens": {"computed_prefill": prefill, "committed_decode": decode,
                   "replayed": _delta(before, after, "replayed_tokens"),
                   "prompt": _delta(before, after, "prompt_tokens"),
                   "prompt_cached": _delta(before, after, "cached_prompt_tokens"),
                   "generated": _delta(before, after, "generation_tokens")},
        "throughput_tokens_per_second": {"prefill": prefill / seconds, "decode": decode / seconds},
        "scheduler": {k: after[k] for k in ("running", "prefilling", "decode_ready", "waiting", "paused",
                                            "replaying", "materializing", "capture_pending", "terminal_pending")},
        "decode_batch": {"rounds": rounds, "row_rounds": decode, "average_size": decode / rounds if rounds else None},
        "scheduling": {"preemptions": _delta(before, after, "preemptions"),
                       "snapshot_restores": _delta(before, after, "snapshot_restores"),
                       "replay_restores": _delta(before, after, "replay_restores"),
                       "replayed_tokens": _delta(before, after, "replayed_tokens"),
                       "paused_seconds": _delta(before, after, "paused_seconds")},
        "context_cache": {
            "selections": {"hits": _delta(before, after, "prefix_hits"),
                           "misses": _delta(before, after, "prefix_misses"),
                           "reused_prompt_tokens": _delta(before, after, "cached_prompt_tokens")},
            "captures": _delta(before, after, "prefix_captures"),
            "evictions": _delta(before, after, "prefix_evictions"),
            # this engine drops retained prefixes under pressure (it never spills them to the host)
            "pressure_evictions": _delta(before, after, "prefix_pressure_evictions"),
            "state_images": _dict_delta(before, after, "state_images"),
            "tail_page_copies": _delta(before, after, "tail_page_copies"),
            "transfer_bytes": {r: {d: transfers[f"{r}_{d}"] for d in ("d2h", "h2d", "d2d")}
                               for r in ("main_kv", "state", "backend_kv")},
            "occupancy": {k: after[k] for k in ("kv_pages_used", "kv_pages_capacity", "state_slots_used",
                                                "state_slots_capacity", "retained_checkpoints",
                                                "host_context_used_bytes", "host_context_capacity_bytes")},
            "last_selection": after["last_selection"],
        },
        "host_work": {
            "elapsed_seconds": {**phases, "total": host},
            "device_wait_seconds": device_wait,
            "work_class_seconds": _dict_delta(before, after, "work_class_seconds"),
            # already inside the phases above: never add them to total
            "detail_subset_seconds": detail,
            "detail_invocations": calls,
            "per_round_seconds": {"host": _per(host, rounds), "device_wait": _per(device_wait, rounds)},
            "per_row_round_seconds": {"host": _per(host, decode), "device_wait": _per(device_wait, decode)},
            "detail_per_invocation_seconds": {k: _per(detail[k], calls[k]) for k in detail},
        },
    }


def _per(amount: float, count: int) -> float | None:
    """A normalized value; null when its denominator is zero (contract)."""
    return amount / count if count else None
