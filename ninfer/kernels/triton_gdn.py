"""Triton kernels of ours for Gated DeltaNet's short conv and its one-token recurrent step.

- `conv1d_update`: one decode step of the causal depthwise conv + SiLU for a batch, reading each
  sequence's conv state from its slot and writing the shifted state back in place (the state of a
  sequence with nothing cached reads as zero, whatever the slot holds).
- `conv1d_varlen`: the conv + SiLU over a ragged prefill batch, with each sequence's window
  reaching back into its (gathered) initial state.
- `conv1d_steps` / `recurrent_gated_delta_rule_steps`: a speculative verify batch's positions, each sequence's state
  read once and carried through its positions in one launch (bit for bit what the one-step kernels compute position
  by position, each position's state still written to its own slot for a rollback).
- `recurrent_gated_delta_rule`: one token per sequence, state read from and written back to its
  slot in place. The math and program layout follow fla-core's `fused_recurrent_gated_delta_rule`
  (decay, delta-rule write, read after the update; value heads grouped over key heads), which we
  cannot call for this step without a gather and a scatter of every state around it (fla takes
  dense [N, ...] states; the slot indirection saves 2 of 3 passes over the 151 MB of 27B state
  per sequence per token). Measured on the H200 at the 27B shape, 8 sequences: 19.5 us against
  135 us for fla's kernel with the gather and scatter around it.
- Both recurrent kernels can take the gate projections a, b raw (`raw_gates`) and compute beta and g
  in their programs with the gates kernel's arithmetic (triton_fused.gdn_gate_values), even as the
  skinny GEMM's unreduced split-K partial sums (triton_gemv.gemv_split_sums, summed here as its
  reduction sums them): a decode or verify forward of the 27B NVFP4 then launches 96 kernels fewer.

All take device tensors only and read no lengths on the host: CUDA-graph capturable. The torch
references in `ninfer.kernels.gdn` are the oracle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.fused import SOFTPLUS_THRESHOLD
from ninfer.kernels.pdl import pdl_enter, pdl_launch
from ninfer.kernels.triton_compat import fix_interpreter
from ninfer.kernels.triton_fused import gdn_gate_values

fix_interpreter()  # TRITON_INTERPRET=1 only: see triton_compat
_SOFTPLUS: tl.constexpr = tl.constexpr(SOFTPLUS_THRESHOLD)


@triton.jit
def _conv_window(state, x, w, offs_w, WIDTH: tl.constexpr):
    """One causal-conv position: the window [state_0 .. state_{W-1}, x] (in the state's dtype, as the reference
    concatenates it) and the SiLU of its dot with the taps, fp32."""
    window = tl.where(offs_w[None, :] == WIDTH, x[:, None].to(state.dtype), state)
    acc = tl.sum(window.to(tl.float32) * w.to(tl.float32), 1)
    return window, acc * tl.sigmoid(acc)


@triton.jit
def _window_col(window, offs_w, i: tl.constexpr):
    """Column i of the window (the next state's column i - 1)."""
    return tl.sum(tl.where(offs_w[None, :] == i, window, tl.zeros_like(window)), 1)


@triton.jit
def _gate_input(P, row, hv, stride_row, stride_split, SPLIT: tl.constexpr, V):
    """A raw gate projection's value at (row, head hv) in fp32: loaded (SPLIT 0), or its SPLIT fp32 partial sums
    added in order from 0.0 and rounded to V's dtype, as triton_gemv's split-K reduction computes the output."""
    if SPLIT == 0:
        out = tl.load(P + row * stride_row + hv).to(tl.float32)
    else:
        acc = 0.0  # the reduction's start
        for s in tl.static_range(SPLIT):
            acc += tl.load(P + s * stride_split + row * stride_row + hv)
        out = acc.to(V.dtype.element_ty).to(tl.float32)
    return out


@triton.jit
def _step_loads(Q, K, V, G, BETA, row, hk, hv, offs_k, offs_v, kmask, vmask, stride_qn, stride_qh, stride_kn,
                stride_kh, stride_vn, stride_vh, stride_gn, stride_bn, stride_gs, RAW_GATES: tl.constexpr,
                SPLIT: tl.constexpr):
    """One position's inputs of value head hv, loads only (no reduction, so a kernel can issue every position's
    before its first barrier): q, k, v in fp32 and the gate inputs (b, a) or (beta, g). RAW_GATES: G and BETA hold
    the projections a and b (in v's dtype; SPLIT > 0: as SPLIT fp32 partial sums, stride_gs apart, summed here)."""
    q = tl.load(Q + row * stride_qn + hk * stride_qh + offs_k, mask=kmask, other=0.0).to(tl.float32)
    k = tl.load(K + row * stride_kn + hk * stride_kh + offs_k, mask=kmask, other=0.0).to(tl.float32)
    v = tl.load(V + row * stride_vn + hv * stride_vh + offs_v, mask=vmask, other=0.0).to(tl.float32)
    if RAW_GATES:
        gb = _gate_input(BETA, row, hv, stride_bn, stride_gs, SPLIT, V)
        ga = _gate_input(G, row, hv, stride_gn, stride_gs, SPLIT, V)
    else:
        gb = tl.load(BETA + row * stride_bn + hv).to(tl.float32)
        ga = tl.load(G + row * stride_gn + hv).to(tl.float32)
    return q, k, v, gb, ga


@triton.jit
def _delta_rule_update(h, q, k, v, gb, ga, a_log, dt_bias, scale, V, L2NORM: tl.constexpr, RAW_GATES: tl.constexpr):
    """One gated delta rule position (fp32 state h [BK, BV], _step_loads' inputs): the updated state and the output.
    RAW_GATES: (gb, ga) are the projections b and a, and beta and g are computed here as the gates kernel computes
    them (beta rounded to v's dtype as that kernel stores it; a_log, dt_bias: the head's), one launch a layer fewer
    (two with the partial sums); else they are beta and g."""
    if RAW_GATES:
        beta, g = gdn_gate_values(gb, ga, a_log, dt_bias, _SOFTPLUS)
        beta = beta.to(V.dtype.element_ty).to(tl.float32)
    else:
        beta, g = gb, ga
    if L2NORM:  # eps inside the sqrt, as fla and transformers do
        q = q / tl.sqrt(tl.sum(q * q) + 1e-6)
        k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
    q = q * scale
    h = h * tl.exp(g)  # decay before the delta read
    v_new = (v - tl.sum(h * k[:, None], 0)) * beta
    h = h + k[:, None] * v_new[None, :]
    return h, tl.sum(h * q[:, None], 0)  # the output reads the state after the update


@triton.jit
def _head_gate_params(A_LOG, DT_BIAS, hv, RAW_GATES: tl.constexpr):
    """The head's A_log and dt_bias in fp32 where the kernel computes the gates (RAW_GATES), else zeros (unused)."""
    if RAW_GATES:
        a_log = tl.load(A_LOG + hv).to(tl.float32)
        dt_bias = tl.load(DT_BIAS + hv).to(tl.float32)
    else:
        a_log = 0.0
        dt_bias = 0.0
    return a_log, dt_bias


@triton.jit
def _conv_update_kernel(
    X, W, S_IN, S_OUT, Y, SLOT_IN, SLOT_OUT, HAS_INIT,
    C,
    stride_xn, stride_yn, stride_wc,
    stride_sin_s, stride_sin_c, stride_sout_s, stride_sout_c,
    WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr, USE_INIT_MASK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    offs_w = tl.arange(0, BLOCK_W)
    slot_in = tl.load(SLOT_IN + n).to(tl.int64)
    slot_out = tl.load(SLOT_OUT + n).to(tl.int64)
    x = tl.load(X + n * stride_xn + c, mask=cmask, other=0.0)
    state = tl.load(S_IN + slot_in * stride_sin_s + c[:, None] * stride_sin_c + offs_w[None, :],
                    mask=cmask[:, None] & (offs_w[None, :] < WIDTH), other=0.0)
    if USE_INIT_MASK:
        keep = tl.load(HAS_INIT + n) != 0
        state = tl.where(keep, state, tl.zeros_like(state))
    w = tl.load(W + c[:, None] * stride_wc + offs_w[None, :], mask=cmask[:, None] & (offs_w[None, :] <= WIDTH),
                other=0.0)
    window, y = _conv_window(state, x, w, offs_w, WIDTH)
    tl.store(Y + n * stride_yn + c, y.to(Y.dtype.element_ty), mask=cmask)
    tl.debug_barrier()  # every read of the old state happens before any write of the new one
    for j in tl.static_range(WIDTH):
        col = _window_col(window, offs_w, j + 1)
        tl.store(S_OUT + slot_out * stride_sout_s + c * stride_sout_c + j, col.to(S_OUT.dtype.element_ty),
                 mask=cmask)


@triton.jit
def _conv_varlen_kernel(
    X, W, INIT, Y, SEQ_IDX, POS,
    T, C,
    stride_xt, stride_yt, stride_wc, stride_in, stride_ic,
    WIDTH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    tmask = t < T
    cmask = c < C
    seq = tl.load(SEQ_IDX + t, mask=tmask, other=0).to(tl.int64)
    pos = tl.load(POS + t, mask=tmask, other=0)
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for d in tl.static_range(WIDTH + 1):  # tap d reads the input d steps back
        w = tl.load(W + c * stride_wc + (WIDTH - d), mask=cmask, other=0.0).to(tl.float32)
        in_x = tmask & (pos >= d)
        xv = tl.load(X + (t - d).to(tl.int64)[:, None] * stride_xt + c[None, :],
                     mask=in_x[:, None] & cmask[None, :], other=0.0)
        in_state = tmask & (pos < d)
        col = WIDTH - d + pos
        sv = tl.load(INIT + seq[:, None] * stride_in + c[None, :] * stride_ic + col[:, None],
                     mask=in_state[:, None] & cmask[None, :], other=0.0)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w[None, :]
    y = acc * tl.sigmoid(acc)
    tl.store(Y + t.to(tl.int64)[:, None] * stride_yt + c[None, :], y.to(Y.dtype.element_ty),
             mask=tmask[:, None] & cmask[None, :])


@triton.jit
def _recurrent_kernel(
    Q, K, V, G, BETA, A_LOG, DT_BIAS, OP, H_IN, H_OUT, SLOT_IN, SLOT_OUT, HAS_INIT,
    scale,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_gn, stride_bn, stride_gs, stride_on, stride_oh,
    stride_hin_s, stride_hout_s,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, USE_INIT_MASK: tl.constexpr,
    RAW_GATES: tl.constexpr = False, SPLIT: tl.constexpr = 0, USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    pid = tl.program_id(0).to(tl.int64)
    i_v = tl.program_id(1)
    n = pid // HV
    hv = pid % HV
    hk = hv // (HV // HK)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    kmask = offs_k < DK
    vmask = offs_v < DV
    slot_in = tl.load(SLOT_IN + n).to(tl.int64)
    slot_out = tl.load(SLOT_OUT + n).to(tl.int64)
    hmask = kmask[:, None] & vmask[None, :]
    offs_h = hv * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    h = tl.load(H_IN + slot_in * stride_hin_s + offs_h, mask=hmask, other=0.0).to(tl.float32)
    if USE_INIT_MASK:
        keep = tl.load(HAS_INIT + n) != 0
        h = tl.where(keep, h, tl.zeros_like(h))  # a fresh sequence's slot may hold anything, even NaN
    # every load before the first reduction: loads after one wait for its barrier, one memory round trip more
    q, k, v, gb, ga = _step_loads(Q, K, V, G, BETA, n, hk, hv, offs_k, offs_v, kmask, vmask, stride_qn, stride_qh,
                                  stride_kn, stride_kh, stride_vn, stride_vh, stride_gn, stride_bn, stride_gs,
                                  RAW_GATES, SPLIT)
    a_log, dt_bias = _head_gate_params(A_LOG, DT_BIAS, hv, RAW_GATES)
    h, o = _delta_rule_update(h, q, k, v, gb, ga, a_log, dt_bias, scale, V, L2NORM, RAW_GATES)
    tl.store(OP + n * stride_on + hv * stride_oh + offs_v, o.to(OP.dtype.element_ty), mask=vmask)
    tl.debug_barrier()  # in place: every read of the old state before any write
    tl.store(H_OUT + slot_out * stride_hout_s + offs_h, h.to(H_OUT.dtype.element_ty), mask=hmask)


@triton.jit
def _conv_steps_kernel(
    X, W, S, Y, SLOT_IN, SLOT_OUT,
    C, B,
    stride_xn, stride_yn, stride_wc, stride_s_s, stride_s_c,
    STEPS: tl.constexpr, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """_conv_update_kernel for STEPS positions of each sequence in one launch (a verify batch: rows n * STEPS + j):
    the state is read once and carried in registers, rounded to the cache's dtype after each position as a store and
    a reload would round it, and written to SLOT_OUT[j, n] after position j."""
    pdl_enter(USE_PDL)
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    offs_w = tl.arange(0, BLOCK_W)
    slot_in = tl.load(SLOT_IN + n).to(tl.int64)
    state = tl.load(S + slot_in * stride_s_s + c[:, None] * stride_s_c + offs_w[None, :],
                    mask=cmask[:, None] & (offs_w[None, :] < WIDTH), other=0.0)
    w = tl.load(W + c[:, None] * stride_wc + offs_w[None, :], mask=cmask[:, None] & (offs_w[None, :] <= WIDTH),
                other=0.0)
    xs = ()  # every position's input and slot first (a load after a store waits for it)
    slots = ()
    for j in tl.static_range(STEPS):
        xs = xs + (tl.load(X + (n * STEPS + j) * stride_xn + c, mask=cmask, other=0.0),)
        slots = slots + (tl.load(SLOT_OUT + j * B + n).to(tl.int64),)
    tl.debug_barrier()  # in place: the state is read before any position writes a slot
    for j in tl.static_range(STEPS):
        row = n * STEPS + j
        window, y = _conv_window(state, xs[j], w, offs_w, WIDTH)
        tl.store(Y + row * stride_yn + c, y.to(Y.dtype.element_ty), mask=cmask)
        slot_out = slots[j]
        shifted = tl.zeros_like(state)
        for i in tl.static_range(WIDTH):
            col = _window_col(window, offs_w, i + 1).to(S.dtype.element_ty)
            tl.store(S + slot_out * stride_s_s + c * stride_s_c + i, col, mask=cmask)
            shifted = tl.where(offs_w[None, :] == i, col[:, None].to(state.dtype), shifted)
        state = shifted


@triton.jit
def _recurrent_steps_kernel(
    Q, K, V, G, BETA, A_LOG, DT_BIAS, OP, H, SLOT_IN, SLOT_OUT,
    scale, B,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_gn, stride_bn, stride_gs, stride_on, stride_oh, stride_h_s,
    STEPS: tl.constexpr, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, RAW_GATES: tl.constexpr = False,
    SPLIT: tl.constexpr = 0, USE_PDL: tl.constexpr = False,
):
    """_recurrent_kernel for STEPS positions of each sequence in one launch (rows n * STEPS + j): the state is read
    once, kept in registers (rounded to the cache's dtype after each position, as a store and a reload would) and
    written to SLOT_OUT[j, n] after position j, so each position's state is there for a rollback."""
    pdl_enter(USE_PDL)
    pid = tl.program_id(0).to(tl.int64)
    i_v = tl.program_id(1)
    n = pid // HV
    hv = pid % HV
    hk = hv // (HV // HK)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    kmask = offs_k < DK
    vmask = offs_v < DV
    hmask = kmask[:, None] & vmask[None, :]
    offs_h = hv * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    slot_in = tl.load(SLOT_IN + n).to(tl.int64)
    h = tl.load(H + slot_in * stride_h_s + offs_h, mask=hmask, other=0.0).to(tl.float32)
    # every position's inputs and slot first: a load after a position's reductions or stores would wait for them,
    # a memory round trip a position
    ins = ()
    slots = ()
    for j in tl.static_range(STEPS):
        ins = ins + _step_loads(Q, K, V, G, BETA, n * STEPS + j, hk, hv, offs_k, offs_v, kmask, vmask, stride_qn,
                                stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_gn, stride_bn, stride_gs,
                                RAW_GATES, SPLIT)
        slots = slots + (tl.load(SLOT_OUT + j * B + n).to(tl.int64),)
    a_log, dt_bias = _head_gate_params(A_LOG, DT_BIAS, hv, RAW_GATES)
    tl.debug_barrier()  # in place: the state is read before any position writes a slot
    for j in tl.static_range(STEPS):
        row = n * STEPS + j
        h, o = _delta_rule_update(h, ins[5 * j], ins[5 * j + 1], ins[5 * j + 2], ins[5 * j + 3], ins[5 * j + 4],
                                  a_log, dt_bias, scale, V, L2NORM, RAW_GATES)
        tl.store(OP + row * stride_on + hv * stride_oh + offs_v, o.to(OP.dtype.element_ty), mask=vmask)
        slot_out = slots[j]
        kept = h.to(H.dtype.element_ty)
        tl.store(H + slot_out * stride_h_s + offs_h, kept, mask=hmask)
        h = kept.to(tl.float32)


def _gate_layout(g: torch.Tensor, beta: torch.Tensor, v: torch.Tensor, raw_gates) -> tuple[tuple[int, int, int], int]:
    """The recurrent kernels' gate strides (row of g, row of beta, split) and split count (0: plain [N, Hv] rows)."""
    if g.dim() == 3:  # raw projections as split-K partial sums [S, N, Hv], views of one tensor
        assert raw_gates is not None and g.dtype == beta.dtype == torch.float32
        assert g.shape[0] == beta.shape[0] and g.stride()[::2] == beta.stride()[::2] and g.stride(2) == 1
        return (g.stride(1), beta.stride(1), g.stride(0)), g.shape[0]
    assert g.stride(1) == 1 and beta.stride(1) == 1
    assert raw_gates is None or g.dtype == beta.dtype == v.dtype  # (the kernel rounds beta to v's dtype)
    return (g.stride(0), beta.stride(0), 0), 0


def _slots(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64, device=device)


def conv1d_update(
    x: torch.Tensor, weight: torch.Tensor, state_in: torch.Tensor, state_out: torch.Tensor | None = None,
    slot_in: torch.Tensor | None = None, slot_out: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [N, C]; weight: [C, K]; state_in/state_out: [S, C, K-1] read at slot_in[n], written at
    slot_out[n] (default: rows 0..N-1; state_out defaults to state_in, in place).
    has_initial_state [N] bool: False reads the state as zero. -> y [N, C] (into `out` when given:
    rows may be strided, as a verify batch's positions are)."""
    num, channels = x.shape
    width = state_in.shape[-1]
    weight = weight.reshape(channels, -1)
    assert weight.shape[1] == width + 1 and x.stride(1) == 1 and weight.stride(1) == 1
    assert state_in.stride(2) == 1
    state_out = state_in if state_out is None else state_out
    assert state_out.stride(2) == 1
    slot_in = _slots(num, x.device) if slot_in is None else slot_in
    slot_out = slot_in if slot_out is None else slot_out
    y = torch.empty_like(x) if out is None else out
    assert y.stride(1) == 1
    if num == 0:
        return y
    block_c = 256
    _conv_update_kernel[(num, triton.cdiv(channels, block_c))](
        x, weight, state_in, state_out, y, slot_in, slot_out,
        has_initial_state if has_initial_state is not None else slot_in,
        channels, x.stride(0), y.stride(0), weight.stride(0),
        state_in.stride(0), state_in.stride(1), state_out.stride(0), state_out.stride(1),
        WIDTH=width, BLOCK_W=max(2, triton.next_power_of_2(width + 1)), BLOCK_C=block_c,
        USE_INIT_MASK=has_initial_state is not None, num_warps=4, **pdl_launch(x.device),
    )
    return y


def conv1d_varlen(
    x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor, seq_idx: torch.Tensor,
    pos_in_seq: torch.Tensor,
) -> torch.Tensor:
    """x: [T, C] ragged tokens; weight [C, K]; initial_state [N, C, K-1] (zeros for fresh sequences);
    seq_idx, pos_in_seq: [T]. -> y [T, C] (conv + SiLU)."""
    tokens, channels = x.shape
    width = initial_state.shape[-1]
    weight = weight.reshape(channels, -1)
    assert x.stride(1) == 1 and weight.stride(1) == 1 and initial_state.stride(2) == 1
    y = torch.empty_like(x)
    if tokens == 0:
        return y
    block_t, block_c = 32, 128
    _conv_varlen_kernel[(triton.cdiv(tokens, block_t), triton.cdiv(channels, block_c))](
        x, weight, initial_state, y, seq_idx, pos_in_seq, tokens, channels,
        x.stride(0), y.stride(0), weight.stride(0), initial_state.stride(0), initial_state.stride(1),
        WIDTH=width, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=4, **pdl_launch(x.device),
    )
    return y


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_in: torch.Tensor, state_out: torch.Tensor | None = None, slot_in: torch.Tensor | None = None,
    slot_out: torch.Tensor | None = None, has_initial_state: torch.Tensor | None = None,
    scale: float | None = None, use_qk_l2norm: bool = True, block_v: int = 32, num_warps: int = 4,
    out: torch.Tensor | None = None, raw_gates: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One token per sequence. q, k: [N, Hk, Dk]; v: [N, Hv, Dv]; g (log decay), beta: [N, Hv];
    state_in/state_out: [S, Hv, Dk, Dv] fp32 read at slot_in[n], written at slot_out[n] (defaults:
    rows 0..N-1, in place). raw_gates: the layer's (A_log, dt_bias) [Hv]; g and beta are then the
    projections a and b in v's dtype, [N, Hv], or as the skinny GEMM's fp32 partial sums [S, N, Hv]
    (views of one gemv_split_sums result), and the kernel computes fused.gdn_gates' values itself
    (bit for bit triton_fused.gdn_gates' on the reduced projections). -> o [N, Hv, Dv] in v's dtype
    (into `out` when given)."""
    num, hk, dk = k.shape
    hv, dv = v.shape[1], v.shape[2]
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    gate_strides, split = _gate_layout(g, beta, v, raw_gates)
    state_out = state_in if state_out is None else state_out
    for s in (state_in, state_out):
        assert s.shape[1:] == (hv, dk, dv) and s[0].is_contiguous()
    slot_in = _slots(num, q.device) if slot_in is None else slot_in
    slot_out = slot_in if slot_out is None else slot_out
    o = torch.empty((num, hv, dv), dtype=v.dtype, device=v.device) if out is None else out  # out: may be strided
    assert o.stride(2) == 1
    if num == 0:
        return o
    bv = min(block_v, triton.next_power_of_2(dv))
    a_log, dt_bias = raw_gates or (g, g)  # (unread without RAW_GATES)
    _recurrent_kernel[(num * hv, triton.cdiv(dv, bv))](
        q, k, v, g, beta, a_log, dt_bias, o, state_in, state_out, slot_in, slot_out,
        has_initial_state if has_initial_state is not None else slot_in,
        scale if scale is not None else dk**-0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *gate_strides, o.stride(0), o.stride(1), state_in.stride(0), state_out.stride(0),
        HK=hk, HV=hv, DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=bv, L2NORM=use_qk_l2norm,
        USE_INIT_MASK=has_initial_state is not None, RAW_GATES=raw_gates is not None, SPLIT=split, num_warps=num_warps,
        **pdl_launch(q.device),
    )
    return o


def conv1d_steps(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, slot_in: torch.Tensor,
                 slot_out: torch.Tensor) -> torch.Tensor:
    """A verify batch's conv: x [B * steps, C] (sequence n's positions at rows n * steps + j), each sequence's
    state read at slot_in[n] and its state after position j written at slot_out[j, n] ([steps, B] int64).
    Computes what `conv1d_update` computes position by position (bit for bit), in one launch. -> y [B * steps, C]."""
    steps, b = slot_out.shape
    channels, width = x.shape[1], state.shape[-1]
    weight = weight.reshape(channels, -1)
    assert x.shape[0] == b * steps and weight.shape[1] == width + 1 and slot_out.is_contiguous()
    assert x.stride(1) == 1 and weight.stride(1) == 1 and state.stride(2) == 1
    y = torch.empty_like(x)
    if b == 0:
        return y
    block_c = 256
    _conv_steps_kernel[(b, triton.cdiv(channels, block_c))](
        x, weight, state, y, slot_in, slot_out, channels, b,
        x.stride(0), y.stride(0), weight.stride(0), state.stride(0), state.stride(1),
        STEPS=steps, WIDTH=width, BLOCK_W=max(2, triton.next_power_of_2(width + 1)), BLOCK_C=block_c,
        num_warps=4, **pdl_launch(x.device),
    )
    return y


def recurrent_gated_delta_rule_steps(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    slot_in: torch.Tensor, slot_out: torch.Tensor, scale: float | None = None, use_qk_l2norm: bool = True,
    block_v: int = 32, num_warps: int = 4, raw_gates: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """A verify batch's recurrent steps: q, k [B * steps, Hk, Dk], v [B * steps, Hv, Dv], g, beta [B * steps, Hv]
    (sequence n's positions at rows n * steps + j); the state [S, Hv, Dk, Dv] read at slot_in[n], the state after
    position j written at slot_out[j, n] ([steps, B] int64). Computes what `recurrent_gated_delta_rule` computes
    position by position (bit for bit: the same program layout and arithmetic), in one launch and one read of each
    state instead of one per position. raw_gates: as recurrent_gated_delta_rule's. -> o [B * steps, Hv, Dv] in v's
    dtype."""
    steps, b = slot_out.shape
    _, hk, dk = k.shape
    hv, dv = v.shape[1], v.shape[2]
    assert q.shape[0] == b * steps and slot_out.is_contiguous()
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    gate_strides, split = _gate_layout(g, beta, v, raw_gates)
    assert state.shape[1:] == (hv, dk, dv) and state[0].is_contiguous()
    o = torch.empty((q.shape[0], hv, dv), dtype=v.dtype, device=v.device)
    if b == 0:
        return o
    bv = min(block_v, triton.next_power_of_2(dv))
    a_log, dt_bias = raw_gates or (g, g)
    _recurrent_steps_kernel[(b * hv, triton.cdiv(dv, bv))](
        q, k, v, g, beta, a_log, dt_bias, o, state, slot_in, slot_out,
        scale if scale is not None else dk**-0.5, b,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *gate_strides, o.stride(0), o.stride(1), state.stride(0),
        STEPS=steps, HK=hk, HV=hv, DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=bv, L2NORM=use_qk_l2norm,
        RAW_GATES=raw_gates is not None, SPLIT=split, num_warps=num_warps, **pdl_launch(q.device),
    )
    return o
