"""The fused decode MoE (`triton_moe`) against the torch path, and its speed, at the 35B-A3B shapes.

- `check_moe(device, dtype)`: routing and routed experts of random problems, Triton vs the torch
  path (`SparseMoeBlock`'s routing lines, `Experts.forward` with NINFER_KERNELS=reference); on CUDA
  also a whole `SparseMoeBlock` with the hooks on vs forced reference. Max abs diffs per T.
- `time_moe(device)`: per-layer time of routing + routed experts, fused vs torch, each captured in
  a CUDA graph over `layers` distinct layers (so one layer's experts are not still in L2 for the
  next), and GB/s over the expert bytes the step must read (distinct experts x expert size).

On an H200:  python -c "from bench import selfcheck_moe as s; s.main()"
The Triton kernels also run on CPU tensors under TRITON_INTERPRET=1 (tests/test_moe_kernel.py).
"""

from __future__ import annotations

import contextlib
import json
import os

import torch

from ninfer.kernels.backend import ENV_VAR

SHAPE_35B_A3B = {"experts": 256, "top_k": 8, "hidden": 2048, "intermediate": 512}


@contextlib.contextmanager
def forced_reference():
    """NINFER_KERNELS=reference inside the block: every dispatch takes the torch path."""
    old = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = "reference"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = old


