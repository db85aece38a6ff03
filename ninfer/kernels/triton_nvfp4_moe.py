"""Routed experts with NVFP4 weights for a few tokens (decode): the two fused expert GEMVs of
ninfer.kernels.triton_moe, with the expert rows read as NVFP4 through the packed-fp16 row dot of
ninfer.kernels.triton_nvfp4 (`_rows_dot`: a 16-weight scale block per thread and row, decoded in
registers, fp16 pair products, fp32 block sums).

- `_gate_up_kernel`: one program per ((token, choice) pair, BLOCK_N intermediate rows): the gate rows
  and the matching up rows of the pair's expert against x[token], then silu(gate) * up -> act.
- `_down_kernel`: one program per (token, BLOCK_N output rows): for each of the token's k choices in
  order, the expert's down rows against act[pair], times the routing weight, summed in a fixed
  order (deterministic, no atomics).

Values the torch path rounds to the model dtype are rounded here too (each projection's output,
silu(gate), silu * up, each expert's output and its product with the routing weight), as in
triton_moe. Shapes only decide the launches (CUDA-graph capturable). bf16 x; on CPU the kernels run
under TRITON_INTERPRET=1 with the PTX emulated (tests/test_nvfp4_moe.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.pdl import pdl_enter, pdl_launch
from ninfer.kernels.triton_nvfp4 import _F16_UNSCALE, _SCALE_UP, _rows_dot


@triton.jit
def _row_ptrs(W, S, first, COUNT: tl.constexpr, KW: tl.constexpr):
    """Pointers to COUNT consecutive NVFP4 rows from `first` (KW words, KW / 2 scale bytes each)."""
    wps = ()
    sps = ()
    for i in tl.static_range(COUNT):
        wps = wps + (W + (first + i) * KW,)
        sps = sps + (S + (first + i) * (KW // 2),)
    return wps, sps


@triton.jit
def _gate_up_kernel(
    X32, IDS, W, S, RS, ACT, stride_x32,
    HID_W: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    pair = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    expert = tl.load(IDS + pair).to(tl.int64)
    first = expert * (2 * INTER) + n0  # gate rows [n0, n0 + BLOCK_N), up rows INTER further
    gate_w, gate_s = _row_ptrs(W, S, first, BLOCK_N, HID_W)
    up_w, up_s = _row_ptrs(W, S, first + INTER, BLOCK_N, HID_W)
    wps = gate_w + up_w
    sps = gate_s + up_s
    sums = _rows_dot(X32 + (pair // TOP_K) * stride_x32, 0, wps, sps, HID_W, BLOCK_W, 1, 1, False)
    dt = ACT.dtype.element_ty
    one = tl.arange(0, 1)
    for i in tl.static_range(BLOCK_N):
        rs_gate = tl.load(RS + first + i) * _F16_UNSCALE
        rs_up = tl.load(RS + first + INTER + i) * _F16_UNSCALE
        gate = (sums[i] * _SCALE_UP * rs_gate).to(dt).to(tl.float32)  # the projection's output, rounded
        up = (sums[BLOCK_N + i] * _SCALE_UP * rs_up).to(dt).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32) * up  # F.silu(gate) * up, each rounded
        tl.store(ACT + pair * INTER + n0 + i + one, act.to(dt))


@triton.jit
def _down_kernel(
    ACT32, IDS, WTS, W, S, RS, OUT, stride_ot,
    INTER_W: tl.constexpr, HID: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1) * BLOCK_N
    dt = OUT.dtype.element_ty
    accs = ()
    for _i in tl.static_range(BLOCK_N):
        accs = accs + (tl.zeros([1], dtype=tl.float32),)
    for j in tl.static_range(TOP_K):  # the choices in order: a fixed summation order
        pair = token * TOP_K + j
        expert = tl.load(IDS + pair).to(tl.int64)
        weight = tl.load(WTS + pair).to(tl.float32)
        first = expert * HID + h0
        wps, sps = _row_ptrs(W, S, first, BLOCK_N, INTER_W)
        sums = _rows_dot(ACT32 + pair * (INTER_W * 4), 0, wps, sps, INTER_W, BLOCK_W, 1, 1, False)
        new = ()
        for i in tl.static_range(BLOCK_N):
            rs = tl.load(RS + first + i) * _F16_UNSCALE
            y = (sums[i] * _SCALE_UP * rs).to(dt).to(tl.float32)  # the expert's output, rounded
            new = new + (accs[i] + (y * weight).to(dt).to(tl.float32),)  # times its weight, rounded
        accs = new
    one = tl.arange(0, 1)
    for i in tl.static_range(BLOCK_N):
        tl.store(OUT + token * stride_ot + h0 + i + one, accs[i].to(dt))


def _rows_per_program(rows: int, preferred: int) -> int:
    block = preferred
    while rows % block:
        block //= 2
    return block


def fused_experts_nvfp4(x: torch.Tensor, top_ids: torch.Tensor, top_weights: torch.Tensor, gate_up: tuple,
                        down: tuple) -> torch.Tensor:
    """x [T, H] bf16; top_ids, top_weights [T, k]; gate_up, down: (packed uint8 [E, N, K/2], scale
    float8_e4m3fn [E, N, K/16], row_scale fp32 [E, N]) of gate_up_proj [E, 2I, H] and down_proj
    [E, H, I]. -> sum_j w[t, j] * down[e_j](silu(gate[e_j] x_t) * up[e_j] x_t), [T, H] bf16."""
    tokens, top_k = top_ids.shape
    hidden = x.shape[-1]
    num_experts, inter2, half_h = gate_up[0].shape
    inter = inter2 // 2
    if half_h * 2 != hidden or down[0].shape != (num_experts, hidden, inter // 2) or hidden % 16 or inter % 16:
        raise ValueError("fused_experts_nvfp4: expert shapes do not match x (or H, I not multiples of 16)")
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    x32 = x.contiguous().view(torch.int32)
    ids = top_ids.contiguous()
    wts = top_weights.contiguous()
    act = torch.empty((tokens * top_k, inter), dtype=x.dtype, device=x.device)
    g_packed, g_scale, g_rs = (t.contiguous() for t in gate_up)
    d_packed, d_scale, d_rs = (t.contiguous() for t in down)
    block_up = _rows_per_program(inter, 4)
    _gate_up_kernel[(tokens * top_k, inter // block_up)](
        x32, ids, g_packed.view(torch.int32), g_scale.view(torch.uint8), g_rs, act, x32.stride(0),
        HID_W=hidden // 8, INTER=inter, TOP_K=top_k, BLOCK_N=block_up, BLOCK_W=64, num_warps=1, **pdl_launch(x.device),
    )
    block_down = _rows_per_program(hidden, 4)
    _down_kernel[(tokens, hidden // block_down)](
        act.view(torch.int32), ids, wts, d_packed.view(torch.int32), d_scale.view(torch.uint8), d_rs, out,
        out.stride(0), INTER_W=inter // 8, HID=hidden, TOP_K=top_k, BLOCK_N=block_down, BLOCK_W=64,
        num_warps=1, **pdl_launch(x.device),
    )
    return out
