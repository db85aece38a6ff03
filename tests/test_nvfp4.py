"""NVFP4 weights (ninfer.quant.nvfp4, ninfer.kernels.triton_nvfp4): format, quantizer error, module,
model replacement, artifacts (synthetic and imported ModelOpt / compressed-tensors checkpoints),
the Triton kernels under TRITON_INTERPRET=1 and, with a GPU, the engine with CUDA graphs.

Stated tolerances (measured values in the comments; the bounds sit above them):
- quantizer on N(0, 1) weights: relative RMS error 0.096 -> bound 0.11; every element within one
  block-scale unit (the largest half-gap of E2M1, between 4 and 6) of the original;
- Triton kernels (interpreter, fp32) vs the torch dequantize + matmul: max abs diff <= 1e-5 * max|ref|
  (measured ~2e-7 relative); the dequantize kernel is bit-exact;
- tiny-qwen3.6 logits, NVFP4 vs its fp32 source: relative RMS error 0.16 (0.14-0.16 over three
  seeds) -> bound 0.3. (Random 8-layer model: NVFP4 noise of ~10% per weight, no outliers for the
  format to keep; its near-flat logits make top-1 agreement a noisy measure, so none is asserted.)
- on a GPU (bf16 x, 27B shapes): GEMV vs fp32 reference within bf16 output rounding (measured max
  0.031 at max|ref| 11.9; bound 1e-2 * max|ref| in the small-shape test), dequantize exact.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from kernel_markers import HAS_TRITON, needs_cuda, needs_interpreter
from safetensors.torch import save_file
from torch import nn

from ninfer.artifact.container import Artifact
from ninfer.models import prepare_for_inference_
from ninfer.quant import nvfp4
from ninfer.quant.nvfp4 import (
    NVFP4Experts,
    NVFP4Linear,
    dequantize_nvfp4,
    e2m1_table,
    pack_codes,
    quantize_model_,
    quantize_nvfp4,
    unpack_codes,
)

# ---- format and quantizer ------------------------------------------------------------------------


def _representable(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Weights that NVFP4 holds exactly: E2M1 values times E4M3 block scales, a 6 in every block (so
    the block's amax / 6 is its scale) and a global amax of 6 * 448 times a power of two."""
    gen = torch.Generator().manual_seed(seed)
    values = e2m1_table()[torch.randint(0, 16, (n, k // 16, 16), generator=gen)]
    values[:, :, 5] = 6.0
    scales = torch.tensor([448.0, 2.0, 0.25, 1.5, 2.0**-9, 96.0])[torch.randint(0, 6, (n, k // 16), generator=gen)]
    scales[0, 0] = 448.0
    return (values * scales[..., None]).view(n, k) * 2.0**-7


def test_round_trip_is_exact_on_representable_weights():
    w = _representable(48, 128)
    q = quantize_nvfp4(w)
    assert q.packed.dtype == torch.uint8 and q.packed.shape == (48, 64)
    assert q.scale.dtype == torch.float8_e4m3fn and q.scale.shape == (48, 8)
    assert q.row_scale.dtype == torch.float32 and q.row_scale.shape == (48,)
    assert torch.equal(q.row_scale, torch.full((48,), 2.0**-7))
    assert torch.equal(dequantize_nvfp4(*q), w)


def test_error_bounds_on_random_weights():
    w = torch.randn(256, 1024, generator=torch.Generator().manual_seed(1))
    q = quantize_nvfp4(w)
    err = dequantize_nvfp4(*q) - w
    assert (err.norm() / w.norm()).item() < 0.11  # measured 0.096
    # per element: at most one unit of its block's scale (half the 4..6 gap), E4M3 rounding included
    unit = (q.scale.float() * q.row_scale[:, None]).repeat_interleave(16, dim=1)
    assert (err.abs() <= unit * (1 + 1e-6)).all()
    # scaling the weight scales the row scale only: codes and block scales are the same
    q2 = quantize_nvfp4(w * 8.0)
    assert torch.equal(q2.packed, q.packed) and torch.equal(q2.scale.float(), q.scale.float())


def test_rounding_ties_to_even_and_saturates():
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.1, -0.3, -6.5, 0.26])
    assert nvfp4._e2m1_codes(v).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 0, 9, 15, 1]


def test_nibble_order_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 8, 0, 7]], dtype=torch.uint8)
    packed = pack_codes(codes)
    assert packed.tolist() == [[0x21, 0x8F, 0x70]]
    assert torch.equal(unpack_codes(packed), codes)
    # end to end: element 0 (= 0.5 * 12) in the low nibble, element 1 (= -6 * 12) in the high one
    w = torch.zeros(1, 16)
    w[0, 0], w[0, 1] = 6.0, -72.0
    q = quantize_nvfp4(w)
    assert q.packed[0, 0].item() == (0xF << 4) | 0x1 and q.packed[0, 1:].eq(0).all()


def test_negative_block_scales_become_code_signs():
    """Imported checkpoints may carry negative E4M3 block scales; the GPU kernels read scales with
    bit 7 clear, so the importer moves each negative block's sign onto its 16 codes (exact)."""
    from ninfer.quant.nvfp4 import positive_block_scales

    q = quantize_nvfp4(torch.randn(6, 64, generator=torch.Generator().manual_seed(3)))
    negative = torch.tensor([[True, False, True, False]] * 3 + [[False, True, False, True]] * 3)
    scale = (q.scale.view(torch.uint8) | negative.to(torch.uint8) * 0x80).view(torch.float8_e4m3fn)
    packed = q.packed ^ (negative.repeat_interleave(8, dim=-1).to(torch.uint8) * 0x88)
    torch.testing.assert_close(dequantize_nvfp4(packed, scale, q.row_scale), dequantize_nvfp4(*q), rtol=0, atol=0)
    got_packed, got_scale = positive_block_scales(packed, scale)
    assert not bool((got_scale.view(torch.uint8) & 0x80).any())
    assert torch.equal(got_packed, q.packed) and torch.equal(got_scale.view(torch.uint8), q.scale.view(torch.uint8))
    assert positive_block_scales(q.packed, q.scale)[0] is q.packed  # nothing to do: no copy