def route_ref(logits: torch.Tensor, top_k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseMoeBlock.forward's routing, line for line."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top_weights, top_ids = probs.topk(top_k, dim=-1)
    return (top_weights / top_weights.sum(-1, keepdim=True)).to(dtype), top_ids


def make_experts(gate_up: torch.Tensor, down: torch.Tensor):
    """An `Experts` module over these weights (shared storage, no copy)."""
    from ninfer.kernels.moe import Experts

    mod = Experts(1, 1, 1)
    mod.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
    mod.down_proj = torch.nn.Parameter(down, requires_grad=False)
    return mod


def experts_ref(x, top_ids, top_weights, gate_up, down) -> torch.Tensor:
    """Experts.forward's torch path (grouped GEMMs, or the per-expert loop off bf16 CUDA)."""
    with forced_reference():
        return make_experts(gate_up, down)(x, top_ids, top_weights)


def moe_weights(device, dtype, *, experts: int, hidden: int, intermediate: int, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    gate_up = torch.randn((experts, 2 * intermediate, hidden), generator=gen, device=device, dtype=dtype)
    down = torch.randn((experts, hidden, intermediate), generator=gen, device=device, dtype=dtype)
    return gate_up.mul_(hidden**-0.5), down.mul_(intermediate**-0.5)


def moe_inputs(device, dtype, *, tokens: int, experts: int, hidden: int, seed: int = 1):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn((tokens, hidden), generator=gen, device=device, dtype=dtype)
    logits = (torch.randn((tokens, experts), generator=gen, device=device) * 2).to(dtype)
    return x, logits


def check_moe(device="cuda", dtype=torch.bfloat16, *, tokens=(1, 8), experts=None, top_k=None, hidden=None,
              intermediate=None, seed=0, config: dict | None = None) -> dict:
    """{f"T={t}": {"route_ids_equal", "route_ids_differ_untied", "route_w", "experts", "experts_ref_absmax",
    ["block"]}}: max abs diffs of the Triton routing weights and routed-experts output vs the torch
    path (on the torch path's own ids, so a near-tie in routing cannot hide a kernel error), and on
    CUDA of a whole SparseMoeBlock (hooks on vs forced reference). Defaults: the 35B-A3B shapes and
    the default tiles."""
    from ninfer.kernels import triton_moe

    shape = SHAPE_35B_A3B | {k: v for k, v in dict(experts=experts, top_k=top_k, hidden=hidden,
                                                      intermediate=intermediate).items() if v is not None}
    e, k, h, i = shape["experts"], shape["top_k"], shape["hidden"], shape["intermediate"]
    gate_up, down = moe_weights(device, dtype, experts=e, hidden=h, intermediate=i, seed=seed)
    out = {"shape": shape, "dtype": str(dtype)}
    for t in tokens:
        x, logits = moe_inputs(device, dtype, tokens=t, experts=e, hidden=h, seed=seed + 1 + t)
        w_ref, ids_ref = route_ref(logits, k, dtype)
        w_tri, ids_tri = triton_moe.route(logits, k, dtype)
        ref = experts_ref(x, ids_ref, w_ref, gate_up, down).float()
        got = triton_moe.fused_experts(x, ids_ref, w_ref, gate_up, down, config).float()
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        res = {
            "route_ids_equal": bool(torch.equal(ids_tri.cpu(), ids_ref.cpu())),
            # ids may differ only between experts of equal probability (bf16 logits tie often)
            "route_ids_differ_untied": int((probs.gather(1, ids_tri) != probs.gather(1, ids_ref)).sum().item()),
            "route_w": (w_tri.float() - w_ref.float()).abs().max().item(),
            "experts": (got - ref).abs().max().item(),
            "experts_ref_absmax": ref.abs().max().item(),
        }
        if torch.device(device).type == "cuda":
            res["block"] = _check_block(device, dtype, x, gate_up, down, k)
        out[f"T={t}"] = res
    return out


def _check_block(device, dtype, x, gate_up, down, top_k) -> float:
    """A whole SparseMoeBlock over these experts: dispatch as on this device vs forced reference."""
    from ninfer.models.moe import SparseMoeBlock

    e, two_i, h = gate_up.shape
    cfg = {"hidden_size": h, "num_experts_per_tok": top_k, "num_experts": e,
           "moe_intermediate_size": two_i // 2, "shared_expert_intermediate_size": two_i // 2}
    with torch.device("meta"):
        block = SparseMoeBlock(cfg)
    block = block.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(7)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if not name.startswith("experts."):
                p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=dtype) * p.shape[-1] ** -0.5)
        block.experts.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
        block.experts.down_proj = torch.nn.Parameter(down, requires_grad=False)
        got = block(x).float()
        with forced_reference():
            ref = block(x).float()
    return (got - ref).abs().max().item()


# ---- timing ---------------------------------------------------------------------------------------


def _graph_time_us(fn, iters: int) -> float:
    """Mean time of one fn() replayed from a CUDA graph, in microseconds."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile / autotune / allocate outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters


def time_moe(device="cuda", dtype=torch.bfloat16, *, tokens=(1, 8), layers: int = 8, iters: int = 50,
             configs: list[dict] | None = None, **shape_overrides) -> dict:
    """Per-layer microseconds of routing + routed experts (the torch path: softmax/topk/renorm, then
    Experts.forward's grouped GEMMs; the fused path: route + fused_experts), each captured in one
    CUDA graph that runs `layers` distinct layers, plus GB/s over the expert bytes read (each
    distinct expert of a layer once). `configs`: extra tile configs for fused_experts to time."""
    from ninfer.kernels import triton_moe

    shape = SHAPE_35B_A3B | shape_overrides
    e, k, h, i = shape["experts"], shape["top_k"], shape["hidden"], shape["intermediate"]
    weights = [moe_weights(device, dtype, experts=e, hidden=h, intermediate=i, seed=10 + n) for n in range(layers)]
    mods = [make_experts(gu, dn) for gu, dn in weights]
    expert_bytes = 3 * i * h * torch.empty((), dtype=dtype).element_size()
    out = {"shape": shape, "dtype": str(dtype), "layers": layers,
           "device": torch.cuda.get_device_name(torch.device(device))}
    for t in tokens:
        inputs = [moe_inputs(device, dtype, tokens=t, experts=e, hidden=h, seed=100 + n) for n in range(layers)]
        distinct = sum(route_ref(lg, k, dtype)[1].unique().numel() for _, lg in inputs) / layers
        layer_bytes = distinct * expert_bytes

        def torch_path(inputs=inputs):
            with forced_reference():
                for (x, lg), mod in zip(inputs, mods):
                    w, ids = route_ref(lg, k, dtype)
                    mod(x, ids, w)

        def fused_path(cfg=None, inputs=inputs):
            for (x, lg), (gu, dn) in zip(inputs, weights):
                w, ids = triton_moe.route(lg, k, dtype)
                triton_moe.fused_experts(x, ids, w, gu, dn, cfg)

        def route_only(inputs=inputs):
            for _, lg in inputs:
                triton_moe.route(lg, k, dtype)

        res = {"distinct_experts": distinct, "expert_MB": layer_bytes / 1e6,
               "config": triton_moe.default_config(t, k, h, i)}
        for name, fn in (("torch", torch_path), ("fused", fused_path), ("fused_route_only", route_only)):
            us = _graph_time_us(fn, iters) / layers
            res[f"{name}_us"] = round(us, 2)
            if name != "fused_route_only":
                res[f"{name}_GBps"] = round(layer_bytes / us / 1e3, 1)
        for cfg in configs or []:
            us = _graph_time_us(lambda cfg=cfg: fused_path(cfg), iters) / layers
            res.setdefault("sweep", []).append({"config": cfg, "us": round(us, 2),
                                                "GBps": round(layer_bytes / us / 1e3, 1)})
        out[f"T={t}"] = res
    return out


SWEEP = [  # around the default (block_n 2, block_k 256, warps_up 1, block_h 1, block_i 512, warps_down 1)
    {"block_n": 1, "block_k": 1024, "block_h": 2},
    {"block_n": 4, "block_h": 2},
    {"block_n": 2, "block_k": 512, "block_h": 1, "warps_down": 2},
    {"block_n": 4, "block_h": 4, "warps_up": 4, "warps_down": 4},
]


def main() -> None:
    for dtype in (torch.bfloat16, torch.float32):
        print(json.dumps({"check_moe": check_moe("cuda", dtype)}, indent=1))
    print(json.dumps({"time_moe": time_moe("cuda", configs=SWEEP)}, indent=1))


if __name__ == "__main__":
    main()
