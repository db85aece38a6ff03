"""The fused decode MoE (ninfer.kernels.triton_moe) against the torch path.

On CPU the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py
without a GPU) in fp32 against `Experts.forward` / `SparseMoeBlock`'s routing. On CUDA (marker
`cuda`) the same checks in bf16 and fp32 through `selfcheck_moe.check_moe`.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from kernel_markers import HAS_TRITON, needs_cuda, needs_interpreter

from bench import selfcheck_moe

SMALL = dict(experts=8, hidden=64, intermediate=32)
TOL = 1e-5  # fp32: reassociation of 64- and 32-long dot products only
# The interpreter's cost grows with the number of programs: larger tiles than the GPU default
# (whose one-row tiles are covered once, in test_default_tiles_interpreter)
TILES = {"block_n": 8, "block_k": 32, "block_h": 16, "block_i": 16}


def _problem(tokens, top_k, experts=8, hidden=64, intermediate=32, seed=0):
    gate_up, down = selfcheck_moe.moe_weights("cpu", torch.float32, experts=experts, hidden=hidden,
                                              intermediate=intermediate, seed=seed)
    x, logits = selfcheck_moe.moe_inputs("cpu", torch.float32, tokens=tokens, experts=experts, hidden=hidden,
                                         seed=seed + 1)
    return x, logits, gate_up, down


def _assert_check(res, tokens):
    for t in tokens:
        r = res[f"T={t}"]
        assert r["route_ids_equal"], r
        assert r["route_w"] < 1e-6, r
        assert r["experts"] < TOL * max(1.0, r["experts_ref_absmax"]), r


@needs_interpreter
@pytest.mark.parametrize("top_k", [2, 4])
def test_check_moe_interpreter_fp32(top_k):
    # E = 8 with T * k up to 32 pairs: several tokens share each expert
    res = selfcheck_moe.check_moe("cpu", torch.float32, tokens=(1, 3, 8), top_k=top_k, config=TILES, **SMALL)
    _assert_check(res, (1, 3, 8))


@needs_interpreter
def test_default_tiles_interpreter():
    res = selfcheck_moe.check_moe("cpu", torch.float32, tokens=(3,), top_k=3, **SMALL)
    _assert_check(res, (3,))


@needs_interpreter
def test_route_matches_reference_order_and_dtype():
    from ninfer.kernels import triton_moe

    _, logits, _, _ = _problem(5, 3, experts=12)  # E not a power of two: padded lanes never win
    w, ids = triton_moe.route(logits[:, :12], 3, torch.float32)
    w_ref, ids_ref = selfcheck_moe.route_ref(logits, 3, torch.float32)
    assert ids.dtype == ids_ref.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(ids, ids_ref)  # descending, as torch.topk
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(w.sum(-1), torch.ones(5), rtol=1e-6, atol=1e-6)
    # a strided view (a column slice of a merged projection), weights out in bf16 (the interpreter
    # truncates fp32 -> bf16 where the GPU rounds to nearest: within one bf16 ulp)
    wide = torch.cat([torch.randn(5, 3), logits, torch.randn(5, 2)], dim=1)
    w16, ids16 = triton_moe.route(wide[:, 3:15], 3, torch.bfloat16)
    assert w16.dtype == torch.bfloat16 and torch.equal(ids16, ids_ref)
    torch.testing.assert_close(w16.float(), w_ref, rtol=2**-7, atol=0)


@needs_interpreter
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_shared_experts_and_explicit_ids(tokens):
    """Every token on the same experts (several pairs per expert), in different choice orders."""
    from ninfer.kernels import triton_moe

    top_k = 3
    x, _, gate_up, down = _problem(tokens, top_k)
    ids = torch.tensor([[5, 1, 6], [1, 6, 5], [6, 5, 1]])[torch.arange(tokens) % 3]
    w = torch.softmax(torch.randn(tokens, top_k), -1)
    ref = selfcheck_moe.experts_ref(x, ids, w, gate_up, down)
    got = triton_moe.fused_experts(x, ids, w, gate_up, down, TILES)
    torch.testing.assert_close(got, ref, rtol=TOL, atol=TOL)


@needs_interpreter
@pytest.mark.parametrize("config", [
    {"block_n": 4, "block_k": 16, "block_h": 4, "block_i": 8},  # K and I loops of several blocks
    {"block_n": 64, "block_k": 128, "block_h": 128, "block_i": 64},  # tiles larger than the problem
    {"block_n": 8, "block_k": 32, "block_h": 16, "block_i": 16, "warps_up": 2, "warps_down": 1},
])
def test_tiles_and_ragged_shapes(config):
    from ninfer.kernels import triton_moe

    # H = 40, I = 24: no tile divides them, so every mask is live
    x, logits, gate_up, down = _problem(3, 2, hidden=40, intermediate=24)
    w, ids = selfcheck_moe.route_ref(logits, 2, torch.float32)
    ref = selfcheck_moe.experts_ref(x, ids, w, gate_up, down)
    torch.testing.assert_close(triton_moe.fused_experts(x, ids, w, gate_up, down, config), ref,
                               rtol=TOL, atol=TOL)
    # x as a strided view
    xs = torch.cat([x, torch.randn(3, 8)], dim=1)[:, :40]
    torch.testing.assert_close(triton_moe.fused_experts(xs, ids, w, gate_up, down, config), ref,
                               rtol=TOL, atol=TOL)


@needs_interpreter
def test_zero_tokens():
    from ninfer.kernels import triton_moe

    x, logits, gate_up, down = _problem(0, 2)
    w, ids = triton_moe.route(logits, 2, torch.float32)
    assert w.shape == ids.shape == (0, 2)
    assert triton_moe.fused_experts(x, ids, w, gate_up, down).shape == (0, 64)


def _moe_block(seed=0):
    from ninfer.models.moe import SparseMoeBlock

    torch.manual_seed(seed)
    cfg = {"hidden_size": 64, "num_experts_per_tok": 4, "num_experts": 8, "moe_intermediate_size": 32,
           "shared_expert_intermediate_size": 32}
    block = SparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5)
    return block


@needs_interpreter
def test_block_hooks_through_dispatch(monkeypatch):
    """SparseMoeBlock with use_triton forced on (CPU tensors, interpreter): the Triton routing and,
    for T <= MAX_TOKENS, the fused experts; larger T keeps the grouped GEMMs."""
    from ninfer.kernels import moe as experts_module
    from ninfer.kernels import triton_moe
    from ninfer.models import moe

    block = _moe_block()
    calls = {"route": 0, "experts": 0}
    route, experts = triton_moe.route, triton_moe.fused_experts

    def count(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    for tokens in (1, 8, triton_moe.MAX_TOKENS + 1):
        x = torch.randn(tokens, 64)
        with torch.no_grad():
            ref = block(x)
            monkeypatch.setattr(moe, "use_triton", lambda t: True)  # SparseMoeBlock's routing
            monkeypatch.setattr(experts_module, "use_triton", lambda t: True)  # Experts.forward
            monkeypatch.setattr(triton_moe, "route", count("route", route))
            monkeypatch.setattr(triton_moe, "fused_experts", count("experts", experts))
            got = block(x)
            monkeypatch.undo()
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert calls == {"route": 3, "experts": 2}


def test_cpu_path_never_calls_triton(monkeypatch):
    """On CPU tensors the model's MoE is the torch path: the Triton module is never called."""
    import sys

    block = _moe_block()
    x = torch.randn(3, 64)
    with torch.no_grad():
        before = block(x)
    mod = sys.modules.get("ninfer.kernels.triton_moe")
    if mod is not None:
        def boom(*args, **kwargs):
            raise AssertionError("Triton MoE called for CPU tensors")
        monkeypatch.setattr(mod, "route", boom)
        monkeypatch.setattr(mod, "fused_experts", boom)
    with torch.no_grad():
        after = block(x)
    assert torch.equal(before, after)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