def test_zero_weight_and_bad_shapes():
    q = quantize_nvfp4(torch.zeros(4, 32))
    assert torch.equal(dequantize_nvfp4(*q), torch.zeros(4, 32))
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4(torch.zeros(4, 40))


# ---- module ----------------------------------------------------------------------------------


def _linear(n: int, k: int, scale: float, seed: int, bias: bool = False) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.mul_(scale)
    return lin


def test_linear_matches_its_dequantized_weight():
    lin = _linear(24, 64, 3.0, 0, bias=True)
    q = NVFP4Linear.from_linear(lin)
    x = torch.randn(5, 64)
    ref = torch.nn.functional.linear(x, q.dequantize(), lin.bias)
    torch.testing.assert_close(q(x), ref, rtol=0, atol=0)
    assert q(x.view(5, 1, 64)).shape == (5, 1, 24)


def test_concat_stacks_rows_and_keeps_each_global_scale():
    mods = [NVFP4Linear.from_linear(_linear(n, 64, s, i)) for i, (n, s) in enumerate([(16, 1.0), (8, 50.0), (4, 0.01)])]
    assert len({m.weight_row_scale[0].item() for m in mods}) == 3
    merged = NVFP4Linear.concat(mods)
    assert (merged.in_features, merged.out_features) == (64, 28)
    x = torch.randn(3, 64)
    assert torch.equal(merged(x), torch.cat([m(x) for m in mods], dim=-1))
    with pytest.raises(ValueError, match="input sizes differ"):
        NVFP4Linear.concat([mods[0], NVFP4Linear.from_linear(_linear(4, 32, 1.0, 9))])


def test_quantize_model_replaces_decoder_linears_only():
    from ninfer.artifact.presets import instantiate

    model = instantiate("tiny-qwen3.6-moe", "cpu", torch.float32, fuse=False)
    names = quantize_model_(model)
    layer0 = model.layers[0]
    assert isinstance(layer0.linear_attn.in_proj_qkv, NVFP4Linear) and isinstance(layer0.linear_attn.out_proj,
                                                                                   NVFP4Linear)
    assert type(layer0.linear_attn.in_proj_a) is nn.Linear and type(layer0.linear_attn.in_proj_b) is nn.Linear
    assert type(layer0.mlp.gate) is nn.Linear and type(layer0.mlp.shared_expert_gate) is nn.Linear
    assert isinstance(layer0.mlp.shared_expert.down_proj, NVFP4Linear)
    assert isinstance(layer0.mlp.experts, NVFP4Experts) and "layers.0.mlp.experts" in names  # routed experts
    attn = model.layers[3].self_attn
    assert all(isinstance(getattr(attn, p), NVFP4Linear) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert type(model.lm_head) is nn.Linear and type(model.embed_tokens) is nn.Embedding
    assert "layers.3.self_attn.q_proj" in names and not any("gate." in n or n.endswith(".gate") for n in names)
    prepare_for_inference_(model)  # merged groups: NVFP4 with NVFP4, bf16 with bf16
    assert isinstance(model.layers[3].self_attn.qkv_proj, NVFP4Linear)
    assert isinstance(model.layers[0].linear_attn.in_proj_qkvzba, NVFP4Linear)
    assert not isinstance(model.layers[0].linear_attn.in_proj_qkvzba_1, NVFP4Linear)  # b and a, merged
    with pytest.raises(ValueError, match="before fuse_projections_"):
        quantize_model_(model)


# ---- Triton kernels (interpreter) ---------------------------------------------------------------

KERNEL_CONFIGS = [  # tiles smaller than the GPU's so the interpreter meets ragged edges quickly
    dict(kind="fma", BLOCK_M=1, BLOCK_N=8, BLOCK_W=8, num_warps=4),
    dict(kind="fma", BLOCK_M=1, BLOCK_N=4, BLOCK_W=16, num_warps=4),
    dict(kind="dot", BLOCK_M=16, BLOCK_N=16, BLOCK_W=4, num_warps=4),
]


@needs_interpreter
@pytest.mark.parametrize("n,k", [(40, 96), (20, 528)])  # K=528: 66 words, not a multiple of any tile
def test_triton_kernels_match_the_reference(n, k):
    from ninfer.kernels import triton_nvfp4

    gen = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=gen) * 0.02
    w[1] *= 1e-5  # tiny block scales (E4M3 subnormals)
    w[2, :32] = 0.0
    q = quantize_nvfp4(w)
    wf = dequantize_nvfp4(*q)
    assert torch.equal(triton_nvfp4.nvfp4_dequantize(*q, dtype=torch.float32, rows=3, num_warps=1), wf)
    for m in (1, 2, 3, 17):  # 1 and 2: the table's packed-fp16 GEMV, here its CPU fallbacks
        x = torch.randn(m, k, generator=gen)
        ref = x @ wf.T
        tol = 1e-5 * ref.abs().max().item()
        configs = [None] if m > 16 else [c for c in KERNEL_CONFIGS if c["kind"] == "dot" or m == 1]
        for cfg in configs:
            got = triton_nvfp4.nvfp4_linear(x, *q) if cfg is None else triton_nvfp4.nvfp4_gemv(x, *q, config=cfg)
            assert (got - ref).abs().max().item() <= tol, (m, cfg)


