"""The CPU decode step of Llama-family models as one flat loop (issue 23).

On the CPU a SmolLM2 decode step is ~30 ms of which the matmuls are ~12: the rest is the per-op cost of
~3,000 small torch calls and the Python around them (module calls, attribute lookups, dispatch helpers).
`DecodePlan` gathers what each layer needs once (norm weights, the merged projections' matmuls as plain
callables, head counts) and runs a decode batch's layers in one loop with a third of the calls.

It computes exactly what the module path computes on the CPU, op for op in the same order and dtypes
(`fused.add_rms_norm_ref`, `fused.rope_qk_write_kv_ref`, `paged_attention_ref`, `fused.silu_and_mul_ref`):
RoPE on q and k runs as one pass over their adjacent columns of the merged projection, the norm's
mean-square through `F.rms_norm` (bitwise the reference's), and KV is written by slot without the padding
check (a decode batch has none). tests/test_llama_cpu.py checks the two paths against each other.

With int8 weights (`--dtype int8`) and a bf16, int8, nvfp4 or k8v4 cache the whole step instead runs in C
(ninfer.kernels.cpu_native: one call a step, fp32 arithmetic inside), where a C compiler is present:
~6 ms a step at a 128-token context on 2 cores against ~23 for this loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.forward import ForwardBatch, ModelCache
from ninfer.kernels.attention import cpu_decode_rows
from ninfer.kernels.cpu_native import NativeLlamaDecode
from ninfer.kernels.fused import rotate_half

Matmul = Callable[[torch.Tensor], torch.Tensor]


def plain_matmul(module: nn.Module, dtype: torch.dtype) -> Matmul:
    """The module's forward as a bare torch call where it is a plain linear (an nn.Linear, its decode subclass,
    or an int8 weight-only linear fed bf16 rows), else the module itself."""
    from ninfer.kernels.linear import DecodeLinear
    from ninfer.quant.int8_cpu import Int8Linear

    if type(module) in (nn.Linear, DecodeLinear):  # DecodeLinear is F.linear off CUDA
        weight, bias = module.weight, module.bias
        return lambda x: F.linear(x, weight, bias)
    if type(module) is Int8Linear and module.bias is None and dtype == torch.bfloat16:
        weight, scale = module.weight_int8, module.scale
        return lambda x: torch.ops.aten._weight_int8pack_mm(x, weight, scale)
    return module


def _merged(owner: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    """owner's merged projection whose consecutive column blocks are `names`' outputs, in order; else None."""
    plan = owner.__dict__.get("_proj_plan") or {}
    entries = [plan.get(n) for n in names]
    if not all(entries) or len({e[0] for e in entries}) != 1:
        return None
    at = 0
    for _, start, size in entries:
        if start != at:
            return None
        at += size
    return getattr(owner, entries[0][0])


@dataclass
class LayerPlan:
    index: int
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Matmul
    o: Matmul
    gate_up: Matmul
    down: Matmul
    modules: tuple[nn.Module, ...]  # qkv, o, gate_up, down: what the native step reads


class DecodePlan:
    """One model's CPU decode step (see the module docstring). `build` returns None for a model this loop does
    not cover (projections not merged, a norm of another form): the module path then runs."""

    def __init__(self, layers: list[LayerPlan], final_norm: torch.Tensor, eps: float, heads: int, kv_heads: int,
                 head_dim: int, intermediate: int, scale: float):
        self.layers = layers
        self.final_norm = final_norm
        self.eps = eps
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.intermediate = intermediate
        self.scale = scale
        self.native: NativeLlamaDecode | None = None  # the C step, where it applies (int8 weights)

    @classmethod
    def build(cls, model: nn.Module) -> "DecodePlan | None":
        dtype = model.embed_tokens.weight.dtype
        layers = []
        norms = [model.norm]
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = _merged(attn, ("q_proj", "k_proj", "v_proj"))
            gate_up = _merged(mlp, ("gate_proj", "up_proj"))
            if qkv is None or gate_up is None:
                return None
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
            layers.append(LayerPlan(i, layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                                    plain_matmul(qkv, dtype), plain_matmul(attn.o_proj, dtype),
                                    plain_matmul(gate_up, dtype), plain_matmul(mlp.down_proj, dtype),
                                    (qkv, attn.o_proj, gate_up, mlp.down_proj)))
        if any(n.zero_centered or n.eps != model.norm.eps for n in norms):
            return None
        first = model.layers[0].self_attn
        plan = cls(layers, model.norm.weight, model.norm.eps, first.num_heads, first.num_kv_heads, first.head_dim,
                   model.layers[0].mlp.down_proj.in_features, first.scale)
        plan.native = NativeLlamaDecode.build(plan)
        return plan

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # fused.rms_norm_ref (Llama form): w * (x_hat in fp32).to(x's dtype)
        return weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)

    def takes(self, cache: ModelCache) -> bool:
        """Whether this loop runs a decode step on `cache`: an unquantized one, or any the C step reads (int8 and NVFP4
        KV; the torch loop below writes unquantized K/V only)."""
        return cache.k_scale is None or (self.native is not None and self.native.takes(cache))

    def run(self, x: torch.Tensor, positions: torch.Tensor, rotary, batch: ForwardBatch,
            cache: ModelCache) -> torch.Tensor:
        """x: the decode rows' embeddings [B, H]; positions [B]. Returns the final-normed hidden states."""
        if self.native is not None and self.native.takes(cache):
            cos, sin = rotary.cos_sin(positions, torch.float32)
            return self.native.run(x, cos, sin, batch, cache)
        cos, sin = rotary.cos_sin(positions, x.dtype)
        t, hq, hkv, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        qk_cols, inter = (hq + hkv) * d, self.intermediate
        cos, sin = cos[:, None, :], sin[:, None, :]
        slots, page_size = batch.slot_mapping, cache.page_size
        residual = None
        for layer in self.layers:
            residual = x if residual is None else residual + x
            qkv = layer.qkv(self._norm(residual, layer.input_norm))
            qk = qkv[:, :qk_cols].view(t, hq + hkv, d)
            qk = qk * cos + rotate_half(qk) * sin  # fused.apply_rotary over q's and k's heads at once
            k_cache, v_cache = cache.k[layer.index], cache.v[layer.index]
            k_cache.index_copy_(0, slots, qk[:, hq:])
            v_cache.index_copy_(0, slots, qkv[:, qk_cols:].view(t, hkv, d))
            out = cpu_decode_rows(qk[:, :hq], k_cache, v_cache, batch, page_size, self.scale)
            residual = residual + layer.o(out.view(t, hq * d))
            gate_up = layer.gate_up(self._norm(residual, layer.post_norm))
            x = layer.down(F.silu(gate_up[:, :inter].contiguous()) * gate_up[:, inter:])
        return self._norm(residual + x, self.final_norm)
