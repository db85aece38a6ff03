"""What an engine holds in memory and where it runs, for the request log's server_start (contract, "Structured request
log": Device arenas, the optional Vision layout inside the workspace, CUDA/GPU environment).

Arenas are the engine's fixed allocations, counted from their tensors: weights (the target's, a drafter's own and the
vision tower's, each tensor once however many modules share it), the paged KV of the model cache and of companion
caches (a block drafter's context), and the recurrent-state slots. There is no single workspace allocation here: on
CUDA, torch's caching allocator holds activations, graph pools and scratch, so `workspace.capacity_bytes` is what it
had reserved beyond the arenas when the report was taken (after start-up's warm-up and graph capture); on the CPU,
null.
"""

from __future__ import annotations

import platform
from typing import Any, Iterable

import torch


def _bytes(tensors: Iterable[torch.Tensor | None], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if t is None or t.numel() == 0 or t.untyped_storage().data_ptr() in seen:
            continue
        seen.add(t.untyped_storage().data_ptr())
        total += t.untyped_storage().nbytes()
    return total


def _module_tensors(module: torch.nn.Module | None) -> list[torch.Tensor]:
    return [] if module is None else [*module.parameters(), *module.buffers()]


def _drafter_modules(proposer: Any) -> list[torch.nn.Module]:
    return [v for v in vars(proposer).values() if isinstance(v, torch.nn.Module)] if proposer is not None else []


def memory_report(runner, proposer, companions, *, vision_token_bound: int | None,
                  prompt_token_bound: int) -> dict[str, Any]:
    """`vision_token_bound`: merged vision tokens one request may carry (None without --vision)."""
    seen: set[int] = set()
    cache = runner.cache
    arenas = {
        "weights": _bytes(_module_tensors(runner.model), seen),
        "drafter_weights": _bytes((t for m in _drafter_modules(proposer) for t in _module_tensors(m)), seen),
        "vision_weights": _bytes(_module_tensors(runner.vision_tower), seen),
        "main_kv": _bytes((cache.k, cache.v, cache.k_scale, cache.v_scale), seen),
        "backend_kv": _bytes((t for c in companions for t in (c.k, c.v, c.k_scale, c.v_scale)), seen),
        "state": _bytes((cache.conv, cache.ssm), seen),
    }
    device = runner.device
    workspace = None
    if device.type == "cuda":
        reserved = torch.cuda.memory_reserved(device)
        workspace = {"capacity_bytes": max(reserved - sum(arenas.values()), 0), "allocator_reserved_bytes": reserved}
    vision = None
    if runner.vision_tower is not None:  # inside the same allocator: never add it to the workspace
        vision = {"request_token_bound": vision_token_bound, "prompt_token_bound": prompt_token_bound}
    return {"device": str(device), "arenas_bytes": arenas, "workspace": workspace, "vision_workspace": vision}


def environment(device: torch.device) -> dict[str, Any]:
    """The software and device the engine runs on."""
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda_runtime": torch.version.cuda, "triton": _version("triton"),
                           "device_type": device.type, "gpu": None}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu"] = {"name": props.name, "compute_capability": f"{props.major}.{props.minor}",
                      "total_memory_bytes": props.total_memory, "multiprocessors": props.multi_processor_count}
    else:
        env["cpu_threads"] = torch.get_num_threads()
    return env


def _version(package: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:  # not installed (the CPU path needs no triton)
        return None