@needs_interpreter
@pytest.mark.parametrize("n,k,tiles,warps", [(40, 1024, 1, 2), (64, 256, 2, 1), (24, 256, 1, 4)])
def test_mma_gemv_matches_the_reference(n, k, tiles, warps):
    """The register-fed tensor-core GEMV (triton_nvfp4_mma) under the interpreter, its mma.sync and
    decode run by ptx_emulator with the PTX lane layout: every M from 1 to 8, ragged N (40, 24:
    rows past N read the last row and are not stored), tiny (E4M3 subnormal) and zero block scales,
    several warps summing their K steps, a K loop longer than the steps loaded ahead (K = 1024 over
    2 warps: 8 steps). Each row of x is computed on its own, so the first rows of a larger M equal a
    smaller M's bit for bit, and how far ahead weights are loaded changes no bit."""
    from ninfer.kernels import triton_nvfp4, triton_nvfp4_mma

    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen) * 0.02
    w[1] *= 1e-5
    w[2, :48] = 0.0
    q = quantize_nvfp4(w)
    wf = dequantize_nvfp4(*q)
    cfg = dict(kind="mma", TILES=tiles, WARPS=warps)
    x = torch.randn(8, k, generator=gen).to(torch.bfloat16)
    ref = x.float() @ wf.T
    full = triton_nvfp4.nvfp4_gemv(x, *q, config=cfg)
    assert full.dtype == torch.bfloat16 and full.shape == (8, n)
    # bf16 output: half an ulp of the largest value, plus fp16 rounding of x (exact here: |x| >= 2^-14)
    assert (full.float() - ref).abs().max().item() <= 2**-8 * ref.abs().max().item()
    for m in range(1, 8):
        assert torch.equal(triton_nvfp4.nvfp4_gemv(x[:m], *q, config=cfg), full[:m]), m
    for ahead in (dict(DEPTH=1, UNROLL=1), dict(DEPTH=3, UNROLL=2)):
        assert torch.equal(triton_nvfp4.nvfp4_gemv(x, *q, config=cfg | ahead), full), ahead
    assert torch.equal(triton_nvfp4.nvfp4_gemv(x, *q, config=cfg | {"STAGES": 3}), full)
    # Weights stored paired (a lane's blocks of two steps side by side, one load for both): the same products bit
    # for bit, at every M, from the paired mma GEMV and from the dequantizing kernel; the layout round-trips
    # (serving.md "Speculative backends preserve protocol output": a speculative engine serves from this layout)
    if triton_nvfp4_mma.pairable(k, warps):
        pw = triton_nvfp4_mma.pair_weights(q[0], q[1], warps)
        assert not torch.equal(pw[0], q[0])
        back = triton_nvfp4_mma.unpair_weights(*pw, warps)
        assert torch.equal(back[0], q[0]) and torch.equal(back[1].view(torch.uint8), q[1].view(torch.uint8))
        for m in (1, 3, 8):
            for ahead in ({}, dict(DEPTH=1, UNROLL=1)):
                got = triton_nvfp4.nvfp4_gemv(x[:m], pw[0], pw[1], q[2], config=cfg | ahead, paired=warps)
                assert torch.equal(got, full[:m]), (m, ahead)
        # rows stored apart (views into wider rows: the launch takes their strides) compute the same
        from bench.selfcheck_nvfp4 import padded_rows

        wide = padded_rows((pw[0], pw[1], q[2]), 96)
        assert wide[0].stride(0) == k // 2 + 96 and wide[1].stride(0) == k // 16 + 12
        assert torch.equal(triton_nvfp4.nvfp4_gemv(x, *wide, config=cfg, paired=warps), full)
        if n % 16 == 0:  # tiled storage (each 16-row tile one contiguous run) computes the same too, and round-trips
            tw = triton_nvfp4_mma.tile_weights(pw[0], pw[1], warps)
            assert not torch.equal(tw[0], pw[0]) and not torch.equal(tw[1].view(torch.uint8), pw[1].view(torch.uint8))
            back = triton_nvfp4_mma.untile_weights(*tw, warps)
            assert torch.equal(back[0], pw[0]) and torch.equal(back[1].view(torch.uint8), pw[1].view(torch.uint8))
            for m in (1, 8):
                got = triton_nvfp4.nvfp4_gemv(x[:m], tw[0], tw[1], q[2], config=cfg | {"TILED": True}, paired=warps)
                assert torch.equal(got, full[:m]), m
            assert torch.equal(triton_nvfp4.nvfp4_dequantize(*tw, q[2], torch.float32, paired=warps, tiled=True),
                               triton_nvfp4.nvfp4_dequantize(*q, torch.float32))
        assert torch.equal(triton_nvfp4.nvfp4_dequantize(pw[0], pw[1], q[2], torch.float32, paired=warps),
                           triton_nvfp4.nvfp4_dequantize(*q, torch.float32))
    # Up to four tiles of 8 tokens share a launch (speculative verification): every token equals its
    # one-tile launch bit for bit, whatever the tile it lands in, the last tile ragged
    wide = torch.cat([x, torch.randn(19, k, generator=gen).to(torch.bfloat16)])
    got = triton_nvfp4.nvfp4_gemv(wide, *q, config=cfg)
    for r0 in range(0, 27, 8):
        assert torch.equal(got[r0:r0 + 8], triton_nvfp4.nvfp4_gemv(wide[r0:r0 + 8], *q, config=cfg)), r0
    assert torch.equal(triton_nvfp4.nvfp4_gemv(wide[:13], *q, config=cfg), got[:13])
    assert triton_nvfp4_mma.mma_fits(32, k, warps) and not triton_nvfp4_mma.mma_fits(33, k, warps)
    assert not triton_nvfp4_mma.mma_fits(3, k + 16, warps)
    with pytest.raises(ValueError, match="mma GEMV"):
        triton_nvfp4.nvfp4_gemv(torch.zeros(33, k, dtype=torch.bfloat16), *q, config=cfg)


