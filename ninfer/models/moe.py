"""The sparse MoE block of the Qwen3.5/3.6 MoE models: router, routed experts and a gated shared expert."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ninfer.kernels import fused
from ninfer.kernels.backend import use_triton
from ninfer.kernels.moe import Experts
from ninfer.models.layers import SwiGLU, project

_MOE_PROJ = ("gate", "shared_expert_gate", "shared_expert.gate_proj", "shared_expert.up_proj")


class SparseMoeBlock(nn.Module):
    # router, shared-expert gate and the shared expert's gate/up all read x: one matmul once fused
    FUSE = {"in_proj": _MOE_PROJ}

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        hidden = cfg["hidden_size"]
        self.top_k = cfg["num_experts_per_tok"]
        self.gate = nn.Linear(hidden, cfg["num_experts"], bias=False)  # router
        self.experts = Experts(cfg["num_experts"], hidden, cfg["moe_intermediate_size"])
        self.shared_expert = SwiGLU(hidden, cfg["shared_expert_intermediate_size"])
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, shared_gate, gate, up = project(self, _MOE_PROJ, x)
        if use_triton(x):  # the same routing math in one Triton kernel (ninfer.kernels.triton_moe.route)
            from ninfer.kernels import triton_moe

            top_weights, top_ids = triton_moe.route(logits, self.top_k, x.dtype)
        else:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # over all experts, then top-k
            top_weights, top_ids = probs.topk(self.top_k, dim=-1)
            top_weights = (top_weights / top_weights.sum(-1, keepdim=True)).to(x.dtype)  # always renormalised
        routed = self.experts(x, top_ids, top_weights)
        shared = self.shared_expert.down_proj(fused.silu_and_mul(gate, up))  # = self.shared_expert(x)
        return fused.shared_expert_add(routed, shared, shared_gate)  # routed + sigmoid(shared_gate) * shared
