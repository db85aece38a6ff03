"""Fused decode-path kernels and projection fusion.

- With triton and TRITON_INTERPRET=1: every kernel of `ninfer.kernels.triton_fused` on CPU tensors
  (fp32: the interpreter's bf16 casts truncate, so bf16 rounding points are checked on the GPU by
  `bench.selfcheck_fused`) against its torch reference in `ninfer.kernels.fused`, at small
  and odd shapes, on strided views like those a merged projection hands out; and whole tiny models
  with the fused ops on Triton against the same models on the references.
- Always (CPU): `fuse_projections_` leaves model outputs and state-dict names unchanged (llama,
  qwen dense, qwen MoE), fusing twice is a no-op, quantized-style linears merge through their
  `concat`, mixed types merge by type, and the loader and presets hand out fused models.
"""

from __future__ import annotations

import copy

import pytest
import torch
from kernel_markers import needs_interpreter
from torch import nn

from ninfer.forward import ForwardBatch, ModelCache
from ninfer.kernels import fused
from ninfer.models.layers import RMSNorm, SwiGLU, fuse_projections_, merge_linears, project

ATOL = 2e-6  # fp32 kernels vs references: reassociation only, values O(1)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def _tf():
    from ninfer.kernels import triton_fused

    return triton_fused


# ---- kernels vs references (interpreter) ------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("zero_centered", [True, False])
@pytest.mark.parametrize("rows,n", [(1, 64), (5, 37), (3, 1000)])
def test_rms_norm_and_add_rms_norm(rows, n, zero_centered):
    g = _gen(rows * n)
    big = torch.randn(rows, 2 * n + 3, generator=g)
    x, h = big[:, :n], big[:, n + 3:]  # strided rows
    w = 0.2 * torch.randn(n, generator=g) + (0.0 if zero_centered else 1.0)
    tf = _tf()
    assert _diff(tf.rms_norm(x, w, 1e-6, zero_centered), fused.rms_norm_ref(x, w, 1e-6, zero_centered)) < ATOL
    y, res = tf.add_rms_norm(x, h, w, 1e-6, zero_centered)
    y_ref, res_ref = fused.add_rms_norm_ref(x, h, w, 1e-6, zero_centered)
    assert torch.equal(res, res_ref)
    assert _diff(y, y_ref) < ATOL


@needs_interpreter
@pytest.mark.parametrize("tokens,heads,d", [(1, 4, 32), (3, 7, 24), (2, 3, 128)])
def test_gated_rms_norm(tokens, heads, d):
    g = _gen(tokens * heads)
    x = torch.randn(tokens, heads, d, generator=g)
    merged = torch.randn(tokens, 5 + 2 * heads * d, generator=g)  # z as a column slice of a merged projection
    z = merged[:, 5: 5 + heads * d].reshape(tokens, heads, d)
    w = 1 + 0.2 * torch.randn(d, generator=g)
    assert _diff(_tf().gated_rms_norm(x, z, w, 1e-6), fused.gated_rms_norm_ref(x, z, w, 1e-6)) < ATOL


@needs_interpreter
@pytest.mark.parametrize("tokens,hv", [(1, 4), (5, 10), (2, 48)])
def test_gdn_gates(tokens, hv):
    g = _gen(hv)
    merged = 4 * torch.randn(tokens, 3 * hv + 7, generator=g)
    b, a = merged[:, 7: 7 + hv], merged[:, 7 + 2 * hv:]
    a[0, 0], a[-1, -1] = 30.0, -40.0  # both sides of softplus's threshold; a tiny log1p
    a_log = torch.empty(hv).uniform_(0.01, 16.0, generator=g).log()
    dt_bias = torch.randn(hv, generator=g)
    beta, gg = _tf().gdn_gates(b, a, a_log, dt_bias)
    beta_ref, g_ref = fused.gdn_gates_ref(b, a, a_log, dt_bias)
    assert gg.dtype == torch.float32 and beta.dtype == b.dtype
    assert _diff(beta, beta_ref) < ATOL
    assert ((gg - g_ref).abs() <= 1e-6 * (1 + g_ref.abs())).all()