@pytest.mark.skipif(not HAS_TRITON or importlib.util.find_spec("triton.backends.nvidia") is None,
                    reason="needs triton's NVIDIA backend (its bundled ptxas and cuobjdump)")
def test_gemv_kernels_compile_for_hopper_without_spills():
    """The interpreter runs the kernels' Python, not Triton's compiler: a construct the compiler refuses
    (s15: a conditional expression choosing between two PTX strings) or a tile that spills registers
    would first show on the device. Compiled here for sm_90 on the CPU (bench/sass_count.py) at the
    configs decode and verification launch: the packed-fp16 GEMV for 1 and 4 rows, the tensor-core
    GEMV for one to four 8-token tiles, on K-order, paired and tiled weights (one and four tiles)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    specs = ["hfma:8,128,2", "hfma:8,128,2,4", "mma:1,8", "mma:1,8,1,4", "mma:1,8,2", "mma:1,8,3", "mma:1,8,4", "mma:1,4",
             "mma:1,8,1,0,0,0,0,1", "mma:1,8,4,0,0,0,0,1",  # on paired weights
             "mma:1,8,1,0,0,0,0,1,0,1", "mma:1,8,4,0,0,0,0,1,0,1"]  # paired and tiled
    run = subprocess.run([sys.executable, str(root / "bench" / "sass_count.py"), *specs], capture_output=True,
                         text=True, env=env, cwd=root, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    kernels = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(kernels) == len(specs)
    for spec, k in zip(specs, kernels):
        assert k["local_bytes"] == 0 and k["registers"] <= 255 and k["loop_instructions"] > 0, (spec, k)


@needs_interpreter
def test_mma_start_up_check(monkeypatch):
    """The runner's start-up check (triton_nvfp4.use_mma): it passes where the kernel agrees with the
    reference (here under the interpreter); a failing check, or NINFER_NVFP4_MMA=0, leaves the
    packed-fp16 GEMV for every M and says why."""
    from ninfer.kernels import triton_nvfp4, triton_nvfp4_mma

    assert triton_nvfp4_mma.check_against_reference(torch.device("cpu")) is None
    assert triton_nvfp4_mma.check_paired(torch.device("cpu")) is None
    assert triton_nvfp4_mma.check_paired(torch.device("cpu"), tiled=True) is None
    monkeypatch.setattr(triton_nvfp4, "MMA_ENABLED", True)
    monkeypatch.setattr(triton_nvfp4, "MMA_MIN_M", triton_nvfp4.MMA_MIN_M)  # restored after the test
    # an engine that verifies drafts decodes on tensor cores from one row, so its C=1 verify rows (k + 1 of
    # them) take one mma launch and still round as its decode rows; an engine without drafts from three
    assert triton_nvfp4.use_mma(torch.device("cpu"), speculative=True) == (
        "tensor cores from 1 row (speculative decoding: verification rows round as decode rows)")
    assert triton_nvfp4._gemv_config(1, 5120, 5120)["kind"] == "mma"
    assert triton_nvfp4._decode_passes(1, 5120, 5120) == [(0, 1, dict(kind="mma", TILES=1, WARPS=8))]
    # weights stored paired take the mma GEMV at every decode size it launches (the other GEMVs read K order)
    assert all(triton_nvfp4._decode_passes(like, 5120, 5120, paired=True)
               == [(0, like, dict(kind="mma", TILES=1, WARPS=8, PAIRED=True))] for like in (1, 5, 12, 32))
    # a benchmark's launch knobs never change the warps (or staging) paired weights were stored for
    monkeypatch.setattr(triton_nvfp4, "MMA_LAUNCH", {"WARPS": 4, "STAGES": 3, "DEPTH": 1})
    assert triton_nvfp4._gemv_config(4, 5120, 5120, paired=True) == dict(kind="mma", TILES=1, WARPS=8, PAIRED=True,
                                                                          DEPTH=1)
    assert triton_nvfp4.use_mma(torch.device("cpu")) == "tensor cores from 3 rows"
    assert triton_nvfp4._gemv_config(1, 5120, 5120)["kind"] == "hfma"
    assert triton_nvfp4._gemv_config(8, 5120, 5120)["kind"] == "mma"
    monkeypatch.setattr(triton_nvfp4_mma, "check_against_reference", lambda device: "max error 1 over the bound 0.1")
    status = triton_nvfp4.use_mma(torch.device("cpu"))
    assert "failed its check: max error 1" in status and not triton_nvfp4.MMA_ENABLED
    assert triton_nvfp4._gemv_config(8, 5120, 5120)["kind"] == "hfma"
    assert triton_nvfp4.use_mma(torch.device("cpu")).startswith("packed fp16 only")  # stays off, no re-check


def _rows_like_matches_decode(device: str, n: int, k: int, cases, paired: bool = False, tiled: bool = False) -> None:
    """nvfp4_gemv_rows_like (speculative verification, kernels.linear.rows_like): in a product of
    like * width rows, position i of sequence j (row j * width + i) equals row j of the like-row decode
    GEMV of every sequence's position i, bit for bit (what keeps serving.md's "Speculative backends preserve
    protocol output" exact). paired: the weights stored paired for the mma GEMV, whose products must also equal the
    K-order weights' mma products; tiled: paired and tiled (triton_nvfp4_mma.tile_weights)."""
    from ninfer.kernels import triton_nvfp4, triton_nvfp4_mma

    gen = torch.Generator(device=device).manual_seed(n + k)
    q = quantize_nvfp4(torch.randn(n, k, generator=gen, device=device) * 0.02)
    warps = triton_nvfp4.mma_warps(k) if paired else 0
    stored = (*triton_nvfp4_mma.pair_weights(q[0], q[1], warps), q[2]) if paired else q
    if tiled:
        stored = (*triton_nvfp4_mma.tile_weights(stored[0], stored[1], warps), q[2])
    for like, width in cases:
        x = torch.randn(like * width, k, generator=gen, device=device).to(torch.bfloat16)
        got = triton_nvfp4.nvfp4_gemv_rows_like(x, *stored, like, paired=warps, tiled=tiled)
        for i in range(width):
            decode = x.view(like, width, k)[:, i]
            want = triton_nvfp4.nvfp4_gemv(decode, *stored, paired=warps, tiled=tiled)
            assert torch.equal(got.view(like, width, n)[:, i], want), (like, width, i)
            if paired:
                mma = dict(kind="mma", TILES=1, WARPS=warps)
                assert torch.equal(want, triton_nvfp4.nvfp4_gemv(decode, *q, config=mma)), (like, i)


