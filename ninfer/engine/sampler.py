"""Batched sampling on the engine's device, one call per step for the whole batch.

Randomness is counter-based: the noise for a candidate depends only on (seed, output index,
candidate rank), so a seeded request samples the same tokens whatever else shares its batch,
and a replayed request cannot drift. No host synchronization happens here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOP_K_CAP = 20  # contract: top_k 0..20, 0 selects the cap
_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (lowbias32) evaluated in int64 lanes; products wrap, low bits stay exact."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def counter_uniform(seed: torch.Tensor, step: torch.Tensor, width: int) -> torch.Tensor:
    """float32 uniforms strictly inside (0, 1), shape [B, width], keyed by (seed[b], step[b], column):
    the hash's top 23 bits plus one half, times 2^-23 (exact in float32, so never 0 or 1). float32 so
    that the fused Triton kernel computes the same noise: a float64 logarithm there is not known to
    compile for NVIDIA GPUs, and Triton's CPU interpreter lacks the libdevice one."""
    lo, hi = seed & _MASK32, (seed >> 32) & _MASK32
    base = _hash32(_hash32(lo ^ _hash32(hi + 0x9E3779B9)) + step)  # [B]
    cols = torch.arange(width, device=seed.device, dtype=torch.int64)
    h = _hash32(base[:, None] * 0x27D4EB2F + cols[None, :] + 1)
    return ((h >> 9).float() + 0.5) * 2.0**-23


@dataclass
class SamplingBatch:
    """Per-row sampler settings as device tensors."""

    temperature: torch.Tensor  # [B] float32; <= 0 means greedy
    top_p: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, 1..TOP_K_CAP
    min_p: torch.Tensor  # [B] float32
    presence_penalty: torch.Tensor  # [B] float32
    frequency_penalty: torch.Tensor  # [B] float32
    seed: torch.Tensor  # [B] int64
    step: torch.Tensor  # [B] int64: output index of the token being sampled

    FLOAT_ROWS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty")
    LONG_ROWS = ("top_k", "seed", "step")

    @classmethod
    def from_rows(cls, floats: torch.Tensor, longs: torch.Tensor) -> "SamplingBatch":
        """Views of two stacked tensors: floats [5, B] in FLOAT_ROWS order, longs [>= 3, B] starting
        with LONG_ROWS (the runner's uploads and the sampler graphs' static inputs are laid out so)."""
        return cls(**dict(zip(cls.FLOAT_ROWS, floats)), **dict(zip(cls.LONG_ROWS, longs)))


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """OpenAI-style penalties over the request's own generated tokens (counts: [B, V])."""
    present = (counts > 0).to(logits.dtype)
    return logits - batch.presence_penalty[:, None] * present - batch.frequency_penalty[:, None] * counts


def sample(logits: torch.Tensor, batch: SamplingBatch, counts: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [B, V] float32 -> token ids [B] int64."""
    logits = logits.float()
    if counts is not None:
        logits = apply_penalties(logits, counts, batch)
    greedy_ids = logits.argmax(dim=-1)

    k = min(TOP_K_CAP, logits.shape[-1])
    # candidates by the penalised logits, then scaled: the same set and order as the top-k of the scaled
    # logits, with one division per candidate instead of per vocabulary entry (and what the fused
    # kernel, ninfer.kernels.triton_sampler, computes)
    best, ids = torch.topk(logits, k, dim=-1)  # sorted, descending
    values = best / batch.temperature.clamp_min(1e-5)[:, None]
    ranks = torch.arange(k, device=logits.device)[None, :]
    keep = ranks < batch.top_k[:, None]
    probs = torch.softmax(values.masked_fill(~keep, float("-inf")), dim=-1)
    keep &= probs >= batch.min_p[:, None] * probs[:, :1]
    # top-p: keep the smallest prefix whose mass reaches top_p (the first candidate always stays)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep &= (mass_before < batch.top_p[:, None]) | (ranks == 0)
    log_probs = torch.log(probs.clamp_min(1e-30)).masked_fill(~keep, float("-inf"))
    gumbel = -torch.log(-torch.log(counter_uniform(batch.seed, batch.step, k)))
    choice = torch.argmax(log_probs + gumbel, dim=-1)
    sampled_ids = ids.gather(1, choice[:, None])[:, 0]
    return torch.where(batch.temperature <= 0, greedy_ids, sampled_ids)