def test_wrappers_do_not_sync():
    """No host reads in the launch path (CUDA-graph capture would fail or stall on them)."""
    from ninfer.kernels import triton_moe

    src = "".join(inspect.getsource(f) for f in (triton_moe.route, triton_moe.fused_experts,
                                                 triton_moe.default_config))
    for banned in (".item(", ".tolist(", "nonzero", "bincount", ".cpu(", "unique", "synchronize", "masked_select"):
        assert banned not in src, banned


@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_check_moe_cuda(dtype, tol):
    if not HAS_TRITON:
        pytest.skip("triton is not importable")
    res = selfcheck_moe.check_moe("cuda", dtype, tokens=(1, 8))
    for t in (1, 8):
        r = res[f"T={t}"]
        assert r["experts"] < tol * max(1.0, r["experts_ref_absmax"]), r
        assert r["route_ids_differ_untied"] == 0, r
        assert r["route_w"] < (1e-6 if dtype == torch.float32 else 1e-2), r
        assert r["block"] < tol * 2, r


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_moe_decode_step_has_no_host_sync(cuda_graphs):
    if not HAS_TRITON:
        pytest.skip("the sync-free decode path needs the Triton backend")
    from bench import selfcheck
    from ninfer.artifact.presets import instantiate

    model = instantiate("tiny-qwen3.6-moe", "cuda", torch.bfloat16, seed=0)
    result = selfcheck.runner_sync_check(model, "cuda", torch.bfloat16, cuda_graphs=cuda_graphs)
    assert result["host_sync_in_decode_step"] == "none", result
    if cuda_graphs:
        assert result["graph_replays"] > 0, result


@pytest.mark.cuda
@needs_cuda
def test_moe_block_bf16_matches_reference_at_decode_sizes():
    """The whole SparseMoeBlock on CUDA (Triton routing + fused experts) vs NINFER_KERNELS=reference."""
    if not HAS_TRITON:
        pytest.skip("triton is not importable")
    gate_up, down = selfcheck_moe.moe_weights("cuda", torch.bfloat16, experts=64, hidden=256, intermediate=128)
    for tokens in (1, 5, 16):
        x, _ = selfcheck_moe.moe_inputs("cuda", torch.bfloat16, tokens=tokens, experts=64, hidden=256)
        assert selfcheck_moe._check_block("cuda", torch.bfloat16, x, gate_up, down, 4) < 3e-2