@needs_interpreter
def test_rows_like_computes_each_row_as_its_decode_row(monkeypatch):
    """Under the interpreter: the row mapping and the passes (one packed-fp16 pass of up to 4 rows, the
    mma GEMV's launches of up to 32: 6 sequences x 4 positions in one) for 1, 2, 5 and 6 sequences; then as a
    speculative engine runs them, tensor cores from one row (1 and 2 sequences in one mma launch too), and with the
    weights stored paired for it."""
    from ninfer.kernels import triton_nvfp4

    _rows_like_matches_decode("cpu", 24, 256, [(1, 3), (2, 2), (5, 2), (6, 4)])
    monkeypatch.setattr(triton_nvfp4, "MMA_MIN_M", triton_nvfp4.SPEC_MMA_MIN_M)
    _rows_like_matches_decode("cpu", 24, 256, [(1, 4), (2, 3)])
    # K = 1024 stored paired (two steps of a lane's weights a load): verify rows as their decode rows, and as the
    # weights in K order give them
    _rows_like_matches_decode("cpu", 24, 1024, [(1, 4), (3, 2)], paired=True)
    _rows_like_matches_decode("cpu", 32, 1024, [(2, 3)], paired=True, tiled=True)  # and tiled


def test_gemv_table_takes_tensor_cores_where_the_packed_fp16_gemv_needs_two_passes(monkeypatch):
    from ninfer.kernels import triton_nvfp4 as t

    assert t.PLAIN_MMA_MIN_M == 3  # the H200 sweep: packed fp16 wins at 1 and 2 rows, tensor cores from 3
    assert t.SPEC_MMA_MIN_M == 1  # with drafts to verify: tensor cores from one row (use_mma)
    monkeypatch.setattr(t, "MMA_MIN_M", t.PLAIN_MMA_MIN_M)  # as an engine without drafts sets it
    assert all(t._gemv_config(m, 5120, 5120)["kind"] == "hfma" for m in range(1, t.MMA_MIN_M))
    assert all(t._gemv_config(m, 34816, 5120) == dict(kind="mma", TILES=1, WARPS=8) for m in range(t.MMA_MIN_M, 9))
    assert t._gemv_config(5, 40, 528)["kind"] == "hfma"  # and where K is not whole 256-code steps
    assert t._gemv_config(8, 512, 768)["WARPS"] == 4  # K = 768: whole steps of 4 warps, not of 8
    assert t._gemv_config(8, 40, 528)["kind"] == "hfma"  # K not whole steps of every warp
    assert t._gemv_config(9, 5120, 5120)["kind"] == "dot"


# ---- artifacts -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """tiny-qwen3.6 written unquantized (fp32) and as NVFP4 from the same random weights, by the CLI."""
    from ninfer.cli import main

    folder = tmp_path_factory.mktemp("nvfp4")
    paths = {}
    for weights in ("bf16", "nvfp4"):
        paths[weights] = folder / f"tiny-{weights}.ninfer"
        assert main(["convert", "synthetic", "--preset", "tiny-qwen3.6", "--weights", weights,
                     "-o", str(paths[weights])]) == 0
    return paths


TOKENS = [1, 200, 33, 4, 150, 9, 77, 1000, 5000, 20000, 7, 7, 300, 12]


@pytest.fixture(scope="module")
def nvfp4_logits(tiny_pair):
    return _logits(tiny_pair["nvfp4"])[0]


def _logits(path, tokens=TOKENS):
    from ninfer.engine.loader import load_model
    from ninfer.forward import ForwardBatch, ModelCache

    model = load_model(Artifact(path), torch.device("cpu"), torch.float32)
    cache = ModelCache(model.cache_spec(), num_pages=8, page_size=8, num_state_slots=1, dtype=torch.float32)
    batch = ForwardBatch.build([tokens], [0], [list(range(8))], 8)
    batch.logits_indices = torch.arange(len(tokens))
    with torch.no_grad():
        return model.compute_logits(model(batch, cache)), model


