"""Layers shared by the model families: norms, rotary embeddings, SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32.

    zero_centered=True is the Gemma/Qwen3.5 form, y = x_hat * (1 + w) (weights initialised at 0);
    False is the Llama form, y = w * x_hat, with x_hat cast back to the input dtype first.
    """

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (xf * (1.0 + self.weight.float())).to(dtype)
        return self.weight * xf.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE on the first `rotary_dim` channels of each head.

    positions may be [T] (text) or [3, T] (MRoPE t/h/w). With mrope_section, each frequency
    takes its angle from one axis; interleaved=True assigns axes round-robin (Qwen3.5: t,h,w,t,...).
    For text, all three axes agree and this reduces to ordinary RoPE.
    """

    def __init__(
        self, rotary_dim: int, theta: float, mrope_section: list[int] | None = None,
        mrope_interleaved: bool = False, inv_freq: torch.Tensor | None = None,
    ):
        super().__init__()
        self.rotary_dim = rotary_dim
        if inv_freq is None:
            inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.mrope_section = mrope_section
        self.mrope_interleaved = mrope_interleaved

    def _axis_of_frequency(self, n: int) -> torch.Tensor:
        axis = torch.zeros(n, dtype=torch.long)
        sec = self.mrope_section
        if self.mrope_interleaved:
            for a in (1, 2):
                axis[a : sec[a] * 3 : 3] = a
        else:
            axis[sec[0] : sec[0] + sec[1]] = 1
            axis[sec[0] + sec[1] : sum(sec)] = 2
        return axis

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq.to(positions.device)
        if positions.dim() == 1:
            freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, F]
        else:
            all_axes = positions.float()[:, :, None] * inv_freq[None, None, :]  # [3, T, F]
            if self.mrope_section is None:
                freqs = all_axes[0]
            else:
                axis = self._axis_of_frequency(inv_freq.numel()).to(positions.device)
                freqs = all_axes.gather(0, axis[None, None, :].expand(1, all_axes.shape[1], -1))[0]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, R] with R <= D. Channels past R pass through unchanged."""
    r = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
