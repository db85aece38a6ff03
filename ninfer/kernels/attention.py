"""Paged attention: write new K/V into the flat slot cache, then attend over each sequence's pages.

The torch reference loops over sequences with host lengths; it is the oracle that CUDA backends
are checked against.
"""

from __future__ import annotations

import torch

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
    """q: [T, Hq, D]; caches: [S, Hkv, D]. Causal: new token j of a sequence sees positions <= its own."""
    out = torch.empty_like(q)
    hq, hkv = q.shape[1], k_cache.shape[1]
    start = 0
    for i, qlen in enumerate(batch.query_lens_cpu):
        n = batch.seq_lens_cpu[i]
        slots = sequence_slots(batch, i, page_size)
        k = k_cache[slots].to(q.dtype).repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
        v = v_cache[slots].to(q.dtype).repeat_interleave(hq // hkv, dim=1)
        qi = q[start : start + qlen]  # [qlen, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qi.float(), k.float()) * scale
        q_pos = torch.arange(n - qlen, n, device=q.device)[:, None]
        k_pos = torch.arange(n, device=q.device)[None, :]
        scores = scores.masked_fill((k_pos > q_pos)[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start : start + qlen] = torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)
        start += qlen
    return out


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, page_size: int,
    scale: float,
) -> torch.Tensor:
    """Dispatch point for CUDA backends (added with the GPU work); the reference runs everywhere."""
    return paged_attention_ref(q, k_cache, v_cache, batch, page_size, scale)
