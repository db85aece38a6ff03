"""Triton kernels of ours for the small fused ops of a decode step (dispatch and references: `fused`).

One kernel each, replacing a chain of 5-15 torch ops (and their dtype round trips):
- `rms_norm` / `add_rms_norm`: the residual add and the RMSNorm after it (Qwen's zero-centred form
  and Llama's), one program per row;
- `gated_rms_norm`: GDN's output norm, rmsnorm(o) * w * silu(z), one program per (token, value head);
- `gdn_gates`: beta = sigmoid(b) and g = -exp(A_log) * softplus(a + dt_bias) for one token's heads;
- `rope_qk_write_kv`: per-head q/k RMSNorm, partial rotate-half RoPE and the K/V cache write, one
  program per (token, q head or kv head);
- `sigmoid_gate_mul`: attention output * sigmoid(output gate);
- `silu_and_mul`: SwiGLU's silu(gate) * up;
- `shared_expert_add`: a MoE block's output, routed + sigmoid(shared gate) * shared expert (three
  torch launches before).

Math in fp32; every value the torch reference rounds to the model dtype is rounded here too
(`.to(dtype).to(fp32)`, or `_round_to` where the compiler could fold the rounding into an FMA), so
bf16 results match the references up to fp32 reassociation: the order of a norm's sum of squares,
silu as x * sigmoid(x), Triton's exp/log in the gates (g within ~2e-7 relative), fp32 FMA
contraction. On an H200 the norms, gates' beta, gate and SwiGLU products came out bit-identical to
the references in bf16 (`selfcheck_fused`). Inputs
may be strided views (last dim contiguous). No host reads, shapes-only launch configs: CUDA-graph
capturable. Kernels run on CPU tensors under TRITON_INTERPRET=1 (tests/test_fused.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.pdl import pdl_enter, pdl_launch
from ninfer.kernels.triton_compat import fix_interpreter

fix_interpreter()  # TRITON_INTERPRET=1 only: bf16 rounds to nearest even as on the GPU (see triton_compat)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., N] -> [rows, N] without a copy when possible (last dim contiguous)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm_warps(block: int) -> int:
    return max(1, min(16, block // 512))


# ---- RMSNorm (+ residual add) ---------------------------------------------------------------------


@triton.jit
def _fused_rmsnorm_kernel(
    X, H, W, RES, Y, N, stride_x, stride_h, stride_r, stride_y, eps,
    HAS_ADD: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    # the weight loaded with x, not after the reduction (the compiler does not move a load above a store to memory it
    # cannot prove apart): its latency overlaps x's, one memory round trip fewer in a kernel that is mostly latency
    # at decode batch sizes (one program a row; the same arithmetic)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_ADD:
        h = tl.load(H + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + h).to(RES.dtype.element_ty)  # the residual stream in the model dtype, as `x + h`
        tl.store(RES + row * stride_r + cols, s, mask=mask)
        x = s.to(tl.float32)
        xdt = RES.dtype.element_ty
    else:
        xdt = X.dtype.element_ty
    var = tl.sum(x * x, axis=0) / N
    xhat = x * tl.rsqrt(var + eps)
    if ZERO_CENTERED:
        y = xhat * (1.0 + w)
    else:
        y = w * xhat.to(xdt).to(tl.float32)  # x_hat back to the input dtype first, then * w
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


def _rmsnorm_launch(x, h, weight, eps, zero_centered):
    shape = x.shape
    n = shape[-1]
    x2 = _rows(x)
    rows = x2.shape[0]
    out_dtype = x.dtype if zero_centered else torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty((rows, n), dtype=out_dtype, device=x.device)
    if h is not None:
        h2 = _rows(h)
        res = torch.empty((rows, n), dtype=torch.promote_types(x.dtype, h.dtype), device=x.device)
    else:
        h2 = res = x2  # unused
    if rows:
        block = triton.next_power_of_2(n)
        _fused_rmsnorm_kernel[(rows,)](
            x2, h2, weight, res, y, n, x2.stride(0), h2.stride(0), res.stride(0), y.stride(0), eps,
            HAS_ADD=h is not None, ZERO_CENTERED=zero_centered, BLOCK=block, num_warps=_norm_warps(block),
            **pdl_launch(x.device),
        )
    return y.view(shape), (res.view(shape) if h is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    return _rmsnorm_launch(x, None, weight, eps, zero_centered)[0]


def add_rms_norm(residual: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _rmsnorm_launch(residual, h, weight, eps, zero_centered)


# ---- GDN gated output norm ------------------------------------------------------------------------


@triton.jit
def _fused_gated_rmsnorm_kernel(
    X, Z, W, Y, HEADS, stride_xt, stride_xh, stride_zt, stride_zh, stride_yt, stride_yh, eps,
    D: tl.constexpr, BLOCK_D: tl.constexpr, ROUND_WX: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    pid = tl.program_id(0).to(tl.int64)
    t = pid // HEADS
    hd = pid % HEADS
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    x = tl.load(X + t * stride_xt + hd * stride_xh + d, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + d, mask=mask, other=0.0).to(tl.float32)  # (all loads first: see _fused_rmsnorm_kernel)
    z = tl.load(Z + t * stride_zt + hd * stride_zh + d, mask=mask, other=0.0).to(tl.float32)
    xhat = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    n = xhat.to(X.dtype.element_ty).to(tl.float32)  # normalised x back to the input dtype
    p = w * n
    if ROUND_WX:  # w * x_hat in the model dtype
        p = p.to(X.dtype.element_ty).to(tl.float32)
    y = p * (z * tl.sigmoid(z))
    tl.store(Y + t * stride_yt + hd * stride_yh + d, y.to(Y.dtype.element_ty), mask=mask)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, z: [..., H, D] (or [..., D]); strided views fine. -> [..., H, D] contiguous in x's dtype."""
    shape = x.shape
    d = shape[-1]
    x3 = x.reshape(-1, shape[-2] if x.dim() > 1 else 1, d)
    z3 = z.reshape(x3.shape)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    if z3.stride(-1) != 1:
        z3 = z3.contiguous()
    tokens, heads = x3.shape[0], x3.shape[1]
    y = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    if tokens * heads:
        block = triton.next_power_of_2(d)
        round_wx = torch.promote_types(weight.dtype, x.dtype) == x.dtype
        _fused_gated_rmsnorm_kernel[(tokens * heads,)](
            x3, z3, weight, y, heads, x3.stride(0), x3.stride(1), z3.stride(0), z3.stride(1), y.stride(0),
            y.stride(1), eps, D=d, BLOCK_D=block, ROUND_WX=round_wx, num_warps=max(1, min(8, block // 256)),
            **pdl_launch(x.device),
        )
    return y.view(shape)


# ---- GDN gates ------------------------------------------------------------------------------------


@triton.jit
def gdn_gate_values(b, a, a_log, dt_bias, THRESHOLD: tl.constexpr):
    """GDN's gates from fp32 b, a, A_log, dt_bias (any shape): beta = sigmoid(b) (unrounded) and the log decay
    g = -exp(A_log) * softplus(a + dt_bias). Shared by the gates kernel and the recurrent kernels that take the raw
    projections (ninfer.kernels.triton_gdn), so both compute the same bits."""
    x = a + dt_bias
    # softplus = log1p(exp(x)); log1p(u) = log(1 + u) * u / ((1 + u) - 1) keeps tiny u exact
    u = tl.exp(tl.minimum(x, THRESHOLD))
    w = 1.0 + u
    exact = w == 1.0
    log1p = tl.where(exact, u, tl.log(w) * (u / tl.where(exact, 1.0, w - 1.0)))
    softplus = tl.where(x > THRESHOLD, x, log1p)
    return tl.sigmoid(b), -tl.exp(a_log) * softplus


@triton.jit
def _fused_gdn_gates_kernel(
    B, A, ALOG, DTB, BETA, G, HV, stride_bt, stride_at, stride_betat, stride_gt,
    THRESHOLD: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    mask = h < HV
    b = tl.load(B + t * stride_bt + h, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A + t * stride_at + h, mask=mask, other=0.0).to(tl.float32)
    beta, g = gdn_gate_values(b, a, tl.load(ALOG + h, mask=mask, other=0.0).to(tl.float32),
                              tl.load(DTB + h, mask=mask, other=0.0).to(tl.float32), THRESHOLD)
    tl.store(BETA + t * stride_betat + h, beta.to(BETA.dtype.element_ty), mask=mask)
    tl.store(G + t * stride_gt + h, g, mask=mask)


def gdn_gates(b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """b, a: [T, Hv] (strided rows fine). -> beta [T, Hv] in b's dtype, g [T, Hv] fp32."""
    from ninfer.kernels.fused import SOFTPLUS_THRESHOLD

    tokens, hv = b.shape
    b2, a2 = _rows(b), _rows(a)
    beta = torch.empty((tokens, hv), dtype=b.dtype, device=b.device)
    g = torch.empty((tokens, hv), dtype=torch.float32, device=b.device)
    if tokens:
        _fused_gdn_gates_kernel[(tokens,)](
            b2, a2, a_log, dt_bias, beta, g, hv, b2.stride(0), a2.stride(0), beta.stride(0), g.stride(0),
            THRESHOLD=SOFTPLUS_THRESHOLD, BLOCK_H=max(16, triton.next_power_of_2(hv)), num_warps=1,
            **pdl_launch(b.device),
        )
    return beta, g


# ---- attention q/k: norm + RoPE + KV write --------------------------------------------------------


@triton.jit
def _round_to(v, DT: tl.constexpr):
    """v (fp32) rounded to DT, as fp32. For bf16 by integer ops: the compiler cannot see through
    them, whereas `v.to(bf16).to(fp32)` of a product of two bf16 values may be folded into an FMA
    with the following add (measured on an H200: 1-ulp differences in a quarter of the rotated
    channels without this)."""
    if DT == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)  # round to nearest even on the top 16 bits
        return (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        return v.to(DT).to(tl.float32)


@triton.jit
def _fused_rope_qk_kernel(
    Q, K, V, QW, KW, COS, SIN, Q_OUT, K_CACHE, V_CACHE, SLOTS, K_OUT,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
    stride_ot, stride_oh, stride_kcs, stride_kch, stride_vcs, stride_vch, stride_kot, stride_koh, eps,
    HQ: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr,
    WRITE_CACHE: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    half = R // 2
    rot = d < R
    # rotate_half partner of channel d (itself past the rotary channels)
    partner = tl.where(d < half, d + half, tl.where(rot, d - half, d))
    dt = Q_OUT.dtype.element_ty  # the model dtype: every rounding point of the reference
    is_q = head < HQ
    if is_q:
        src = Q + t * stride_qt + head * stride_qh
        w_ptr = QW
    else:
        src = K + t * stride_kt + (head - HQ) * stride_kh
        w_ptr = KW
    x = tl.load(src + d, mask=dmask, other=0.0).to(tl.float32)
    xp = tl.load(src + partner, mask=dmask & rot, other=0.0).to(tl.float32)
    c = tl.load(COS + t * stride_ct + d, mask=rot, other=1.0).to(tl.float32)  # (loads first: _fused_rmsnorm_kernel)
    s = tl.load(SIN + t * stride_st + d, mask=rot, other=0.0).to(tl.float32)
    if HAS_NORM:  # zero-centred RMSNorm over the head, rounded to the model dtype (q_norm / k_norm output)
        w = tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=dmask & rot, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        x = ((x * r) * (1.0 + w)).to(dt).to(tl.float32)
        xp = ((xp * r) * (1.0 + wp)).to(dt).to(tl.float32)
    xp = tl.where(d < half, -xp, xp)
    # x * cos + rotate_half(x) * sin, each product and the sum rounded as the reference does
    y = _round_to(x * c, dt) + _round_to(xp * s, dt)
    y = tl.where(rot, y, x).to(dt)
    if is_q:
        tl.store(Q_OUT + t * stride_ot + head * stride_oh + d, y, mask=dmask)
    elif not WRITE_CACHE:  # a quantized cache: k goes out, write_kv quantizes
        tl.store(K_OUT + t * stride_kot + (head - HQ) * stride_koh + d, y, mask=dmask)
    else:
        kv_head = head - HQ
        slot = tl.load(SLOTS + t).to(tl.int64)
        keep = dmask & (slot >= 0)  # slot -1: a padding token, nothing written
        v = tl.load(V + t * stride_vt + kv_head * stride_vh + d, mask=keep, other=0.0)  # (before the K store)
        tl.store(K_CACHE + slot * stride_kcs + kv_head * stride_kch + d, y.to(K_CACHE.dtype.element_ty), mask=keep)
        tl.store(V_CACHE + slot * stride_vcs + kv_head * stride_vch + d, v.to(V_CACHE.dtype.element_ty),
                 mask=keep)


def _plain_cache(cache: torch.Tensor) -> bool:
    """A cache the kernel stores into directly: 16/32-bit floats (fp8/int8 go through write_kv)."""
    return cache.is_floating_point() and cache.element_size() >= 2


def rope_qk_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_weight=None, k_weight=None, eps=1e-6,
                     k_scale=None, v_scale=None):
    tokens, hq, d = q.shape
    hkv = k.shape[1]
    rdim = cos.shape[-1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1, "last dim must be contiguous"
    assert cos.stride(-1) == 1 and sin.stride(-1) == 1 and rdim <= d and rdim % 2 == 0
    assert (q_weight is None) == (k_weight is None)
    q_out = torch.empty((tokens, hq, d), dtype=q.dtype, device=q.device)
    if tokens == 0:
        return q_out
    direct = k_scale is None and _plain_cache(k_cache) and _plain_cache(v_cache)
    if direct:
        assert k_cache.stride(2) == 1 and v_cache.stride(2) == 1
        k_out = q_out  # unused
    else:
        k_out = torch.empty((tokens, hkv, d), dtype=k.dtype, device=k.device)
    has_norm = q_weight is not None
    block = triton.next_power_of_2(d)
    _fused_rope_qk_kernel[(tokens, hq + hkv)](
        q, k, v, q_weight if has_norm else q, k_weight if has_norm else q, cos, sin, q_out, k_cache, v_cache,
        slot_mapping, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        q_out.stride(0), q_out.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        k_out.stride(0), k_out.stride(1), eps,
        HQ=hq, D=d, R=rdim, BLOCK_D=block, HAS_NORM=has_norm, WRITE_CACHE=direct,
        num_warps=max(1, min(4, block // 64)), **pdl_launch(q.device),
    )
    if not direct:
        from ninfer.kernels.attention import write_kv

        write_kv(k_cache, v_cache, k_out, v, slot_mapping, k_scale, v_scale)
    return q_out


# ---- attention output gate, SwiGLU ----------------------------------------------------------------


@triton.jit
def _fused_sigmoid_mul_kernel(
    X, G, Y, stride_xt, stride_xh, stride_gt, stride_gh, stride_yt, stride_yh,
    D: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    x = tl.load(X + t * stride_xt + h * stride_xh + d, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + t * stride_gt + h * stride_gh + d, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g).to(G.dtype.element_ty).to(tl.float32)  # sigmoid(gate) in the gate's dtype
    tl.store(Y + t * stride_yt + h * stride_yh + d, (x * s).to(Y.dtype.element_ty), mask=mask)


def sigmoid_gate_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x, gate: [T, H, D] (strided fine). -> [T, H * D] contiguous."""
    tokens, heads, d = x.shape
    assert gate.shape == x.shape and x.stride(2) == 1 and gate.stride(2) == 1
    y = torch.empty((tokens, heads, d), dtype=torch.promote_types(x.dtype, gate.dtype), device=x.device)
    if tokens * heads:
        block = triton.next_power_of_2(d)
        _fused_sigmoid_mul_kernel[(tokens, heads)](
            x, gate, y, x.stride(0), x.stride(1), gate.stride(0), gate.stride(1), y.stride(0), y.stride(1),
            D=d, BLOCK_D=block, num_warps=max(1, min(4, block // 128)), **pdl_launch(x.device),
        )
    return y.view(tokens, heads * d)


@triton.jit
def _fused_silu_mul_kernel(G, U, Y, N, stride_gt, stride_ut, stride_yt, BLOCK: tl.constexpr,
                           USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < N
    g = tl.load(G + t * stride_gt + c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + t * stride_ut + c, mask=mask, other=0.0).to(tl.float32)
    s = (g * tl.sigmoid(g)).to(G.dtype.element_ty).to(tl.float32)  # silu(gate) in the model dtype
    tl.store(Y + t * stride_yt + c, (s * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _shared_expert_add_kernel(R, S, G, Y, N, stride_rt, stride_st, stride_gt, stride_yt, BLOCK: tl.constexpr,
                              USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < N
    dt = Y.dtype.element_ty
    g = tl.load(G + t * stride_gt).to(tl.float32)
    gate = tl.sigmoid(g).to(dt).to(tl.float32)  # sigmoid(gate) in the model dtype
    shared = tl.load(S + t * stride_st + c, mask=mask, other=0.0).to(tl.float32)
    routed = tl.load(R + t * stride_rt + c, mask=mask, other=0.0).to(tl.float32)
    # the product rounded before the add, as the reference's two ops (no FMA across the rounding)
    tl.store(Y + t * stride_yt + c, (routed + _round_to(gate * shared, dt)).to(dt), mask=mask)


def shared_expert_add(routed: torch.Tensor, shared: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """routed, shared: [T, H]; gate: [T, 1] (a column of a merged projection is fine). -> [T, H]."""
    tokens, n = routed.shape
    r2, s2 = _rows(routed), _rows(shared)
    y = torch.empty((tokens, n), dtype=routed.dtype, device=routed.device)
    if tokens and n:
        block = min(1024, triton.next_power_of_2(n))
        _shared_expert_add_kernel[(tokens, triton.cdiv(n, block))](
            r2, s2, gate, y, n, r2.stride(0), s2.stride(0), gate.stride(0), y.stride(0), BLOCK=block,
            num_warps=4 if block >= 512 else 1, **pdl_launch(routed.device),
        )
    return y


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: [..., I] (strided rows fine). -> silu(gate) * up, contiguous."""
    shape = gate.shape
    n = shape[-1]
    g2, u2 = _rows(gate), _rows(up)
    rows = g2.shape[0]
    y = torch.empty((rows, n), dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    if rows and n:
        block = min(1024, triton.next_power_of_2(n))
        _fused_silu_mul_kernel[(rows, triton.cdiv(n, block))](
            g2, u2, y, n, g2.stride(0), u2.stride(0), y.stride(0), BLOCK=block, num_warps=4 if block >= 512 else 1,
            **pdl_launch(gate.device),
        )
    return y.view(shape)
