"""The fused decode-path kernels (`triton_fused`) against their torch references at 27B-like shapes.

    from bench.selfcheck_fused import check_fused
    check_fused("cuda", torch.bfloat16)   # {op: {"max_abs_diff": ..., "ref_absmax": ..., ...}}

Inputs are laid out as the model hands them over: column views of the merged projections
(GDN [qkv | z | b | a], attention [q/gate per head | k | v], MLP [gate | up]). In bf16 the
kernels round where the references do, so differences are single bf16 ulps where fp32
reassociation flips a rounding (`mismatch_frac` says how often). Also runs on CPU tensors under
TRITON_INTERPRET=1 (fp32 only: the interpreter truncates bf16 casts).
"""

from __future__ import annotations

import os
from functools import partial

import torch

from ninfer.kernels import fused

# Qwen3.6-27B text shape
Q27 = dict(hidden=5120, intermediate=17408, hq=24, hkv=4, head_dim=256, rotary=64, hk=16, hv=48, dk=128, dv=128)


def _cmp(got, ref) -> dict:
    got, ref = got.float(), ref.float()
    return {"max_abs_diff": (got - ref).abs().max().item(), "ref_absmax": ref.abs().max().item(),
            "mismatch_frac": (got != ref).float().mean().item()}


def _rand(shape, gen, dtype, device, scale=1.0, shift=0.0):
    return (torch.randn(shape, generator=gen) * scale + shift).to(dtype=dtype, device=device)


def check_fused(device="cuda", dtype=torch.bfloat16, tokens=(1, 8), seed=0, timings: bool = False) -> dict:
    """Max abs diff of every fused kernel vs its reference; with timings=True (CUDA) also the
    microseconds of kernel and reference (the reference's sum over its torch ops)."""
    from ninfer.kernels import triton_fused as tf
    from ninfer.models.layers import RotaryEmbedding

    c = Q27
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, dict] = {}

    def record(name, kernel, reference, parts=("",)):
        """kernel, reference: argument-bound calls; parts names each output when they return tuples."""
        got, ref = kernel(), reference()
        got, ref = (got, ref) if isinstance(got, tuple) else ((got,), (ref,))
        for part, g, r in zip(parts, got, ref):
            out[name + part] = _cmp(g, r)
        if timings and torch.device(device).type == "cuda":
            import triton.testing

            out[name + parts[0]]["kernel_us"] = 1e3 * triton.testing.do_bench(kernel, warmup=10, rep=50,
                                                                             return_mode="median")
            out[name + parts[0]]["reference_us"] = 1e3 * triton.testing.do_bench(reference, warmup=10, rep=50,
                                                                                return_mode="median")

    for t in tokens:
        h = c["hidden"]
        x, hh = _rand((t, h), gen, dtype, device), _rand((t, h), gen, dtype, device)
        for zc in (True, False):
            form = "qwen" if zc else "llama"
            w = _rand((h,), gen, dtype, device, 0.2, 0.0 if zc else 1.0)
            record(f"rms_norm_{form}_t{t}", partial(tf.rms_norm, x, w, 1e-6, zc),
                   partial(fused.rms_norm_ref, x, w, 1e-6, zc))
            record(f"add_rms_norm_{form}_t{t}", partial(tf.add_rms_norm, x, hh, w, 1e-6, zc),
                   partial(fused.add_rms_norm_ref, x, hh, w, 1e-6, zc), parts=("", "_residual"))

        # GDN: merged projection [qkv | z | b | a]
        conv_dim, vdim, hv = 2 * c["hk"] * c["dk"] + c["hv"] * c["dv"], c["hv"] * c["dv"], c["hv"]
        proj = _rand((t, conv_dim + vdim + 2 * hv), gen, dtype, device, 2.0)
        z = proj[:, conv_dim: conv_dim + vdim].reshape(t, hv, c["dv"])
        b, a = proj[:, conv_dim + vdim: conv_dim + vdim + hv], proj[:, conv_dim + vdim + hv:]
        o = _rand((t, hv, c["dv"]), gen, dtype, device)
        gw = _rand((c["dv"],), gen, dtype, device, 0.2, 1.0)
        record(f"gated_rms_norm_t{t}", partial(tf.gated_rms_norm, o, z, gw, 1e-6),
               partial(fused.gated_rms_norm_ref, o, z, gw, 1e-6))
        a_log = torch.empty(hv).uniform_(0.01, 16.0, generator=gen).log().to(dtype=dtype, device=device)
        dt_bias = _rand((hv,), gen, dtype, device)
        record(f"gdn_gates_t{t}", partial(tf.gdn_gates, b, a, a_log, dt_bias),
               partial(fused.gdn_gates_ref, b, a, a_log, dt_bias), parts=("_beta", "_g"))

        # attention: merged [q/gate per head | k | v], partial rotary, q/k norms, K/V written to slots
        hq, hkv, d, rdim = c["hq"], c["hkv"], c["head_dim"], c["rotary"]
        qw = hq * 2 * d
        proj = _rand((t, qw + 2 * hkv * d), gen, dtype, device)
        q, gate = proj[:, :qw].view(t, hq, 2 * d).chunk(2, dim=-1)
        k = proj[:, qw: qw + hkv * d].view(t, hkv, d)
        v = proj[:, qw + hkv * d:].view(t, hkv, d)
        positions = torch.randint(0, 200_000, (t,), generator=gen).to(device)
        cos, sin = RotaryEmbedding(rdim, 1e7).to(device).cos_sin(positions, dtype)
        qn, kn = _rand((d,), gen, dtype, device, 0.2), _rand((d,), gen, dtype, device, 0.2)
        slots = torch.randperm(4 * t + 16, generator=gen)[:t].to(device)
        caches = [torch.zeros(4 * t + 16, hkv, d, dtype=dtype, device=device) for _ in range(2)]
        ref_caches = [cc.clone() for cc in caches]
        record(f"rope_qk_norm_t{t}", partial(tf.rope_qk_write_kv, q, k, v, cos, sin, *caches, slots, qn, kn, 1e-6),
               partial(fused.rope_qk_write_kv_ref, q, k, v, cos, sin, *ref_caches, slots, qn, kn, 1e-6),
               parts=("_q",))
        out[f"rope_qk_norm_t{t}_k_cache"] = _cmp(caches[0], ref_caches[0])
        out[f"rope_qk_norm_t{t}_v_cache"] = _cmp(caches[1], ref_caches[1])
        attn = _rand((t, hq, d), gen, dtype, device)
        record(f"sigmoid_gate_mul_t{t}", partial(tf.sigmoid_gate_mul, attn, gate),
               partial(fused.sigmoid_gate_mul_ref, attn, gate))
        # Llama-3-8B form: no norms, full rotary, q/k/v packed [q | k | v]
        lq, lkv, ld = 32, 8, 128
        proj = _rand((t, (lq + 2 * lkv) * ld), gen, dtype, device)
        lq_, lk_, lv_ = (p.view(t, -1, ld) for p in proj.split([lq * ld, lkv * ld, lkv * ld], dim=-1))
        lcos, lsin = RotaryEmbedding(ld, 5e5).to(device).cos_sin(positions, dtype)
        caches = [torch.zeros(4 * t + 16, lkv, ld, dtype=dtype, device=device) for _ in range(2)]
        ref_caches = [cc.clone() for cc in caches]
        record(f"rope_llama_t{t}", partial(tf.rope_qk_write_kv, lq_, lk_, lv_, lcos, lsin, *caches, slots),
               partial(fused.rope_qk_write_kv_ref, lq_, lk_, lv_, lcos, lsin, *ref_caches, slots), parts=("_q",))
        out[f"rope_llama_t{t}_k_cache"] = _cmp(caches[0], ref_caches[0])

        # MLP: merged [gate | up]
        i = c["intermediate"]
        gu = _rand((t, 2 * i), gen, dtype, device, 2.0)
        record(f"silu_and_mul_t{t}", partial(tf.silu_and_mul, gu[:, :i], gu[:, i:]),
               partial(fused.silu_and_mul_ref, gu[:, :i], gu[:, i:]))

        # MoE block output (35B-A3B: hidden 2048): routed + sigmoid(shared gate) * shared, the gate a
        # column of the merged [router | shared gate | ...] projection
        mh, experts = 2048, 256
        routed, shared = _rand((t, mh), gen, dtype, device), _rand((t, mh), gen, dtype, device)
        sgate = _rand((t, experts + 1), gen, dtype, device, 2.0)[:, experts:]
        record(f"shared_expert_add_t{t}", partial(tf.shared_expert_add, routed, shared, sgate),
               partial(fused.shared_expert_add_ref, routed, shared, sgate))
    return out


