"""Fused routed-expert MoE for a few tokens (decode): routing plus two GEMV kernels, no sort or scatter.

The torch path (`ninfer.kernels.moe.routed_experts`) sorts the (token, choice) pairs by
expert, gathers, runs two grouped GEMMs at tiny M, applies SwiGLU, scatters back and reduces:
about a dozen small kernels a layer. For T <= MAX_TOKENS tokens this module does it in three:

- `route`: one program per token: softmax over the E router logits in fp32, top-k by repeated
  argmax (descending, like `torch.topk`; ties go to the lower expert id), renormalised in fp32 and
  rounded to the model dtype; ids int64. Any T (one program per token).
- `_gate_up_act_kernel`: one program per ((token, choice) pair, block of BLOCK_N intermediate
  rows): the gate rows [n, n + BLOCK_N) and the matching up rows [I + n, ...) of
  gate_up_proj[expert] ([E, 2I, H], gate rows first, as the checkpoint stores them) against
  x[token], then silu(gate) * up -> act [T*k, I]. The pair index varies fastest, so pairs of
  different tokens that share an expert read the same weight rows at about the same time (L2).
- `_down_sum_kernel`: one program per (token, block of BLOCK_H output rows): for each of the
  token's k choices in order, down_proj[expert] rows ([E, H, I]) against act[pair], times the
  routing weight, summed in fp32 over the choices in a fixed order: deterministic, no atomics,
  and no [T*k, H] intermediate.

Weights are read as [rows, BLOCK] tiles along their contiguous last dim (8 bf16 = 16 bytes per
thread and load). The math is fp32 and every value the torch path rounds to the model dtype is
rounded here too (grouped-GEMM outputs, silu(gate), silu * up, each expert's output, its product
with the routing weight), so on CUDA bf16 the two agree up to fp32 reassociation of the dot
products. Launch configurations depend on shapes only and nothing reads the device:
CUDA-graph capturable. The kernels run on CPU tensors under TRITON_INTERPRET=1
(tests/test_moe_kernel.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.pdl import pdl_enter, pdl_launch

MAX_TOKENS = 16  # Experts.forward takes this path for T <= MAX_TOKENS on CUDA; prefill keeps grouped GEMMs


# ---- routing --------------------------------------------------------------------------------------


@triton.jit
def _route_kernel(LOGITS, IDS, WTS, E, stride_lt, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    mask = cols < E
    logits = tl.load(LOGITS + t * stride_lt + cols, mask=mask, other=-float("inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = tl.where(mask, p, 0.0)
    p = p / tl.sum(p, axis=0)  # softmax over all experts, as torch.softmax(dtype=fp32)
    cand = tl.where(mask, p, -1.0)  # padding never wins
    slots = tl.arange(0, BLOCK_K)
    top_v = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        v = tl.max(cand, axis=0)
        i = tl.argmax(cand, axis=0)  # first index of the maximum
        top_v = tl.where(slots == j, v, top_v)
        top_i = tl.where(slots == j, i, top_i)
        cand = tl.where(cols == i, -1.0, cand)
    top_v = top_v / tl.sum(top_v, axis=0)  # always renormalised (padding slots hold 0)
    kmask = slots < TOP_K
    tl.store(IDS + t * TOP_K + slots, top_i.to(tl.int64), mask=kmask)
    tl.store(WTS + t * TOP_K + slots, top_v.to(WTS.dtype.element_ty), mask=kmask)


def route(logits: torch.Tensor, top_k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (strided rows fine) -> (top_weights [T, k] in dtype, top_ids [T, k] int64), as
    `SparseMoeBlock.forward`: softmax in fp32, top-k, w / w.sum() in fp32, then .to(dtype)."""
    tokens, experts = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    wts = torch.empty((tokens, top_k), dtype=dtype, device=logits.device)
    if tokens:
        block_e = triton.next_power_of_2(experts)
        _route_kernel[(tokens,)](
            logits, ids, wts, experts, logits.stride(0), TOP_K=top_k, BLOCK_E=block_e,
            BLOCK_K=triton.next_power_of_2(top_k), num_warps=max(1, min(8, block_e // 256)),
            **pdl_launch(logits.device),
        )
    return wts, ids


# ---- experts: gate_up GEMV + SwiGLU ---------------------------------------------------------------


@triton.jit
def _gate_up_act_kernel(
    X, IDS, W1, ACT, stride_xt, stride_we, stride_wn,
    HID: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    pair = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    token = pair // TOP_K
    expert = tl.load(IDS + pair).to(tl.int64)
    nmask = rows < INTER
    w_gate = W1 + expert * stride_we + rows[:, None] * stride_wn
    w_up = w_gate + INTER * stride_wn
    x_row = X + token * stride_xt
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.static_range(0, HID, BLOCK_K):  # unrolled: every tile's loads can be in flight at once
        cols = k0 + tl.arange(0, BLOCK_K)
        kmask = cols < HID
        xv = tl.load(x_row + cols, mask=kmask, other=0.0).to(tl.float32)[None, :]
        wmask = nmask[:, None] & kmask[None, :]
        g = tl.load(w_gate + cols[None, :], mask=wmask, other=0.0)
        u = tl.load(w_up + cols[None, :], mask=wmask, other=0.0)
        acc_g += g.to(tl.float32) * xv
        acc_u += u.to(tl.float32) * xv
    dt = ACT.dtype.element_ty
    gate = tl.sum(acc_g, axis=1).to(dt).to(tl.float32)  # the grouped GEMM's output in the model dtype
    up = tl.sum(acc_u, axis=1).to(dt).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32) * up  # F.silu(gate) * up, each rounded
    tl.store(ACT + pair * INTER + rows, act.to(dt), mask=nmask)


# ---- experts: down GEMV, routing weight and the sum over the k choices ----------------------------


@triton.jit
def _down_sum_kernel(
    ACT, IDS, WTS, W2, OUT, stride_we, stride_wh, stride_ot,
    HID: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = rows < HID
    dt = OUT.dtype.element_ty
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # the choices in order: a fixed summation order
        pair = token * TOP_K + j
        expert = tl.load(IDS + pair).to(tl.int64)
        weight = tl.load(WTS + pair).to(tl.float32)
        w_rows = W2 + expert * stride_we + rows[:, None] * stride_wh
        part = tl.zeros([BLOCK_H, BLOCK_I], dtype=tl.float32)
        for i0 in tl.static_range(0, INTER, BLOCK_I):
            cols = i0 + tl.arange(0, BLOCK_I)
            imask = cols < INTER
            a = tl.load(ACT + pair * INTER + cols, mask=imask, other=0.0).to(tl.float32)
            w = tl.load(w_rows + cols[None, :], mask=hmask[:, None] & imask[None, :], other=0.0)
            part += w.to(tl.float32) * a[None, :]
        y = tl.sum(part, axis=1).to(dt).to(tl.float32)  # expert output in the model dtype
        acc += (y * weight).to(dt).to(tl.float32)  # y * top_weight, rounded like the bf16 product
    tl.store(OUT + token * stride_ot + rows, acc.to(dt), mask=hmask)


def default_config(tokens: int, top_k: int, hidden: int, intermediate: int) -> dict[str, int]:
    """Tiles from the shapes only: many one-warp programs, each with all its loads in flight at once.
    gate_up: [BLOCK_N, BLOCK_K] tiles of the gate and of the up rows, the K loop unrolled; down:
    [BLOCK_H, BLOCK_I] tiles, the I loop and the k choices unrolled. Measured on an H200 at the
    35B-A3B shapes (H 2048, I 512, k 8) for T = 1, 4, 8, 16 (selfcheck_moe.time_moe sweeps): the
    best or within 2% of the best of ~15 configs at every T; larger tiles or more warps lose 10-40%."""
    return {"block_n": 2, "block_k": min(256, triton.next_power_of_2(hidden)), "warps_up": 1,
            "block_h": 1, "block_i": min(512, triton.next_power_of_2(intermediate)), "warps_down": 1}


def fused_experts(x: torch.Tensor, top_ids: torch.Tensor, top_weights: torch.Tensor, gate_up_proj: torch.Tensor,
                  down_proj: torch.Tensor, config: dict[str, int] | None = None) -> torch.Tensor:
    """x [T, H]; top_ids [T, k] (int); top_weights [T, k]; gate_up_proj [E, 2I, H]; down_proj [E, H, I].
    -> sum_j top_weights[t, j] * down[e_j](silu(gate[e_j] x_t) * up[e_j] x_t), [T, H] in x.dtype."""
    tokens, top_k = top_ids.shape
    hidden = x.shape[-1]
    intermediate = down_proj.shape[-1]
    assert gate_up_proj.shape[-2:] == (2 * intermediate, hidden) and down_proj.shape[-2] == hidden
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    if gate_up_proj.stride(-1) != 1:
        gate_up_proj = gate_up_proj.contiguous()
    if down_proj.stride(-1) != 1:
        down_proj = down_proj.contiguous()
    ids = top_ids.contiguous()
    wts = top_weights.contiguous()
    cfg = default_config(tokens, top_k, hidden, intermediate) | (config or {})
    act = torch.empty((tokens * top_k, intermediate), dtype=x.dtype, device=x.device)
    _gate_up_act_kernel[(tokens * top_k, triton.cdiv(intermediate, cfg["block_n"]))](
        x, ids, gate_up_proj, act, x.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1),
        HID=hidden, INTER=intermediate, TOP_K=top_k, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
        num_warps=cfg["warps_up"], **pdl_launch(x.device),
    )
    _down_sum_kernel[(tokens, triton.cdiv(hidden, cfg["block_h"]))](
        act, ids, wts, down_proj, out, down_proj.stride(0), down_proj.stride(1), out.stride(0),
        HID=hidden, INTER=intermediate, TOP_K=top_k, BLOCK_H=cfg["block_h"], BLOCK_I=cfg["block_i"],
        num_warps=cfg["warps_down"], **pdl_launch(x.device),
    )
    return out
