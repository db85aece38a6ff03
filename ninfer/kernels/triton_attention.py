"""Paged attention in Triton over the flat slot cache ([S, Hkv, D] per layer, S = pages * page_size).

Our own kernels, not flashinfer: flashinfer's wheel (~62 MB plus large dependencies) does not fit
the 64 MiB the device tool carries, and nothing can be installed on the H200 host. Two kernels:

- `paged_decode`: one new token per sequence. Split-KV ("flash decoding"): each program takes one
  (sequence, KV head, split) and all the query heads of that KV head's group at once (GQA packed
  into the M dimension of the dot), then a small kernel merges the splits by their log-sum-exp.
  Every length it needs is read on the device (`seq_lens`), so it is CUDA-graph capturable; the
  number of splits depends only on the KV heads and the cache capacity (batch invariant).
- `paged_prefill`: a ragged batch of query chunks (each sequence's new tokens at the end of its
  cached context), causal, one program per (query block, sequence, query head). The grid needs the
  longest query chunk, which the host knows when it builds the batch.

Both compute softmax in fp32 (exp2 domain); fp32 inputs use IEEE dots so fp32 models match the
torch reference (`ninfer.kernels.attention.paged_attention_ref`) to rounding.

Quantized KV (fp8 e4m3 / int8 storage with one fp32 scale per (slot, KV head); see
`ninfer.forward`): a constexpr KV_QUANT switch makes both kernels load the 1-byte K/V, convert
them exactly to the query dtype (e4m3 and int8 values are exact in bf16 and fp32) and fold the
scales into the fp32 scores (s = q.k_q * k_scale) and the probabilities (p * v_scale before the
P.V dot), so no dequantized tile is materialized. `write_kv_quantized` is the fused write: it
quantizes a step's new K and V rows (amax per head, scale = amax / qmax) and scatters values and
scales to their slots, one program per token, device tensors only (CUDA-graph capturable). The
unquantized (bf16) path compiles to the same code as before (KV_QUANT=False prunes every branch).

NVFP4 rows (`--kv-dtype nvfp4`, V of `k8v4`; uint8 caches [S, Hkv, D/2 + D/16]): constexprs K_FP4 /
V_FP4. A tile's code bytes are element pairs: `_fp4_pairs` decodes the low and high nibbles (even and
odd elements) and their E4M3 block scales exactly into two fp32 half tiles (e2m1 * block scale, exact
in bf16 too), so keys take q split into even / odd elements (two dots of D/2) and values accumulate
the output's even / odd halves, stored interleaved: no register shuffle. The row's fp32 scale folds
in as for fp8/int8. The write (`_quantize_fp4_rows`) computes the E4M3 and E2M1 roundings in integer
and compare arithmetic, bit-identical to `attention.quantize_kv` in the interpreter and on any GPU.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ninfer.kernels.pdl import pdl_enter, pdl_launch
from ninfer.kernels.triton_compat import fix_interpreter

fix_interpreter()  # TRITON_INTERPRET=1 only: see triton_compat

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _fp4_pairs(ROW, row_off, offs_j, mask, HALF_D: tl.constexpr):
    """An NVFP4 tile (`ninfer.forward`): rows at ROW + row_off [N] (D/2 code bytes, then D/16 E4M3
    block scales), code bytes offs_j [J] -> (even elements, odd elements), each [N, J] fp32 equal to
    e2m1 * block scale exactly (before the row's fp32 scale). Both decodes go through fp16 bit patterns,
    whose subnormals every GPU converts exactly: an E2M1 code c becomes the fp16 bits (c & 7) << 9
    (value e2m1 * 2^-14), an E4M3 byte b the bits b << 7 (value e4m3 * 2^-8); 2^22 puts both right."""
    ptr = ROW + row_off[:, None]
    byte = tl.load(ptr + offs_j[None, :], mask=mask, other=0).to(tl.int16)
    sb = tl.load(ptr + HALF_D + (offs_j // 8)[None, :], mask=mask, other=0).to(tl.int16)  # block of 16 = 8 bytes
    block_scale = (sb << 7).to(tl.float16, bitcast=True).to(tl.float32) * 4194304.0
    return _e2m1_value(byte & 15, block_scale), _e2m1_value(byte >> 4, block_scale)


@triton.jit
def _e2m1_value(code, block_scale):
    bits = ((code & 7) << 9) | ((code & 8) << 12)  # magnitude into fp16's exponent/mantissa, sign to bit 15
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * block_scale


@triton.jit(do_not_specialize=["num_splits"])
def _decode_kernel(
    Q, K, V, KS, VS, PT, SL, OP, LSE,
    qk_scale, num_splits,
    stride_qb, stride_qh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_kss, stride_ksh,
    stride_vss, stride_vsh,
    stride_pb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, STORE_LSE: tl.constexpr, IEEE: tl.constexpr,
    KV_QUANT: tl.constexpr, USE_PDL: tl.constexpr = False,
    K_FP4: tl.constexpr = False, V_FP4: tl.constexpr = False, HALF_D: tl.constexpr = 1, BLOCK_J: tl.constexpr = 16,
):
    pdl_enter(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SL + b)
    n_blocks = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(n_blocks, num_splits)
    blk_lo = split * per_split
    blk_hi = tl.minimum(blk_lo + per_split, n_blocks)

    offs_h = tl.arange(0, BLOCK_H)
    hmask = offs_h < GROUP
    heads = kvh * GROUP + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    qdt = Q.dtype.element_ty
    offs_j = tl.arange(0, BLOCK_J)  # NVFP4 rows: code bytes, i.e. element pairs (2j, 2j+1)
    jmask = offs_j < HALF_D
    q_row = Q + b * stride_qb + heads[:, None] * stride_qh
    if K_FP4:  # q split into even / odd elements: q.k = q_even.k_even + q_odd.k_odd, no interleave
        q_lo = tl.load(q_row + 2 * offs_j[None, :], mask=hmask[:, None] & jmask[None, :], other=0.0)
        q_hi = tl.load(q_row + 2 * offs_j[None, :] + 1, mask=hmask[:, None] & jmask[None, :], other=0.0)
    else:
        q = tl.load(q_row + offs_d[None, :], mask=hmask[:, None] & dmask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    if V_FP4:  # the output's even and odd elements
        acc_lo = tl.zeros([BLOCK_H, BLOCK_J], tl.float32)
        acc_hi = tl.zeros([BLOCK_H, BLOCK_J], tl.float32)
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for blk in range(blk_lo, blk_hi):
        n = blk * BLOCK_N + offs_n
        nmask = n < seq_len
        page = tl.load(PT + b * stride_pb + n // PAGE_SIZE, mask=nmask, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + (n % PAGE_SIZE)
        kv_mask = nmask[:, None] & dmask[None, :]
        if K_FP4:
            k_lo, k_hi = _fp4_pairs(K, slot * stride_ks + kvh * stride_kh, offs_j, nmask[:, None] & jmask[None, :],
                                    HALF_D)
            ks = tl.load(KS + slot * stride_kss + kvh * stride_ksh, mask=nmask, other=0.0)
            s = _dot(q_lo, tl.trans(k_lo.to(qdt)), IEEE) + _dot(q_hi, tl.trans(k_hi.to(qdt)), IEEE)
            s = s * (ks * qk_scale)[None, :]
        else:
            k = tl.load(K + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
            if KV_QUANT:
                ks = tl.load(KS + slot * stride_kss + kvh * stride_ksh, mask=nmask, other=0.0)
                s = _dot(q, tl.trans(k.to(q.dtype)), IEEE) * (ks * qk_scale)[None, :]
            else:
                s = _dot(q, tl.trans(k.to(q.dtype)), IEEE) * qk_scale
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_FP4:
            v_lo, v_hi = _fp4_pairs(V, slot * stride_vs + kvh * stride_vh, offs_j, nmask[:, None] & jmask[None, :],
                                    HALF_D)
            vs = tl.load(VS + slot * stride_vss + kvh * stride_vsh, mask=nmask, other=0.0)
            pv = (p * vs[None, :]).to(qdt)
            acc_lo = acc_lo * alpha[:, None] + _dot(pv, v_lo.to(qdt), IEEE)
            acc_hi = acc_hi * alpha[:, None] + _dot(pv, v_hi.to(qdt), IEEE)
        else:
            v = tl.load(V + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
            v = v.to(qdt)
            if KV_QUANT:
                vs = tl.load(VS + slot * stride_vss + kvh * stride_vsh, mask=nmask, other=0.0)
                p = p * vs[None, :]
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new

    has = l_i > 0.0  # false only for a split past the end of the sequence
    o_row = OP + b * stride_ob + heads[:, None] * stride_oh + split * stride_os
    if V_FP4:
        denom = tl.where(has, l_i, 1.0)[:, None]
        omask = hmask[:, None] & jmask[None, :]
        tl.store(o_row + 2 * offs_j[None, :], (acc_lo / denom).to(OP.dtype.element_ty), mask=omask)
        tl.store(o_row + 2 * offs_j[None, :] + 1, (acc_hi / denom).to(OP.dtype.element_ty), mask=omask)
    else:
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        tl.store(o_row + offs_d[None, :], out.to(OP.dtype.element_ty), mask=hmask[:, None] & dmask[None, :])
    if STORE_LSE:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(LSE + b * stride_lb + heads * stride_lh + split, lse, mask=hmask)


@triton.jit(do_not_specialize=["num_splits"])
def _combine_kernel(
    PART, LSE, OUT, num_splits,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    smask = offs_s < num_splits
    lse = tl.load(LSE + b * stride_lb + h * stride_lh + offs_s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - m)  # empty splits: exp2(-inf) = 0
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    parts = tl.load(PART + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                    mask=smask[:, None] & dmask[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(OUT + b * stride_ob + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty), mask=dmask)


@triton.jit
def _prefill_kernel(
    Q, K, V, KS, VS, OP, QSL, SL, PT,
    qk_scale,
    stride_qt, stride_qh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_kss, stride_ksh,
    stride_vss, stride_vsh,
    stride_ot, stride_oh,
    stride_pb,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, IEEE: tl.constexpr, KV_QUANT: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    K_FP4: tl.constexpr = False, V_FP4: tl.constexpr = False, HALF_D: tl.constexpr = 1, BLOCK_J: tl.constexpr = 16,
):
    pdl_enter(USE_PDL)
    qb = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    q_start = tl.load(QSL + b)
    qlen = tl.load(QSL + b + 1) - q_start
    if qb * BLOCK_M >= qlen:
        return
    seq_len = tl.load(SL + b)
    ctx = seq_len - qlen  # tokens cached before this chunk
    kvh = h // GROUP

    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = offs_m < qlen
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    qdt = Q.dtype.element_ty
    offs_j = tl.arange(0, BLOCK_J)  # NVFP4 rows: element pairs, as in _decode_kernel
    jmask = offs_j < HALF_D
    q_row = Q + rows[:, None] * stride_qt + h * stride_qh
    if K_FP4:
        q_lo = tl.load(q_row + 2 * offs_j[None, :], mask=mmask[:, None] & jmask[None, :], other=0.0)
        q_hi = tl.load(q_row + 2 * offs_j[None, :] + 1, mask=mmask[:, None] & jmask[None, :], other=0.0)
    else:
        q = tl.load(q_row + offs_d[None, :], mask=mmask[:, None] & dmask[None, :], other=0.0)
    q_pos = ctx + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if V_FP4:
        acc_lo = tl.zeros([BLOCK_M, BLOCK_J], tl.float32)
        acc_hi = tl.zeros([BLOCK_M, BLOCK_J], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    kv_end = tl.minimum(seq_len, ctx + (qb + 1) * BLOCK_M)  # causal: nothing past the block's last query
    for start in range(0, kv_end, BLOCK_N):
        n = start + offs_n
        nmask = n < kv_end
        page = tl.load(PT + b * stride_pb + n // PAGE_SIZE, mask=nmask, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + (n % PAGE_SIZE)
        kv_mask = nmask[:, None] & dmask[None, :]
        if K_FP4:
            k_lo, k_hi = _fp4_pairs(K, slot * stride_ks + kvh * stride_kh, offs_j, nmask[:, None] & jmask[None, :],
                                    HALF_D)
            ks = tl.load(KS + slot * stride_kss + kvh * stride_ksh, mask=nmask, other=0.0)
            s = _dot(q_lo, tl.trans(k_lo.to(qdt)), IEEE) + _dot(q_hi, tl.trans(k_hi.to(qdt)), IEEE)
            s = s * (ks * qk_scale)[None, :]
        else:
            k = tl.load(K + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
            if KV_QUANT:
                ks = tl.load(KS + slot * stride_kss + kvh * stride_ksh, mask=nmask, other=0.0)
                s = _dot(q, tl.trans(k.to(q.dtype)), IEEE) * (ks * qk_scale)[None, :]
            else:
                s = _dot(q, tl.trans(k.to(q.dtype)), IEEE) * qk_scale
        s = tl.where((n[None, :] <= q_pos[:, None]) & nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_FP4:
            v_lo, v_hi = _fp4_pairs(V, slot * stride_vs + kvh * stride_vh, offs_j, nmask[:, None] & jmask[None, :],
                                    HALF_D)
            vs = tl.load(VS + slot * stride_vss + kvh * stride_vsh, mask=nmask, other=0.0)
            pv = (p * vs[None, :]).to(qdt)
            acc_lo = acc_lo * alpha[:, None] + _dot(pv, v_lo.to(qdt), IEEE)
            acc_hi = acc_hi * alpha[:, None] + _dot(pv, v_hi.to(qdt), IEEE)
        else:
            v = tl.load(V + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
            v = v.to(qdt)
            if KV_QUANT:
                vs = tl.load(VS + slot * stride_vss + kvh * stride_vsh, mask=nmask, other=0.0)
                p = p * vs[None, :]
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new

    o_row = OP + rows[:, None] * stride_ot + h * stride_oh
    if V_FP4:
        omask = mmask[:, None] & jmask[None, :]
        tl.store(o_row + 2 * offs_j[None, :], (acc_lo / l_i[:, None]).to(OP.dtype.element_ty), mask=omask)
        tl.store(o_row + 2 * offs_j[None, :] + 1, (acc_hi / l_i[:, None]).to(OP.dtype.element_ty), mask=omask)
    else:
        out = acc / l_i[:, None]
        tl.store(o_row + offs_d[None, :], out.to(OP.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def pick_num_splits(device: torch.device, kv_heads: int, cache_slots: int) -> int:
    """Splits per (sequence, KV head): enough programs for about two waves over the GPU at batch 1,
    each split able to cover at least 512 tokens of the cache's capacity.

    Depends on neither the batch size nor the page-table width, so a sequence's decode output is
    the same alone or batched, eager or from a CUDA graph (the split boundaries fix the order of
    the floating-point sums)."""
    want = -(-2 * _num_sms(device) // max(1, kv_heads))
    cap = max(1, -(-cache_slots // 512))
    return max(1, min(want, cap, 64))


def _scale_args(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> tuple:
    """(KS, VS, their 4 strides, KV_QUANT): placeholders (never read) for an unquantized cache."""
    if k_scale is None:
        return k_cache, k_cache, 0, 0, 0, 0, False
    return k_scale, v_scale, k_scale.stride(0), k_scale.stride(1), v_scale.stride(0), v_scale.stride(1), True


def _fp4_args(head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> dict:
    """The NVFP4 constexprs: which of K / V are NVFP4 rows (uint8 caches), half the head dim, its block."""
    k_fp4, v_fp4 = k_cache.dtype == torch.uint8, v_cache.dtype == torch.uint8
    if (k_fp4 or v_fp4) and head_dim % 16:
        raise ValueError(f"NVFP4 KV needs head_dim % 16 == 0, not {head_dim}")
    return dict(K_FP4=k_fp4, V_FP4=v_fp4, HALF_D=head_dim // 2,
                BLOCK_J=max(16, triton.next_power_of_2(head_dim // 2)))


def paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
    seq_lens: torch.Tensor, page_size: int, scale: float, num_splits: int | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    tiles: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """q: [B, Hq, D] (one token per sequence, already written to the cache); caches [S, Hkv, D];
    page_table [B, P] int32; seq_lens [B] (context length including the new token). -> [B, Hq, D].
    Quantized caches (fp8 / int8, NVFP4 rows [S, Hkv, D/2 + D/16] uint8) pass their fp32 scales
    k_scale / v_scale [S, Hkv]. tiles: (BLOCK_N, num_warps, num_stages) instead of the tuned ones
    (benchmark sweeps)."""
    batch, hq, head_dim = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    if num_splits is None:
        num_splits = pick_num_splits(q.device, hkv, k_cache.shape[0])
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_h = max(16, triton.next_power_of_2(group))
    block_n = 32 if block_d >= 256 else 64
    num_warps = 8 if block_d >= 256 else 4
    num_stages = 2
    ieee = q.dtype == torch.float32
    out = torch.empty((batch, hq, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    ks, vs, *scale_strides, kv_quant = _scale_args(k_cache, k_scale, v_scale)
    fp4 = _fp4_args(head_dim, k_cache, v_cache)
    if not ieee and block_d >= 256:
        # H200 tile sweep (bench/results/2026-11-30-h200-s2/attention_tile_sweep.txt), 24/4 heads, D 256,
        # 64k cached tokens: bf16 82 us at 64/4/2 (100 us at 32/8/2); 1-byte K/V rows take longer,
        # 3-stage tiles: fp8 81 us, int8 85 us at 128/4/3 (106-130 us at 32/8/2). NVFP4 rows decode
        # in registers (two fp32 half tiles per K/V tile): smaller tiles, not yet swept on the device
        # (`python3 -m bench.selfcheck_kv` times the candidates).
        if fp4["K_FP4"] or fp4["V_FP4"]:
            block_n, num_warps, num_stages = 64, 4, 2
        else:
            block_n, num_warps, num_stages = (128, 4, 3) if kv_quant else (64, 4, 2)
    if tiles is not None:
        block_n, num_warps, num_stages = tiles
    common = dict(GROUP=group, BLOCK_H=block_h, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n,
                  PAGE_SIZE=page_size, IEEE=ieee, KV_QUANT=kv_quant, num_warps=num_warps, num_stages=num_stages,
                  **fp4, **pdl_launch(q.device))
    if num_splits == 1:
        _decode_kernel[(batch, hkv, 1)](
            q, k_cache, v_cache, ks, vs, page_table, seq_lens, out, out, scale * LOG2E, 1,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            *scale_strides, page_table.stride(0), out.stride(0), out.stride(1), 0, 0, 0, STORE_LSE=False, **common,
        )
        return out
    part = torch.empty((batch, hq, num_splits, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((batch, hq, num_splits), dtype=torch.float32, device=q.device)
    _decode_kernel[(batch, hkv, num_splits)](
        q, k_cache, v_cache, ks, vs, page_table, seq_lens, part, lse, scale * LOG2E, num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        *scale_strides, page_table.stride(0), part.stride(0), part.stride(1), part.stride(2), lse.stride(0),
        lse.stride(1), STORE_LSE=True, **common,
    )
    _combine_kernel[(batch, hq)](
        part, lse, out, num_splits, part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)), num_warps=4, **pdl_launch(q.device),
    )
    return out


def paged_prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor, page_table: torch.Tensor, page_size: int, scale: float, max_query_len: int,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    tiles: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D] ragged new tokens (K/V already written); query_start_loc [B+1]; seq_lens [B];
    page_table [B, P]. Causal within each sequence's context. -> [T, Hq, D]. Quantized caches pass
    their scales as in `paged_decode`. tiles: (BLOCK_M, BLOCK_N, num_warps) instead of the tuned ones."""
    tokens, hq, head_dim = q.shape
    hkv = k_cache.shape[1]
    batch = seq_lens.shape[0]
    out = torch.empty((tokens, hq, head_dim), dtype=q.dtype, device=q.device)
    if tokens == 0 or batch == 0:
        return out
    block_d = max(16, triton.next_power_of_2(head_dim))
    ieee = q.dtype == torch.float32
    if block_d >= 256:
        block_m, block_n, num_warps = 64, 32, 8
    else:
        block_m, block_n, num_warps = 64, 64, 4
    if ieee and block_d >= 128:
        block_n = 32
    ks, vs, *scale_strides, kv_quant = _scale_args(k_cache, k_scale, v_scale)
    fp4 = _fp4_args(head_dim, k_cache, v_cache)
    if not ieee and block_d >= 256:
        # H200 tile sweep, 1024 new after 4096 cached, 24/4 heads, D 256, at 128/64/8: bf16 442 us,
        # fp8 877 us, int8 802 us (921 / 1528 / 1378 us at 64/32/8); NVFP4 not yet swept
        block_m, block_n, num_warps = 128, 64, 8
    if tiles is not None:
        block_m, block_n, num_warps = tiles
    block_m = min(block_m, max(16, triton.next_power_of_2(max_query_len)))
    grid = (math.ceil(max_query_len / block_m), batch, hq)
    _prefill_kernel[grid](
        q, k_cache, v_cache, ks, vs, out, query_start_loc, seq_lens, page_table, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        *scale_strides, out.stride(0), out.stride(1), page_table.stride(0),
        GROUP=hq // hkv, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        PAGE_SIZE=page_size, IEEE=ieee, KV_QUANT=kv_quant, num_warps=num_warps, num_stages=2,
        **fp4, **pdl_launch(q.device),
    )
    return out


# ---- quantized KV write ------------------------------------------------------------------------

FP32_TINY = tl.constexpr(1.1754943508222875e-38)  # smallest normal fp32: the scale of an all-zero row


def fp32_reciprocal(x: float) -> float:
    """1/x rounded to fp32 (as a Python float), so torch and Triton multiply by the same constant."""
    return torch.tensor(1.0 / x, dtype=torch.float32).item()


INV_NVFP4_QMAX = tl.constexpr(fp32_reciprocal(448.0 * 6.0))  # fp32(1/2688), as `attention.quantize_kv`


@triton.jit
def _round_e4m3(y):
    """Round fp32 |y| <= 448 to the nearest float8 e4m3 value (ties to even), in fp32. Only for
    Triton's interpreter, whose fp32->fp8 cast does not carry a mantissa round-up into the exponent
    (-7.98 becomes -4): after this the cast is exact. GPUs cast with cvt.rn (the same rounding)."""
    a = tl.abs(y)
    bits = a.to(tl.int32, bitcast=True)
    # normal e4m3 (|y| >= 2^-6): keep 3 of fp32's 23 mantissa bits, round half to even
    normal = (((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) << 20).to(tl.float32, bitcast=True)
    # subnormal e4m3: multiples of 2^-9
    t = a * 512.0
    n = t.to(tl.int32)
    f = t - n.to(tl.float32)
    up = (f > 0.5) | ((f == 0.5) & ((n & 1) == 1))
    sub = (n + up.to(tl.int32)).to(tl.float32) * (1.0 / 512.0)
    r = tl.where(a < 0.015625, sub, normal)
    return tl.where(y < 0, -r, r)


@triton.jit
def _quantize_rows(src, dst, scale_ptr, mask, hmask, QMAX: tl.constexpr, INV_QMAX: tl.constexpr,
                   IS_FP8: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """[BLOCK_H, BLOCK_D] rows at `src` -> quantized values at `dst`, one fp32 scale per row at `scale_ptr`."""
    x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    # scale = amax * fp32(1/qmax), then an IEEE reciprocal: the same fp32 operations as `quantize_kv`,
    # so the write is bit-identical to it on any device
    scale = tl.maximum(tl.max(tl.abs(x), 1) * INV_QMAX, FP32_TINY)
    y = x * tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)[:, None]
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if IS_FP8:
        if EMULATE_RNE:
            y = _round_e4m3(y)
        q = y.to(tl.float8e4nv)
    else:
        q = tl.where(y >= 0, y + 0.5, y - 0.5).to(tl.int8)  # round half away from zero, then truncate
    tl.store(dst, q, mask=mask)
    tl.store(scale_ptr, scale, mask=hmask)


@triton.jit
def _e4m3_bits(y):
    """fp32 y in [0, 448] -> the bits of the nearest float8 e4m3 value (ties to even) as int32: torch's
    cast, in integer arithmetic so that the interpreter and every GPU agree."""
    bits = y.to(tl.int32, bitcast=True)
    # normal (y >= 2^-6): keep 3 mantissa bits, round half to even; fp32's exponent bias is e4m3's + 120
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal: multiples of 2^-9 (a round-up to 8 is 2^-6's bits, the first normal)
    t = y * 512.0
    n = t.to(tl.int32)
    f = t - n.to(tl.float32)
    sub = n + ((f > 0.5) | ((f == 0.5) & ((n & 1) == 1))).to(tl.int32)
    return tl.where(y < 0.015625, sub, normal)


@triton.jit
def _e2m1_code(v):
    """fp32 values in units of their block scale -> E2M1 codes (int32, sign in bit 3): the nearest
    magnitude, ties to the even code, saturating at 6 (`ninfer.quant.nvfp4._e2m1_codes`)."""
    a = tl.abs(v)
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    return code | (((v < 0) & (code > 0)).to(tl.int32) << 3)  # no -0 codes


@triton.jit
def _quantize_fp4_rows(src, dst, scale_ptr, hmask, HALF_D: tl.constexpr, NUM_BLOCKS: tl.constexpr,
                       BLOCK_B: tl.constexpr):
    """[BLOCK_H] rows (row pointers src / dst) -> NVFP4 rows: codes, E4M3 block scales and one fp32 scale
    per row at `scale_ptr`; the fp32 operations of `attention.quantize_kv(x, torch.uint8)`, in order.
    Tiles are [BLOCK_H, block, 8] element pairs: even elements (low nibbles) and odd ones (high)."""
    offs_b = tl.arange(0, BLOCK_B)
    pair = offs_b[:, None] * 8 + tl.arange(0, 8)[None, :]  # code byte j of the row: elements 2j, 2j+1
    bmask = hmask[:, None] & (offs_b < NUM_BLOCKS)[None, :]
    mask = bmask[:, :, None] & (pair < HALF_D)[None, :, :]
    x_lo = tl.load(src[:, None, None] + 2 * pair[None, :, :], mask=mask, other=0.0).to(tl.float32)
    x_hi = tl.load(src[:, None, None] + 2 * pair[None, :, :] + 1, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.max(tl.abs(x_lo), 2), 1), tl.max(tl.max(tl.abs(x_hi), 2), 1))
    scale = tl.maximum(amax * INV_NVFP4_QMAX, FP32_TINY)
    inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)[:, None, None]
    u_lo, u_hi = x_lo * inv, x_hi * inv
    block_amax = tl.maximum(tl.max(tl.abs(u_lo), 2), tl.max(tl.abs(u_hi), 2))
    bits = _e4m3_bits(tl.minimum(tl.math.div_rn(block_amax, tl.full(block_amax.shape, 6.0, tl.float32)), 448.0))
    block_scale = ((bits << 7).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0)[:, :, None]
    nonzero = block_scale > 0.0  # an all-zero (or underflowing) block: scale 0, codes 0
    divisor = tl.broadcast_to(tl.where(nonzero, block_scale, 1.0), u_lo.shape)
    lo = tl.where(nonzero, _e2m1_code(tl.math.div_rn(u_lo, divisor)), 0)
    hi = tl.where(nonzero, _e2m1_code(tl.math.div_rn(u_hi, divisor)), 0)
    tl.store(dst[:, None, None] + pair[None, :, :], (lo | (hi << 4)).to(tl.uint8), mask=mask)
    tl.store(dst[:, None] + HALF_D + offs_b[None, :], bits.to(tl.uint8), mask=bmask)
    tl.store(scale_ptr, scale, mask=hmask)


@triton.jit
def _write_kv_quant_kernel(
    K, V, KC, VC, KS, VS, SLOTS,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcs, stride_kch, stride_vcs, stride_vch,
    stride_kss, stride_ksh, stride_vss, stride_vsh,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    QMAX: tl.constexpr, INV_QMAX: tl.constexpr, IS_FP8: tl.constexpr, EMULATE_RNE: tl.constexpr,
    USE_PDL: tl.constexpr = False, K_FP4: tl.constexpr = False, V_FP4: tl.constexpr = False,
    BLOCK_B: tl.constexpr = 1,
):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    hmask = (offs_h < HEADS) & (slot >= 0)  # slot -1: a padding token, nothing written
    mask = hmask[:, None] & (offs_d < HEAD_DIM)[None, :]
    h2, d2 = offs_h[:, None], offs_d[None, :]
    if K_FP4:
        _quantize_fp4_rows(K + t * stride_kt + offs_h * stride_kh, KC + slot * stride_kcs + offs_h * stride_kch,
                           KS + slot * stride_kss + offs_h * stride_ksh, hmask, HEAD_DIM // 2, HEAD_DIM // 16, BLOCK_B)
    else:
        _quantize_rows(K + t * stride_kt + h2 * stride_kh + d2, KC + slot * stride_kcs + h2 * stride_kch + d2,
                       KS + slot * stride_kss + offs_h * stride_ksh, mask, hmask, QMAX, INV_QMAX, IS_FP8, EMULATE_RNE)
    if V_FP4:
        _quantize_fp4_rows(V + t * stride_vt + offs_h * stride_vh, VC + slot * stride_vcs + offs_h * stride_vch,
                           VS + slot * stride_vss + offs_h * stride_vsh, hmask, HEAD_DIM // 2, HEAD_DIM // 16, BLOCK_B)
    else:
        _quantize_rows(V + t * stride_vt + h2 * stride_vh + d2, VC + slot * stride_vcs + h2 * stride_vch + d2,
                       VS + slot * stride_vss + offs_h * stride_vsh, mask, hmask, QMAX, INV_QMAX, IS_FP8, EMULATE_RNE)


def write_kv_quantized(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
    k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
) -> None:
    """Quantize k/v [T, Hkv, D] per (token, head) into the fp8 / int8 caches [S, Hkv, D] or NVFP4 caches
    [S, Hkv, D/2 + D/16] uint8 (nvfp4: both, k8v4: V) at `slots` [T] (-1: padding, skipped), with their
    fp32 scales into k_scale / v_scale [S, Hkv]. Bit-identical to `ninfer.kernels.attention.quantize_kv`."""
    tokens, hkv, head_dim = k.shape
    if tokens == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    fp4 = _fp4_args(head_dim, k_cache, v_cache)
    byte_dtypes = {c.dtype for c in (k_cache, v_cache) if c.dtype != torch.uint8}  # the fp8 / int8 side(s)
    if not byte_dtypes <= {torch.float8_e4m3fn} and not byte_dtypes <= {torch.int8}:
        raise ValueError(f"write_kv_quantized needs fp8, int8 or NVFP4 (uint8) caches, not {k_cache.dtype} / "
                         f"{v_cache.dtype}")
    is_fp8 = torch.float8_e4m3fn in byte_dtypes
    block_d = triton.next_power_of_2(head_dim)
    qmax = 448.0 if is_fp8 else 127.0
    _write_kv_quant_kernel[(tokens,)](
        k, v, k_cache, v_cache, k_scale, v_scale, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        k_scale.stride(0), k_scale.stride(1), v_scale.stride(0), v_scale.stride(1),
        HEADS=hkv, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=block_d,
        QMAX=qmax, INV_QMAX=fp32_reciprocal(qmax), IS_FP8=is_fp8, EMULATE_RNE=k.device.type != "cuda",
        K_FP4=fp4["K_FP4"], V_FP4=fp4["V_FP4"], BLOCK_B=triton.next_power_of_2(max(1, head_dim // 16)),
        num_warps=4 if hkv * block_d >= 1024 else 1, **pdl_launch(k.device),
    )
