"""The packed-fp16 NVFP4 GEMV (ninfer/kernels/triton_nvfp4.py) on the CPU: its inline PTX run by
ninfer.kernels.ptx_emulator against the E2M1 table (the bit tricks that decode codes to fp16 pairs,
and the x pairing), then the whole kernel under Triton's interpreter against the torch reference,
so both are checked on every run, not only on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_markers import needs_interpreter

from ninfer.kernels.ptx_emulator import halves, run_ptx
from ninfer.quant.nvfp4 import dequantize_nvfp4, e2m1_table, quantize_nvfp4

pytest.importorskip("triton")


def _bf16_pairs(x: np.ndarray) -> list[np.ndarray]:
    """x [B, 8] float32 (bf16-exact) -> its bf16 pairs (x0, x1), (x2, x3), ... as uint32."""
    bits = x.astype(np.float32).view(np.uint32) >> 16
    return [bits[:, 2 * j] | (bits[:, 2 * j + 1] << 16) for j in range(4)]


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_block_dot_ptx_matches_the_e2m1_table(rows):
    from ninfer.kernels import triton_nvfp4

    rng = np.random.default_rng(rows)
    n = 4096
    words = rng.integers(0, 2**32, size=(n, 2), dtype=np.uint64).astype(np.uint32)
    words[:16] = 0x88888888  # every code -0
    words[16:32] = 0xF7F7F7F7  # -6 and +6
    codes = np.stack([(words[:, w] >> (4 * p)) & 0xF for w in range(2) for p in range(8)], axis=1)  # [n, 16]
    values = e2m1_table().double().numpy()[codes]
    operands = [words[:, 0], words[:, 1]]
    xs = []
    for _ in range(rows):
        x = (rng.standard_normal((n, 16)) * rng.choice([1e-3, 1.0, 50.0], size=(n, 1))).astype(np.float32)
        x = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)  # bf16 values
        xs.append(x)
        for half in (x[:, :8], x[:, 8:]):  # the kernel's x pairs, through the x-pair PTX
            operands += run_ptx(triton_nvfp4._X_PAIRS.value, _bf16_pairs(half), 4)
    outs = run_ptx(triton_nvfp4._block_dot_asm(rows), operands, rows)
    for r in range(rows):
        x16 = xs[r].astype(np.float16).astype(np.float64)
        ref = (values * x16).sum(axis=1) * 2.0**-14
        got = outs[r].view(np.float32).astype(np.float64)
        scale = (np.abs(values) * np.abs(x16)).sum(axis=1) * 2.0**-14
        # fp16 products, 8-term sums and their sum: a few units of 2^-11 of the absolute sum,
        # plus fp16's subnormal spacing (2^-24) per term
        assert np.all(np.abs(got - ref) <= 4e-3 * scale + 16 * 2.0**-24), r
        assert np.array_equal(got[:16], np.zeros(16))


def test_x_pairs_ptx_pairs_and_saturates():
    from ninfer.kernels import triton_nvfp4

    x = np.array([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 1e5]], dtype=np.float32)
    pairs = run_ptx(triton_nvfp4._X_PAIRS.value, _bf16_pairs(x), 4)
    got = [tuple(float(h[0]) for h in halves(p)) for p in pairs]
    # (x0, x2), (x4, x6), (x1, x3), (x5, x7), x7 saturated to fp16's largest finite value
    assert got == [(1.0, 3.0), (5.0, 7.0), (2.0, 4.0), (6.0, 65504.0)]


@needs_interpreter
@pytest.mark.parametrize("m", [1, 2, 3, 4, 6])  # 6: two passes, four rows then two
def test_hfma_kernel_matches_the_reference_in_the_interpreter(m):
    """Ragged N and K (N = 20: not a multiple of 8 rows; K = 1040: 130 words, not a multiple of the
    64-word step), tiny block scales, an all-zero block; bf16 x as on the GPU."""
    from ninfer.kernels import triton_nvfp4

    gen = torch.Generator().manual_seed(m)
    n, k = 20, 1040
    w = torch.randn(n, k, generator=gen) * 0.02
    w[1] *= 1e-5  # E4M3 subnormal block scales
    w[2, :32] = 0.0
    q = quantize_nvfp4(w)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    ref = x.float() @ dequantize_nvfp4(*q).T
    for cfg in (None,  # the shape table's tiles (M > 4: each pass its own)
                dict(kind="hfma", BLOCK_N=8, BLOCK_W=64, num_warps=1),
                dict(kind="hfma", BLOCK_N=4, BLOCK_W=128, num_warps=2)):
        got = triton_nvfp4.nvfp4_gemv(x, *q, config=cfg).float()
        # fp16 products and sums, then bf16 output rounding
        assert (got - ref).abs().max().item() <= 1e-2 * ref.abs().max().item(), cfg
