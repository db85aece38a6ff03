"""Paged attention: write new K/V into the flat slot cache, then attend over each sequence's pages.

The torch reference loops over sequences with host lengths; it is the oracle that CUDA backends
are checked against. CUDA tensors take our Triton kernels (`triton_attention`: split-KV decode,
varlen causal prefill) unless NINFER_KERNELS=reference (see `ninfer.kernels.backend`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.kernels.backend import use_triton
from ninfer.models.batch import ForwardBatch


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """k_cache/v_cache: [S, Hkv, D] (one layer); k/v: [T, Hkv, D]; slots: [T]."""
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


def sequence_slots(batch: ForwardBatch, i: int, page_size: int) -> torch.Tensor:
    """Flat slot ids of sequence i's whole context (cached prefix and new tokens)."""
    n = batch.seq_lens_cpu[i]
    pages = batch.page_table[i, : (n + page_size - 1) // page_size].long()
    offsets = torch.arange(page_size, device=pages.device)
    return (pages[:, None] * page_size + offsets[None, :]).reshape(-1)[:n]


def paged_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, page_size: int,
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D]; caches: [S, Hkv, D]. Causal: new token j of a sequence sees positions <= its own.

    One fused SDPA call per sequence (GQA without repeating K/V); the explicit mask handles a
    chunk that starts after cached tokens, which SDPA's is_causal (top-left aligned) would not.
    """
    out = torch.empty_like(q)
    start = 0
    for i, qlen in enumerate(batch.query_lens_cpu):
        n = batch.seq_lens_cpu[i]
        slots = sequence_slots(batch, i, page_size)
        k = k_cache[slots].to(q.dtype).transpose(0, 1)[None]  # [1, Hkv, n, D]
        v = v_cache[slots].to(q.dtype).transpose(0, 1)[None]
        qi = q[start : start + qlen].transpose(0, 1)[None]  # [1, Hq, qlen, D]
        if qlen == 1:
            mask = None  # a decode token sees the whole context
        else:
            q_pos = torch.arange(n - qlen, n, device=q.device)[:, None]
            mask = torch.arange(n, device=q.device)[None, :] <= q_pos
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start : start + qlen] = o[0].transpose(0, 1)
        start += qlen
    return out


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, page_size: int,
    scale: float,
) -> torch.Tensor:
    """Triton kernels for CUDA tensors (decode: device lengths only, graph-capturable); else the reference."""
    if use_triton(q):
        from ninfer.kernels import triton_attention

        if batch.is_decode:
            return triton_attention.paged_decode(q, k_cache, v_cache, batch.page_table, batch.seq_lens, page_size,
                                                 scale)
        return triton_attention.paged_prefill(q, k_cache, v_cache, batch.query_start_loc, batch.seq_lens,
                                              batch.page_table, page_size, scale, max(batch.query_lens_cpu))
    return paged_attention_ref(q, k_cache, v_cache, batch, page_size, scale)
