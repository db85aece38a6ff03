"""Fused elementwise ops of the decode path: norms, rotary, gates. Dispatch plus torch references.

Each op is one Triton kernel (`triton_fused`) for CUDA tensors and a torch reference everywhere
else (CPU tensors, `NINFER_KERNELS=reference`, no triton): `ninfer.kernels.backend.use_triton`
picks. The references are the models' previous code, op for op, so CPU results are unchanged;
the kernels compute in fp32 and round to the model dtype at the same points as the references
(see each function), so on CUDA they differ from the references by fp32 reassociation only (the
order of the sum in a norm's mean of squares, `x * sigmoid(x)` for torch's silu, and so on).

All kernels take strided views (last dimension contiguous): the outputs of a merged projection
(`fuse_linears_` in the models' layers) are consumed where they lie, without copies. Launch
configurations depend on shapes only and nothing reads the device: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.kernels.backend import use_triton

SOFTPLUS_THRESHOLD = 20.0  # torch's default: softplus(x) = x above it


# ---------------------------------------------------------------------------------------------
# Dispatch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """RMSNorm over the last dim in fp32. zero_centered: x_hat * (1 + w) cast to x's dtype (Qwen/Gemma);
    else w * x_hat.to(x.dtype) (Llama; dtype promote(w, x))."""
    if use_triton(x):
        from ninfer.kernels import triton_fused

        return triton_fused.rms_norm(x, weight, eps, zero_centered)
    return rms_norm_ref(x, weight, eps, zero_centered)


def add_rms_norm(residual: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + h), residual + h): the sum in the residual's dtype, normalised from that rounded sum."""
    if use_triton(residual):
        from ninfer.kernels import triton_fused

        return triton_fused.add_rms_norm(residual, h, weight, eps, zero_centered)
    return add_rms_norm_ref(residual, h, weight, eps, zero_centered)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm per value head: (w * rmsnorm(x).to(dtype) * silu(z fp32)).to(dtype). x, z: [..., D]."""
    if use_triton(x):
        from ninfer.kernels import triton_fused

        return triton_fused.gated_rms_norm(x, z, weight, eps)
    return gated_rms_norm_ref(x, z, weight, eps)


def gdn_gates(b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """beta = sigmoid(b) (b's dtype), g = -exp(A_log) * softplus(a + dt_bias) (fp32). b, a: [T, Hv]."""
    if use_triton(b):
        from ninfer.kernels import triton_fused

        return triton_fused.gdn_gates(b, a, a_log, dt_bias)
    return gdn_gates_ref(b, a, a_log, dt_bias)


def rope_qk_write_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 1e-6,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention inputs: [per-head zero-centred RMSNorm of q and k (when weights are given)], rotate-half
    RoPE on the first R = cos.shape[-1] channels, k and v written to the caches at slot_mapping.

    q: [T, Hq, D]; k, v: [T, Hkv, D] (strided views are fine); cos, sin: [T, R] in the model dtype;
    caches: [S, Hkv, D], with their scales [S, Hkv] when quantized (`write_kv` quantizes).
    Returns q [T, Hq, D] contiguous.
    """
    if use_triton(q):
        from ninfer.kernels import triton_fused

        return triton_fused.rope_qk_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_weight,
                                             k_weight, eps, k_scale, v_scale)
    return rope_qk_write_kv_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_weight, k_weight, eps,
                                k_scale, v_scale)


def sigmoid_gate_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate), flattened to [T, H * D]. x, gate: [T, H, D] (gate may be a strided view)."""
    if use_triton(x):
        from ninfer.kernels import triton_fused

        return triton_fused.sigmoid_gate_mul(x, gate)
    return sigmoid_gate_mul_ref(x, gate)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (SwiGLU), both [T, I] (strided views of one gate_up output are fine)."""
    if use_triton(gate):
        from ninfer.kernels import triton_fused

        return triton_fused.silu_and_mul(gate, up)
    return silu_and_mul_ref(gate, up)


def shared_expert_add(routed: torch.Tensor, shared: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """A MoE block's output: routed + sigmoid(gate) * shared. routed, shared: [T, H]; gate: [T, 1]."""
    if use_triton(routed):
        from ninfer.kernels import triton_fused

        return triton_fused.shared_expert_add(routed, shared, gate)
    return shared_expert_add_ref(routed, shared, gate)


# ---------------------------------------------------------------------------------------------
# Torch references: the models' previous code. Strided inputs (column views of a merged projection)
# are made contiguous before a transcendental op: torch's CPU kernels take a different (vectorised
# vs scalar) exp path for them, which would move CPU results by an ulp against the unmerged model.


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (xf * (1.0 + weight.float())).to(dtype)
    return weight * xf.to(dtype)


def add_rms_norm_ref(residual, h, weight, eps, zero_centered):
    s = residual + h
    return rms_norm_ref(s, weight, eps, zero_centered), s


def gated_rms_norm_ref(x, z, weight, eps):
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(dtype) * F.silu(z.float().contiguous())).to(dtype)


def gdn_gates_ref(b, a, a_log, dt_bias):
    beta = b.contiguous().sigmoid()
    # fp32: in low precision exp(A_log) and the softplus lose the small decays that matter
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return beta, g


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


def rope_qk_write_kv_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_weight=None, k_weight=None,
                         eps=1e-6, k_scale=None, v_scale=None):
    from ninfer.kernels.attention import write_kv

    if q_weight is not None:
        q = rms_norm_ref(q, q_weight, eps, True)
    if k_weight is not None:
        k = rms_norm_ref(k, k_weight, eps, True)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    write_kv(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale)
    return q.contiguous()


def sigmoid_gate_mul_ref(x, gate):
    tokens = x.shape[0]
    return x.reshape(tokens, -1) * torch.sigmoid(gate.reshape(tokens, -1))


def silu_and_mul_ref(gate, up):
    return F.silu(gate.contiguous()) * up


def shared_expert_add_ref(routed, shared, gate):
    return routed + torch.sigmoid(gate) * shared