@needs_interpreter
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("hq,hkv,d,r,gated,norm", [
    (4, 2, 64, 16, True, True),  # Qwen3.6 layout: [q | gate] per head, partial rotary, q/k norms
    (3, 1, 24, 8, True, True),  # odd head count, non-power-of-two head_dim
    (4, 2, 16, 16, False, False),  # Llama: full rotary, no norms
    (2, 2, 20, 20, False, False),
])
def test_rope_qk_write_kv(tokens, hq, hkv, d, r, gated, norm):
    g = _gen(hq * d + tokens)
    qw = hq * d * (2 if gated else 1)
    proj = torch.randn(tokens, qw + 2 * hkv * d, generator=g)  # merged q(|gate)/k/v output
    q = proj[:, :qw].view(tokens, hq, -1)[..., :d]
    k = proj[:, qw: qw + hkv * d].view(tokens, hkv, d)
    v = proj[:, qw + hkv * d:].view(tokens, hkv, d)
    angles = torch.randn(tokens, r // 2, generator=g) * 50
    emb = torch.cat([angles, angles], -1)
    cos, sin = emb.cos(), emb.sin()
    weights = (0.2 * torch.randn(d, generator=g), 0.2 * torch.randn(d, generator=g)) if norm else (None, None)
    slots = torch.tensor([7, 2, 11][:tokens])
    caches = [torch.randn(13, hkv, d, generator=g) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    out = _tf().rope_qk_write_kv(q, k, v, cos, sin, *caches, slots, *weights, 1e-6)
    ref = fused.rope_qk_write_kv_ref(q, k, v, cos, sin, *ref_caches, slots, *weights, 1e-6)
    assert out.is_contiguous()
    assert _diff(out, ref) < ATOL
    assert _diff(caches[0], ref_caches[0]) < ATOL
    assert torch.equal(caches[1], ref_caches[1])  # v is copied as is; other slots untouched


@needs_interpreter
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_rope_qk_quantized_cache_goes_through_write_kv(kv_dtype):
    """1-byte KV caches are not stored into by the kernel: k comes out and `write_kv` quantizes it."""
    import inspect

    if "kv_dtype" not in inspect.signature(ModelCache).parameters:
        pytest.skip("no quantized KV cache in this tree")
    from ninfer.forward import CacheSpec

    spec = CacheSpec(num_attn_layers=1, num_kv_heads=2, head_dim=32)
    caches = [ModelCache(spec, 2, 8, 0, torch.float32, kv_dtype=kv_dtype) for _ in range(2)]
    g = _gen(5)
    proj = torch.randn(3, 4 * 2 * 32 + 2 * 2 * 32, generator=g)
    q = proj[:, :256].view(3, 4, 64)[..., :32]
    k, v = proj[:, 256:320].view(3, 2, 32), proj[:, 320:].view(3, 2, 32)
    emb = torch.randn(3, 8, generator=g).repeat(1, 2)
    w = 0.2 * torch.randn(32, generator=g)
    slots = torch.tensor([4, 9, 1])
    k0, v0, ks0, vs0 = caches[0].layer(0)
    k1, v1, ks1, vs1 = caches[1].layer(0)
    out = _tf().rope_qk_write_kv(q, k, v, emb.cos(), emb.sin(), k0, v0, slots, w, w, 1e-6, ks0, vs0)
    ref = fused.rope_qk_write_kv_ref(q, k, v, emb.cos(), emb.sin(), k1, v1, slots, w, w, 1e-6, ks1, vs1)
    assert _diff(out, ref) < ATOL
    for name in ("k_scale", "v_scale"):
        assert _diff(getattr(caches[0], name), getattr(caches[1], name)) < ATOL
    for name in ("k", "v"):
        a, b = (getattr(c, name).float() for c in caches)
        assert (a - b).abs().max().item() <= 1.0 if kv_dtype == "int8" else torch.allclose(a, b, rtol=0.07)


@needs_interpreter
@pytest.mark.parametrize("tokens,heads,d", [(1, 3, 20), (2, 4, 256)])
def test_sigmoid_gate_mul(tokens, heads, d):
    g = _gen(d)
    x = torch.randn(tokens, heads, d, generator=g)
    gate = torch.randn(tokens, heads, 2 * d, generator=g)[..., d:]
    assert _diff(_tf().sigmoid_gate_mul(x, gate), fused.sigmoid_gate_mul_ref(x, gate)) < ATOL


@needs_interpreter
@pytest.mark.parametrize("tokens,n", [(1, 37), (3, 2500)])
def test_silu_and_mul(tokens, n):
    gu = torch.randn(tokens, 2 * n, generator=_gen(n))
    gate, up = gu[:, :n], gu[:, n:]
    assert _diff(_tf().silu_and_mul(gate, up), fused.silu_and_mul_ref(gate, up)) < ATOL


@needs_interpreter
@pytest.mark.parametrize("tokens,n,dtype", [(1, 37, torch.float32), (3, 2048, torch.float32),
                                            (2, 2048, torch.bfloat16)])
def test_shared_expert_add(tokens, n, dtype):
    """The MoE block's output; in bf16 bit for bit the reference's three rounded ops."""
    g = _gen(n)
    routed, shared = (torch.randn(tokens, n, generator=g).to(dtype) for _ in range(2))
    gate = torch.randn(tokens, 9, generator=g).to(dtype)[:, 8:]  # a column of a merged projection
    got, ref = _tf().shared_expert_add(routed, shared, gate), fused.shared_expert_add_ref(routed, shared, gate)
    assert got.dtype == ref.dtype
    if dtype == torch.bfloat16:
        assert torch.equal(got, ref)
    else:
        assert _diff(got, ref) < ATOL


def test_dispatch_takes_the_reference_on_cpu(monkeypatch):
    x = torch.randn(2, 8)
    w = torch.randn(8)
    assert torch.equal(fused.rms_norm(x, w, 1e-6, True), fused.rms_norm_ref(x, w, 1e-6, True))
    monkeypatch.setenv("NINFER_KERNELS", "reference")
    assert torch.equal(fused.silu_and_mul(x, x), fused.silu_and_mul_ref(x, x))


# ---- projection fusion on whole models (CPU) ----------------------------------------------------


def _model(name: str, vocab: int = 512) -> nn.Module:
    """A preset's shape with a small vocabulary and unit-gain random weights (every path matters)."""
    from ninfer.artifact.presets import get_preset
    from ninfer.models import build_model
    from ninfer.models.qwen3_5 import GatedRMSNorm

    preset = get_preset(name)
    model = build_model(preset.architecture, {**preset.text_config(), "vocab_size": vocab}).eval()
    gen = _gen(1)
    norms = {id(m.weight): m for m in model.modules() if isinstance(m, (RMSNorm, GatedRMSNorm))}
    with torch.no_grad():
        for pname, p in model.named_parameters():
            leaf = pname.rsplit(".", 1)[-1]
            if id(p) in norms:
                zc = getattr(norms[id(p)], "zero_centered", False)
                p.copy_(0.2 * torch.randn(p.shape, generator=gen) + (0.0 if zc else 1.0))
            elif leaf == "A_log":
                p.copy_(torch.empty(p.shape).uniform_(0.01, 0.5, generator=gen).log())
            elif leaf == "dt_bias" or "conv1d" in pname:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in pname:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return model


@torch.no_grad()
def _logits(model: nn.Module) -> torch.Tensor:
    """Ragged prefill of two sequences, then two batched decode steps (fed their own greedy tokens)."""
    cache = ModelCache(model.cache_spec(), 8, 16, 4, torch.float32)
    prompts = [[5, 77, 301, 9, 64, 2, 480], [11, 250, 3]]
    tokens, cached, out = prompts, [0, 0], []
    for _ in range(3):
        batch = ForwardBatch.build(tokens, cached, [[0, 1], [2, 3]], 16, state_slots=[1, 3])
        hidden = model(batch, cache)
        logits = model.compute_logits(hidden[batch.last_token_indices()])
        out.append(logits)
        cached = [c + len(t) for c, t in zip(cached, tokens)]
        tokens = [[int(i)] for i in logits.argmax(-1)]
    return torch.cat(out)


PRESETS = ["tiny-llama", "tiny-qwen3.6", "tiny-qwen3.6-moe"]
MERGED = {
    "tiny-llama": ["layers.0.self_attn.qkv_proj", "layers.0.mlp.gate_up_proj"],
    "tiny-qwen3.6": ["layers.0.linear_attn.in_proj_qkvzba", "layers.3.self_attn.qkv_proj", "layers.0.mlp.gate_up_proj"],
    "tiny-qwen3.6-moe": ["layers.0.linear_attn.in_proj_qkvzba", "layers.3.self_attn.qkv_proj", "layers.0.mlp.in_proj"],
}


@pytest.mark.parametrize("name", PRESETS)
def test_fusion_keeps_outputs_and_state_dict(name):
    plain = _model(name)
    merged = copy.deepcopy(plain)
    layers = len(merged.layers)
    made = merged.fuse_projections_()
    assert made == 2 * layers
    for path in MERGED[name]:
        assert type(merged.get_submodule(path)) is nn.Linear
    assert not hasattr(merged.layers[0].mlp, "gate_proj" if name != "tiny-qwen3.6-moe" else "gate")
    # checkpoint names and values unchanged: the merged weights split back into their members
    sd_plain, sd_merged = plain.state_dict(), merged.state_dict()
    assert set(sd_plain) == set(sd_merged)
    assert all(torch.equal(sd_plain[k], sd_merged[k]) for k in sd_plain)
    # same outputs: fp32 GEMMs over concatenated weights (bit-identical with the CPU BLAS here)
    ref, got = _logits(plain), _logits(merged)
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    # fusing twice is a no-op
    assert merged.fuse_projections_() == 0
    assert torch.equal(_logits(merged), got)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3.6-moe"])
def test_fused_state_dict_loads_both_ways(name):
    plain = _model(name)
    merged = copy.deepcopy(plain)
    merged.fuse_projections_()
    fresh_plain = _model(name)
    fresh_plain.init_random_(7)
    fresh_plain.load_state_dict(merged.state_dict(), strict=True)  # fused -> separate modules
    fresh_merged = copy.deepcopy(fresh_plain)
    fresh_merged.init_random_(9)
    fresh_merged.fuse_projections_()
    fresh_merged.load_state_dict(plain.state_dict(), strict=True)  # separate names -> merged modules
    ref = _logits(plain)
    assert torch.equal(_logits(fresh_plain), ref)
    assert (_logits(fresh_merged) - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


class _FakeQuantLinear(nn.Module):
    """Stands in for a quantized linear: not an nn.Linear, merged only through its own `concat`."""

    concat_calls = 0

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight.clone())
        self.out_features = weight.shape[0]

    def forward(self, x):
        return x @ self.weight.t()

    @classmethod
    def concat(cls, mods):
        cls.concat_calls += 1
        return cls(torch.cat([m.weight for m in mods]))


def test_non_linear_modules_merge_through_concat_and_types_stay_apart():
    mlp = SwiGLU(16, 24)
    mlp.gate_proj, mlp.up_proj = _FakeQuantLinear(mlp.gate_proj.weight), _FakeQuantLinear(mlp.up_proj.weight)
    x = torch.randn(3, 16)
    ref = mlp(x)
    calls = _FakeQuantLinear.concat_calls
    assert fuse_projections_(mlp) == 1 and _FakeQuantLinear.concat_calls == calls + 1
    assert isinstance(mlp.gate_up_proj, _FakeQuantLinear) and torch.allclose(mlp(x), ref, atol=1e-6)

    from ninfer.models.qwen3_5 import _GDN_PROJ, QWEN3_6_SHAPES, GatedDeltaNet

    gdn = GatedDeltaNet(QWEN3_6_SHAPES["tiny-qwen3.6"], 0)
    for n in ("in_proj_qkv", "in_proj_z"):  # big ones "quantized", b/a left plain
        setattr(gdn, n, _FakeQuantLinear(getattr(gdn, n).weight))
    h = torch.randn(2, 64)
    before = [t.clone() for t in project(gdn, _GDN_PROJ, h)]
    assert fuse_projections_(gdn) == 2
    assert isinstance(gdn.in_proj_qkvzba, _FakeQuantLinear) and type(gdn.in_proj_qkvzba_1) is nn.Linear
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(project(gdn, _GDN_PROJ, h), before))


@needs_interpreter
def test_project_hands_a_separate_decode_linear_out_as_split_sums(monkeypatch):
    """An NVFP4 GDN layer's bf16 b/a projection (its own merged DecodeLinear) comes back from project(split_sums=...)
    as the skinny GEMM's unreduced partial sums, which the recurrent kernels reduce themselves; reduced they are
    what the plain projection returns, bit for bit (serving.md: speculative backends preserve protocol output, and a
    decode step must not change with the launch that computes it). Members merged with other outputs (qkv, z) and
    layers without the GEMM come back as tensors."""
    from ninfer.kernels import backend, linear
    from ninfer.kernels.linear import SplitSums, use_decode_linears_
    from ninfer.models.qwen3_5 import _GDN_PROJ, QWEN3_6_SHAPES, GatedDeltaNet

    gdn = GatedDeltaNet(QWEN3_6_SHAPES["tiny-qwen3.6"], 0)
    for n in ("in_proj_qkv", "in_proj_z"):
        setattr(gdn, n, _FakeQuantLinear(getattr(gdn, n).weight))
    fuse_projections_(gdn)
    use_decode_linears_(gdn)
    h = torch.randn(2, 64)
    plain = project(gdn, _GDN_PROJ, h)
    split = ("in_proj_b", "in_proj_a")
    assert all(isinstance(t, torch.Tensor) for t in project(gdn, _GDN_PROJ, h, split_sums=split))  # CPU: F.linear
    # the Triton GEMM under the interpreter, in fp32 (the interpreter's bf16 GEMM is not faithful)
    monkeypatch.setattr(backend, "use_triton", lambda *_: True)
    monkeypatch.setattr(linear, "_DTYPES", (torch.float32,))
    gemm = project(gdn, _GDN_PROJ, h)
    got = project(gdn, _GDN_PROJ, h, split_sums=split)
    assert all(isinstance(t, torch.Tensor) for t in got[:2]) and all(isinstance(t, SplitSums) for t in got[2:])
    assert all(torch.equal(t.total(), want) for t, want in zip(got[2:], gemm[2:]))
    assert all(torch.allclose(t.total(), want, atol=1e-5) for t, want in zip(got[2:], plain[2:]))
    # b merged with qkv (as in a bf16 model's single projection): never partial sums
    assert all(isinstance(t, torch.Tensor) for t in project(gdn, _GDN_PROJ, h, split_sums=("in_proj_b",)))


def test_merge_linears_with_bias():
    mods = [nn.Linear(8, n, bias=True) for n in (3, 5)]
    merged = merge_linears(mods)
    x = torch.randn(2, 8)
    assert torch.allclose(merged(x), torch.cat([m(x) for m in mods], -1), atol=1e-6)
    with pytest.raises(ValueError):
        merge_linears([nn.Linear(8, 3), nn.Linear(8, 3, bias=False)])


def test_loader_and_presets_fuse(tiny_qwen_path):
    from ninfer.artifact.container import Artifact
    from ninfer.artifact.presets import instantiate
    from ninfer.engine.loader import load_model

    artifact = Artifact(tiny_qwen_path)
    model = load_model(artifact, torch.device("cpu"), torch.float32)
    assert hasattr(model.layers[0].linear_attn, "in_proj_qkvzba") and hasattr(model.layers[3].self_attn, "qkv_proj")
    assert set(model.state_dict()) == set(artifact.load(("text",), device="cpu", dtype=torch.float32)["text"])
    assert hasattr(instantiate("tiny-llama", "cpu", torch.float32).layers[0].mlp, "gate_up_proj")
    assert hasattr(instantiate("tiny-llama", "cpu", torch.float32, fuse=False).layers[0].mlp, "gate_proj")


# ---- whole models with the fused ops on Triton (interpreter) ----------------------------------


@needs_interpreter
@pytest.mark.parametrize("name", PRESETS)
def test_models_with_triton_fused_ops_match_references(name, monkeypatch):
    model = _model(name)
    model.fuse_projections_()
    ref = _logits(model)
    monkeypatch.setattr(fused, "use_triton", lambda t: True)  # only the fused ops; the rest stays reference
    got = _logits(model)
    assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


@needs_interpreter
def test_selfcheck_fused_runs_at_27b_shapes():
    from bench.selfcheck_fused import check_fused

    result = check_fused("cpu", torch.float32, tokens=(1,))
    assert len(result) >= 15
    for name, r in result.items():
        assert r["max_abs_diff"] <= 1e-6 * max(1.0, r["ref_absmax"]), (name, r)
