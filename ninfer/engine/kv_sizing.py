"""`--kv-capacity auto`: size the shared KV pool from the device memory the rest of the runtime leaves.

On CUDA, after the weights are loaded: measure what one prefill chunk (the largest unit the engine
runs) allocates beyond the weights, on a throwaway cache; then give the KV pool everything free
except that workspace, the recurrent-state slots, an allowance for the CUDA graphs (the decode
graphs' small pool, plus a second chunk workspace for the prefill graph's own pool, which lives
beside the eager path's) and a 1 GiB headroom (serving.md, "--kv-capacity ... auto ... leaves 1 GiB of sizing headroom").
Capacity resolves once, here, at startup.

On CPU there is no device memory to share out: auto gives every lane a full --max-context.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ninfer.forward import CacheSpec, ForwardBatch, ModelCache

HEADROOM_BYTES = 1 << 30
GRAPH_ALLOWANCE_BYTES = 256 << 20  # decode graphs' private pool: batch <= 8 activations, measured far below


@dataclass(frozen=True)
class KVSizing:
    """The ledger behind an automatic capacity (bytes), logged at startup."""

    tokens: int
    free_bytes: int
    workspace_bytes: int
    state_bytes: int
    graph_allowance_bytes: int  # decode graphs, plus one chunk workspace when the prefill graph is captured
    headroom_bytes: int
    kv_bytes_per_token: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def _prefill_workspace_bytes(model: torch.nn.Module, *, chunk: int, page_size: int, vocab_size: int,
                             device: torch.device, dtype: torch.dtype, kv_dtype: str) -> int:
    """Peak bytes one `chunk`-token prefill forward allocates beyond what is already allocated,
    its own small cache included (so the figure is an upper bound on the workspace)."""
    pages = -(-chunk // page_size)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    cache = ModelCache(model.cache_spec(), pages, page_size, 1, dtype, device, kv_dtype=kv_dtype)
    batch = ForwardBatch.build([[t % vocab_size for t in range(chunk)]], [0], [list(range(pages))], page_size,
                               state_slots=[0], device=device)
    with torch.inference_mode():
        hidden = model(batch, cache)
        model.compute_logits(hidden[batch.last_token_indices()])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del cache, batch, hidden
    torch.cuda.empty_cache()
    return peak


def auto_kv_capacity(model: torch.nn.Module, *, page_size: int, prefill_chunk: int, num_state_slots: int,
                     max_context: int, max_concurrency: int, vocab_size: int, device: torch.device,
                     dtype: torch.dtype, kv_dtype: str, cuda_graphs: bool = True,
                     spec: CacheSpec | None = None) -> KVSizing:
    """cuda_graphs: whether the runner will capture graphs (not --no-cuda-graph). spec: the cache the
    runner allocates (default the model's; a drafter riding in it adds layers to every token's bytes)."""
    spec = spec or model.cache_spec()
    per_token = spec.kv_bytes_per_token(dtype, kv_dtype)
    if device.type != "cuda":
        tokens = max_context * max_concurrency
        return KVSizing(tokens, 0, 0, 0, 0, 0, per_token)
    workspace = _prefill_workspace_bytes(model, chunk=prefill_chunk, page_size=page_size, vocab_size=vocab_size,
                                         device=device, dtype=dtype, kv_dtype=kv_dtype)
    free = _available_bytes(device)
    state = spec.state_bytes_per_slot(dtype) * num_state_slots
    graphs = GRAPH_ALLOWANCE_BYTES + workspace if cuda_graphs else 0
    budget = free - workspace - state - graphs - HEADROOM_BYTES
    tokens = (max(0, budget) // per_token) // page_size * page_size if per_token else max_context * max_concurrency
    if tokens < page_size:
        raise RuntimeError(
            f"--kv-capacity auto: no room for a KV cache ({free / 2**30:.2f} GiB free after the weights; "
            f"workspace {workspace / 2**30:.2f} GiB, state slots {state / 2**30:.2f} GiB, headroom 1 GiB)")
    return KVSizing(tokens, free, workspace, state, graphs, HEADROOM_BYTES, per_token)


class KVCapacityError(ValueError):
    """The KV pool (and state slots) asked for cannot fit in the memory there is."""


def check_kv_fits(spec: CacheSpec, *, tokens: int, num_state_slots: int, device: torch.device, dtype: torch.dtype,
                  kv_dtype: str) -> None:
    """Refuse a pool larger than the memory available for it, with the sizes, before allocating it: a huge
    --kv-capacity (or --max-context, which it follows) otherwise ends in the kernel's OOM kill, without a word."""
    need = tokens * spec.kv_bytes_per_token(dtype, kv_dtype) + num_state_slots * spec.state_bytes_per_slot(dtype)
    available = _available_bytes(device)
    if available is not None and need > available:
        raise KVCapacityError(
            f"a KV pool of {tokens:,} tokens with {num_state_slots} state slots needs {need / 2**30:.2f} GiB, more "
            f"than the {available / 2**30:.2f} GiB available on {device.type}: lower --kv-capacity or --max-context "
            "(or use --kv-capacity auto on a GPU)")


def _available_bytes(device: torch.device) -> int | None:
    """Free device memory (with what torch's allocator holds cached, reusable), or the host's available memory;
    None where it cannot be read."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None  # unknown here: nothing to check against