def test_synthetic_nvfp4_artifact_layout(tiny_pair):
    art = Artifact(tiny_pair["nvfp4"])
    q = art.manifest.quantization
    assert q["weights"] == "nvfp4" and q["group_size"] == 16 and q["text"] == "float32"
    assert "layers.0.linear_attn.in_proj_qkv" in q["modules"] and "layers.3.self_attn.o_proj" in q["modules"]
    assert not any(m.endswith(("in_proj_a", "in_proj_b")) for m in q["modules"])
    t = art.load()["text"]
    assert t["layers.0.mlp.down_proj.weight_packed"].dtype == torch.uint8
    assert t["layers.0.mlp.down_proj.weight_scale"].dtype == torch.float8_e4m3fn
    assert t["layers.0.mlp.down_proj.weight_row_scale"].dtype == torch.float32
    assert "layers.0.mlp.down_proj.weight" not in t and "lm_head.weight" in t
    # the loader keeps fp32 row scales whatever the activation dtype
    from ninfer.engine.loader import load_model

    model = load_model(art, torch.device("cpu"), torch.bfloat16)
    assert model.layers[0].mlp.down_proj.weight_row_scale.dtype == torch.float32
    assert model.layers[0].input_layernorm.weight.dtype == torch.bfloat16


def test_nvfp4_logits_stay_close_to_the_source(tiny_pair, nvfp4_logits):
    ours = nvfp4_logits
    source, model = _logits(tiny_pair["bf16"])
    rel_rms = ((ours - source).pow(2).mean().sqrt() / source.pow(2).mean().sqrt()).item()
    assert rel_rms < 0.3, rel_rms  # measured 0.16 (seeds 0, 1, 2: 0.16, 0.15, 0.14)


def assert_engine_generates(path):
    """The artifact serves a greedy request through the engine (CPU) to its finish."""
    from ninfer.engine.engine import EngineSettings
    from ninfer.engine.loader import load_engine
    from ninfer.engine.types import EngineRequest, FinishEvent, SamplingParams, TokenEvent

    engine = load_engine(path, EngineSettings(max_context=128, max_concurrency=2, prefill_chunk=8))
    try:
        events = list(engine.generate(EngineRequest("r0", TOKENS, max_tokens=6,
                                                    sampling=SamplingParams(temperature=0.0))))
    finally:
        engine.shutdown()
    assert isinstance(events[-1], FinishEvent)
    assert len([i for e in events if isinstance(e, TokenEvent) for i in e.token_ids]) >= 1


def test_nvfp4_artifact_engine_generates(tiny_pair):
    assert_engine_generates(tiny_pair["nvfp4"])


# ---- importing NVFP4 checkpoints ---------------------------------------------------------------------


