"""Routed experts of a mixture-of-experts layer: the torch path and the module that dispatches.

- `routed_experts(x, top_ids, top_weights, gate_up_proj, down_proj)`: the torch path (any T; prefill
  on CUDA, everything on CPU): (token, choice) pairs sorted by expert, grouped GEMMs (or a per-expert
  loop where torch has none), SwiGLU, un-sorted and reduced: the reference `triton_moe` is checked against.
- `Experts`: the fused expert weights as the checkpoint stores them, whose forward takes the fused
  Triton kernels (`triton_moe.fused_experts`) for a few tokens on CUDA and `routed_experts` otherwise.
  It lives here, below the models, because the NVFP4 quantizer (`ninfer.quant.nvfp4.NVFP4Experts`,
  its quantized twin) must recognise it without importing model code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.kernels.backend import use_triton

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _can_grouped_mm(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    # torch's grouped GEMM: CPU any float, CUDA bf16 only; rows must be 16-byte aligned
    if _grouped_mm is None or not (x.device.type == "cpu" or x.dtype == torch.bfloat16):
        return False
    return all((w.shape[-1] * w.element_size()) % 16 == 0 and (w.shape[-2] * w.element_size()) % 16 == 0
               for w in weights)


def routed_experts(x: torch.Tensor, top_ids: torch.Tensor, top_weights: torch.Tensor, gate_up_proj: torch.Tensor,
                   down_proj: torch.Tensor) -> torch.Tensor:
    """The torch path of the routed experts (any T; prefill on CUDA): x [T, H]; top_ids, top_weights
    [T, k]; gate_up_proj [E, 2I, H]; down_proj [E, H, I]. Sum over each token's k experts, weighted."""
    tokens, top_k = top_ids.shape
    num_experts = gate_up_proj.shape[0]
    # (token, choice) pairs grouped by expert; group ends by searchsorted (bincount would sync on CUDA)
    sorted_ids, order = top_ids.reshape(-1).sort(stable=True)
    ends = torch.searchsorted(sorted_ids, torch.arange(num_experts, device=x.device), right=True)
    xs = x[order // top_k]
    if _can_grouped_mm(x, gate_up_proj, down_proj):
        offs = ends.to(torch.int32)
        gate, up = _grouped_mm(xs, gate_up_proj.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        ys = _grouped_mm(F.silu(gate) * up, down_proj.transpose(1, 2), offs=offs)
    else:  # per-expert loop; reads the group ends back to the host
        ys = torch.empty_like(xs)
        start = 0
        for e, end in enumerate(ends.tolist()):
            if end > start:
                gate, up = F.linear(xs[start:end], gate_up_proj[e]).chunk(2, dim=-1)
                ys[start:end] = F.linear(F.silu(gate) * up, down_proj[e])
            start = end
    # Un-sort and reduce over the k choices: deterministic, unlike an atomic index_add_
    y = torch.empty_like(ys)
    y[order] = ys
    return (y.view(tokens, top_k, -1) * top_weights[..., None]).sum(dim=1)


class Experts(nn.Module):
    """Routed experts stored fused as in the checkpoint: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, top_ids: torch.Tensor, top_weights: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; top_ids, top_weights: [T, k]. Sum over each token's k experts, weighted."""
        if use_triton(x):  # decode on CUDA: two fused Triton GEMV kernels, no sort/gather/scatter
            from ninfer.kernels import triton_moe

            if top_ids.shape[0] <= triton_moe.MAX_TOKENS:
                return triton_moe.fused_experts(x, top_ids, top_weights, self.gate_up_proj, self.down_proj)
        return routed_experts(x, top_ids, top_weights, self.gate_up_proj, self.down_proj)