def check_model_logits(device="cuda", dtype=torch.bfloat16, name="tiny-qwen3.6") -> dict:
    """A preset's fused model (merged projections): logits of a ragged prefill and a decode step with
    every CUDA kernel (ours, fla) against NINFER_KERNELS=reference, and the merged model against the
    unmerged one (reference kernels: the matmul concatenation alone)."""
    from ninfer.artifact.presets import instantiate
    from ninfer.forward import ForwardBatch, ModelCache

    merged = instantiate(name, device, dtype, seed=0)
    plain = instantiate(name, device, dtype, seed=0, fuse=False)

    @torch.inference_mode()
    def logits(model):
        cache = ModelCache(model.cache_spec(), 16, 16, 4, dtype, device)
        outs = []
        first = ForwardBatch.build([[5, 77, 301, 9, 64, 2, 480], [11, 250, 3]], [0, 0], [[0, 1], [2, 3]], 16,
                                   state_slots=[1, 3], device=device)
        outs.append(model.compute_logits(model(first, cache)[first.last_token_indices()]))
        step = ForwardBatch.build([[42], [7]], [7, 3], [[0, 1], [2, 3]], 16, state_slots=[1, 3], device=device)
        outs.append(model.compute_logits(model(step, cache)[step.last_token_indices()]))
        return torch.cat(outs).float()

    previous = os.environ.get("NINFER_KERNELS")
    try:
        os.environ["NINFER_KERNELS"] = "reference"
        ref, ref_plain = logits(merged), logits(plain)
    finally:
        if previous is None:
            os.environ.pop("NINFER_KERNELS", None)
        else:
            os.environ["NINFER_KERNELS"] = previous
    got = logits(merged)
    return {"kernels_vs_reference": (got - ref).abs().max().item(),
            "argmax_equal": bool((got.argmax(-1) == ref.argmax(-1)).all()),
            "merged_vs_unmerged_reference": (ref - ref_plain).abs().max().item(),
            "ref_absmax": ref.abs().max().item()}