def _hf_folder(folder, tensors: dict, quant_config: dict):
    from ninfer.models.qwen3_5 import QWEN3_6_SHAPES

    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    config = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
              "text_config": dict(QWEN3_6_SHAPES["tiny-qwen3.6"]), "quantization_config": quant_config}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {},
                                                                                    "merges": []}}))
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    return folder


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_import_nvfp4_checkpoint(tmp_path, tiny_pair, nvfp4_logits, fmt):
    """A checkpoint quantized by ModelOpt or compressed-tensors (written here from our quantizer, in
    their tensor names and scale conventions) converts to the same NVFP4 tensors and logits."""
    from ninfer.artifact.convert_hf import convert_hf

    art = Artifact(tiny_pair["nvfp4"])
    ours = art.load()["text"]
    modules = art.manifest.quantization["modules"]
    tensors = {}
    for name, t in ours.items():
        module, _, leaf = name.rpartition(".")
        if module not in modules:
            tensors[f"model.language_model.{name}" if name != "lm_head.weight" else name] = t.contiguous()
            continue
        key = f"model.language_model.{module}"
        per_tensor = ours[f"{module}.weight_row_scale"][:1]  # one global scale per tensor
        if leaf == "weight_packed":
            tensors[key + (".weight" if fmt == "modelopt" else ".weight_packed")] = t
        elif leaf == "weight_scale":
            tensors[key + ".weight_scale"] = t
        elif fmt == "modelopt":
            tensors[key + ".weight_scale_2"] = per_tensor.reshape(())
            tensors[key + ".input_scale"] = torch.tensor(0.5)
        else:
            tensors[key + ".weight_global_scale"] = 1.0 / per_tensor
            tensors[key + ".input_global_scale"] = torch.tensor([3.0])
    quant = ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16} if fmt == "modelopt" else
             {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"})
    folder = _hf_folder(tmp_path / fmt, tensors, quant)
    out = convert_hf(folder, tmp_path / "imported.ninfer", dtype=torch.float32, progress=False)
    imported = Artifact(out)
    assert imported.manifest.quantization["modules"] == modules
    got = imported.load()["text"]
    for module in modules[:6]:
        assert torch.equal(got[f"{module}.weight_packed"], ours[f"{module}.weight_packed"])
        assert torch.equal(got[f"{module}.weight_scale"].float(), ours[f"{module}.weight_scale"].float())
        torch.testing.assert_close(got[f"{module}.weight_row_scale"], ours[f"{module}.weight_row_scale"],
                                   rtol=1e-6, atol=0)
    assert not any(k.endswith(("input_scale", "input_global_scale", "weight_scale_2", "weight_global_scale"))
                   for k in got)
    imported_logits, model = _logits(out)
    assert isinstance(model.layers[3].self_attn.qkv_proj, NVFP4Linear)  # loaded as NVFP4, then merged
    torch.testing.assert_close(imported_logits, nvfp4_logits, rtol=0, atol=1e-5)
    if fmt == "modelopt":  # --weights bf16 dequantizes the checkpoint instead
        plain = convert_hf(folder, tmp_path / "plain.ninfer", dtype=torch.float32, progress=False, weights="bf16")
        assert "weights" not in Artifact(plain).manifest.quantization
        torch.testing.assert_close(_logits(plain)[0], nvfp4_logits, rtol=0, atol=1e-4)


def test_convert_hf_quantizes_a_bf16_checkpoint(tmp_path, tiny_pair, nvfp4_logits):
    from ninfer.artifact.convert_hf import convert_hf

    src = Artifact(tiny_pair["bf16"]).load()["text"]
    tensors = {(f"model.language_model.{k}" if k != "lm_head.weight" else k): v.contiguous() for k, v in src.items()}
    folder = _hf_folder(tmp_path / "plain", tensors, {})
    out = convert_hf(folder, tmp_path / "q.ninfer", dtype=torch.float32, progress=False, weights="nvfp4")
    assert Artifact(out).manifest.quantization["modules"] == Artifact(tiny_pair["nvfp4"]).manifest.quantization[
        "modules"]
    torch.testing.assert_close(_logits(out)[0], nvfp4_logits, rtol=0, atol=1e-5)


# ---- GPU -------------------------------------------------------------------------------------


@pytest.mark.cuda
@needs_cuda
def test_kernels_on_cuda_bf16():
    if not HAS_TRITON:
        pytest.skip("triton is not importable")
    from bench import selfcheck_nvfp4

    shapes = {"small": (384, 1040), "wide": (4096, 512)}
    result = selfcheck_nvfp4.check_nvfp4("cuda", torch.bfloat16, shapes=shapes)
    for key, diff in result["max_abs_diff"].items():
        bound = 0.0 if key.endswith("dequant") else 1e-2 * result["ref_absmax"]
        assert diff <= bound, (key, diff, result["ref_absmax"])


@pytest.mark.cuda
@needs_cuda
def test_mma_tiles_on_cuda():
    """Every tensor-core GEMV tile the sweep times (selfcheck_nvfp4.MMA_CONFIGS) against the reference
    at M = 1..8 on the device (the lane layout the kernel assumes is Triton's, checked only here), and
    each row of x computed on its own: the first rows of M = 8 equal smaller M's bit for bit."""
    if not HAS_TRITON:
        pytest.skip("triton is not importable")
    from bench import selfcheck_nvfp4
    from ninfer.kernels import triton_nvfp4

    n, k = 1000, 2048  # ragged N for every tile (16, 32, 64 rows per program)
    gen = torch.Generator(device="cuda").manual_seed(7)
    w = torch.randn(n, k, generator=gen, device="cuda") * 0.02
    w[1] *= 1e-5
    q = nvfp4.quantize_nvfp4(w)
    x = torch.randn(8, k, generator=gen, device="cuda").to(torch.bfloat16)
    ref = x.float() @ nvfp4.dequantize_nvfp4(*q).T
    for cfg in selfcheck_nvfp4.MMA_CONFIGS:
        full = triton_nvfp4.nvfp4_gemv(x, *q, config=cfg)
        assert (full.float() - ref).abs().max().item() <= 2**-8 * ref.abs().max().item(), cfg
        for m in range(1, 8):
            assert torch.equal(triton_nvfp4.nvfp4_gemv(x[:m], *q, config=cfg), full[:m]), (cfg, m)


@pytest.mark.cuda
@needs_cuda
def test_mma_register_caps_change_no_bit_on_cuda(monkeypatch):
    """A register cap (MAXNREG) and the launch keys for few-program grids and 3-4 token tiles
    (NINFER_NVFP4_MMA_FEW / _WIDE: another weight queue depth, a cap) compute every row bit for bit as the
    table's launch, on tiled weights at 1..32 rows (s36)."""
    if not HAS_TRITON:
        pytest.skip("triton is not importable")
    from ninfer.kernels import triton_nvfp4, triton_nvfp4_mma

    n, k = 320, 8192  # 20 programs: a few-program grid on any GPU
    warps = triton_nvfp4.mma_warps(k)
    gen = torch.Generator(device="cuda").manual_seed(36)
    q = nvfp4.quantize_nvfp4(torch.randn(n, k, generator=gen, device="cuda") * 0.02)
    tw = triton_nvfp4_mma.tile_weights(*triton_nvfp4_mma.pair_weights(q[0], q[1], warps), warps)
    x = torch.randn(32, k, generator=gen, device="cuda").to(torch.bfloat16)
    cfg = dict(kind="mma", TILES=1, WARPS=warps, PAIRED=True, TILED=True)

    def run(m: int, extra: dict | None = None) -> torch.Tensor:
        return triton_nvfp4.nvfp4_gemv(x[:m], tw[0], tw[1], q[2], config=cfg | (extra or {}), paired=warps,
                                       tiled=True)

    table = {m: run(m) for m in (1, 4, 8, 24, 32)}
    ref = x.float() @ nvfp4.dequantize_nvfp4(*q).T
    assert (table[32].float() - ref).abs().max().item() <= 2**-8 * ref.abs().max().item()
    for m, want in table.items():
        assert torch.equal(run(m, {"MAXNREG": 80 if m <= 8 else 128}), want), m
    monkeypatch.setattr(triton_nvfp4_mma, "FEW_PROGRAMS", {"DEPTH": 1, "MAXNREG": 80})
    monkeypatch.setattr(triton_nvfp4_mma, "WIDE_TILES", {"DEPTH": 2, "MAXNREG": 128})
    for m, want in table.items():
        assert torch.equal(run(m), want), m


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("n,k,m", [(320, 8704, 1), (256, 4352, 2), (320, 8704, 2)])
def test_prefetch_tiles_on_cuda(n, k, m):
    """The table's tiles for long rows (L2 prefetch at K > 8192 and M = 1, K >= 4096 and M = 2) and a
    deeper prefetch than the table uses: prefetches only warm L2, so results equal the tiles without."""
    if not HAS_TRITON:
        pytest.skip("triton is not importable")
    from ninfer.kernels import triton_nvfp4

    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    q = nvfp4.quantize_nvfp4(torch.randn(n, k, generator=gen, device="cuda") * 0.02)
    x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
    table = triton_nvfp4._gemv_config(m, n, k)
    plain = triton_nvfp4.nvfp4_gemv(x, *q, config=table | {"PREFETCH": 0})
    assert torch.equal(triton_nvfp4.nvfp4_gemv(x, *q), plain)
    assert torch.equal(triton_nvfp4.nvfp4_gemv(x, *q, config=table | {"PREFETCH": 4}), plain)
    ref = x.float() @ nvfp4.dequantize_nvfp4(*q).T
    assert (plain.float() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("n,k", [(1000, 2048), (1008, 2048), (320, 8704)])
def test_rows_like_on_cuda(n, k):
    """On the device (whose kernels' lane layouts and reductions are the real ones): verify rows equal
    their decode rows bit for bit for 1..8 sequences and up to 8 positions (k = 7 drafts); where K allows, also
    with the weights stored paired, as a speculative engine stores them (and equal to K order's products), and
    where N allows, paired and tiled."""
    if not HAS_TRITON:
        pytest.skip("triton is not importable")
    from ninfer.kernels import triton_nvfp4, triton_nvfp4_mma

    cases = [(1, 2), (1, 4), (1, 8), (2, 4), (3, 4), (4, 4), (6, 4), (8, 4), (8, 8)]
    _rows_like_matches_decode("cuda", n, k, cases)
    if triton_nvfp4_mma.pairable(k, triton_nvfp4.mma_warps(k)):
        _rows_like_matches_decode("cuda", n, k, cases, paired=True)
        if n % 16 == 0:
            _rows_like_matches_decode("cuda", n, k, cases, paired=True, tiled=True)


def test_nvfp4_linear_paired_for_the_mma_gemv_computes_as_before():
    """NVFP4Linear.pair_for_mma_ (a speculative engine's linears, serving.md --spec): the codes and scales move, the
    weight does not (dequantize gives it in K order, so the reference path's output is unchanged); rows too short or
    not whole pairs of steps stay in K order; a paired module cannot be merged."""
    gen = torch.Generator().manual_seed(5)
    linear = NVFP4Linear.from_weights(quantize_nvfp4(torch.randn(48, 1024, generator=gen) * 0.02))
    x = torch.randn(3, 1024, generator=gen)
    before, packed = linear(x), linear.weight_packed.clone()
    assert linear.pair_for_mma_(8) and linear.paired == 8 and not linear.pair_for_mma_(8)
    assert not torch.equal(linear.weight_packed, packed)
    assert torch.equal(linear(x), before)
    tiled = NVFP4Linear.from_weights(quantize_nvfp4(torch.randn(48, 1024, generator=gen) * 0.02))
    reference = tiled(x)
    assert tiled.pair_for_mma_(8, tiled=True) and tiled.tiled and torch.equal(tiled(x), reference)
    ragged = NVFP4Linear.from_weights(quantize_nvfp4(torch.randn(40, 1024, generator=gen) * 0.02))
    assert ragged.pair_for_mma_(8, tiled=True) and not ragged.tiled  # N not whole 16-row tiles: paired only
    short = NVFP4Linear.from_weights(quantize_nvfp4(torch.randn(8, 256, generator=gen)))
    assert not short.pair_for_mma_(4) and short.paired == 0  # one step a warp: no pair
    with pytest.raises(ValueError, match="before pair_for_mma_"):
        NVFP4Linear.concat([linear, linear])


@pytest.mark.cuda
@needs_cuda
def test_nvfp4_engine_same_greedy_with_and_without_cuda_graphs():
    if not HAS_TRITON:
        pytest.skip("graphs need the Triton backend")
    from bench import selfcheck
    from ninfer.artifact.presets import get_preset, instantiate, tokenizer_json_for
    from ninfer.tokenizer import Tokenizer

    model = instantiate("tiny-qwen3.6", "cuda", torch.bfloat16, seed=0, fuse=False)
    quantize_model_(model)
    prepare_for_inference_(model)
    tok = Tokenizer.from_json_str(tokenizer_json_for(get_preset("tiny-qwen3.6"))[0])
    prompts = [[(7 * i + 13 * j) % 900 + 50 for j in range(n)] for i, n in enumerate([3, 17, 5, 40, 9, 26, 2, 33])]
    graphs = selfcheck.engine_greedy(model, tok, "cuda", torch.bfloat16, no_cuda_graph=False, concurrency=8,
                                     prompts=prompts)
    eager = selfcheck.engine_greedy(model, tok, "cuda", torch.bfloat16, no_cuda_graph=True, concurrency=8,
                                    prompts=prompts)
    assert graphs["graph_status"].startswith("on") and graphs["graph_replays"] > 0, graphs
    assert graphs["outputs"] == eager["outputs"]
