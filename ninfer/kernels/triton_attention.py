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
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_kernel(
    Q, K, V, PT, SL, OP, LSE,
    qk_scale, num_splits,
    stride_qb, stride_qh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_pb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, STORE_LSE: tl.constexpr, IEEE: tl.constexpr,
):
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
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for blk in range(blk_lo, blk_hi):
        n = blk * BLOCK_N + offs_n
        nmask = n < seq_len
        page = tl.load(PT + b * stride_pb + n // PAGE_SIZE, mask=nmask, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + (n % PAGE_SIZE)
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(K + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k.to(q.dtype)), IEEE) * qk_scale
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new

    has = l_i > 0.0  # false only for a split past the end of the sequence
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    o_ptrs = OP + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(o_ptrs, out.to(OP.dtype.element_ty), mask=hmask[:, None] & dmask[None, :])
    if STORE_LSE:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(LSE + b * stride_lb + heads * stride_lh + split, lse, mask=hmask)


@triton.jit(do_not_specialize=["num_splits"])
def _combine_kernel(
    PART, LSE, OUT, num_splits,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
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
    Q, K, V, OP, QSL, SL, PT,
    qk_scale,
    stride_qt, stride_qh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_pb,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, IEEE: tl.constexpr,
):
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
    q = tl.load(Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=mmask[:, None] & dmask[None, :], other=0.0)
    q_pos = ctx + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    kv_end = tl.minimum(seq_len, ctx + (qb + 1) * BLOCK_M)  # causal: nothing past the block's last query
    for start in range(0, kv_end, BLOCK_N):
        n = start + offs_n
        nmask = n < kv_end
        page = tl.load(PT + b * stride_pb + n // PAGE_SIZE, mask=nmask, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + (n % PAGE_SIZE)
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(K + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k.to(q.dtype)), IEEE) * qk_scale
        s = tl.where((n[None, :] <= q_pos[:, None]) & nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(OP + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], out.to(OP.dtype.element_ty),
             mask=mmask[:, None] & dmask[None, :])


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


def paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
    seq_lens: torch.Tensor, page_size: int, scale: float, num_splits: int | None = None,
) -> torch.Tensor:
    """q: [B, Hq, D] (one token per sequence, already written to the cache); caches [S, Hkv, D];
    page_table [B, P] int32; seq_lens [B] (context length including the new token). -> [B, Hq, D]."""
    batch, hq, head_dim = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    if num_splits is None:
        num_splits = pick_num_splits(q.device, hkv, k_cache.shape[0])
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_h = max(16, triton.next_power_of_2(group))
    block_n = 32 if block_d >= 256 else 64
    num_warps = 8 if block_d >= 256 else 4
    ieee = q.dtype == torch.float32
    out = torch.empty((batch, hq, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    common = dict(GROUP=group, BLOCK_H=block_h, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n,
                  PAGE_SIZE=page_size, IEEE=ieee, num_warps=num_warps, num_stages=2)
    if num_splits == 1:
        _decode_kernel[(batch, hkv, 1)](
            q, k_cache, v_cache, page_table, seq_lens, out, out, scale * LOG2E, 1,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            page_table.stride(0), out.stride(0), out.stride(1), 0, 0, 0, STORE_LSE=False, **common,
        )
        return out
    part = torch.empty((batch, hq, num_splits, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((batch, hq, num_splits), dtype=torch.float32, device=q.device)
    _decode_kernel[(batch, hkv, num_splits)](
        q, k_cache, v_cache, page_table, seq_lens, part, lse, scale * LOG2E, num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        page_table.stride(0), part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        STORE_LSE=True, **common,
    )
    _combine_kernel[(batch, hq)](
        part, lse, out, num_splits, part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)), num_warps=4,
    )
    return out


def paged_prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor, page_table: torch.Tensor, page_size: int, scale: float, max_query_len: int,
) -> torch.Tensor:
    """q: [T, Hq, D] ragged new tokens (K/V already written); query_start_loc [B+1]; seq_lens [B];
    page_table [B, P]. Causal within each sequence's context. -> [T, Hq, D]."""
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
    block_m = min(block_m, max(16, triton.next_power_of_2(max_query_len)))
    grid = (math.ceil(max_query_len / block_m), batch, hq)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, page_table, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), page_table.stride(0),
        GROUP=hq // hkv, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        PAGE_SIZE=page_size, IEEE=ieee, num_warps=num_warps, num_stages=2,
    )
    return out
