"""Weight-only NVFP4 matmul in Triton: y[M, N] = x[M, K] @ W^T with W stored as NVFP4
(ninfer.quant.nvfp4: packed E2M1 codes, low nibble first; E4M3 scale per 16 K elements; fp32 row
scale), for Hopper, which has no FP4 tensor cores: weights are decoded in registers.

Regimes (chosen by M, which a CUDA graph fixes, so every launch depends on shapes only; no host
syncs, no data-dependent allocation):
- M <= 2 (decode of one or two streams; up to 4 where the mma GEMV cannot run): `_gemv_hfma_kernel`, CUDA cores with packed fp16
  arithmetic (inline PTX; bf16 x), below. Each program owns 4-16 weight rows and walks all of K,
  one 16-weight scale block per thread and row per step, decoded once for up to four rows of x.
  Elsewhere (fp32 x, or no GPU and no interpreter) one row runs `_gemv_fma_kernel`, which decodes
  to fp32, and more rows the tensor-core kernel. Under Triton's CPU interpreter the PTX runs
  through ninfer.kernels.ptx_emulator.
- 3 <= M <= 8 with K a multiple of 256: ninfer.kernels.triton_nvfp4_mma, tensor cores fed from
  registers (one decode for all rows); otherwise the packed-fp16 GEMV (two passes above 4 rows). In an
  engine that verifies drafts, from M = 1 (use_mma: its verify rows must round as its decode rows, and
  one mma launch takes a row's k + 1 positions where packed fp16 takes k + 1 rows' arithmetic).
- 8 < M <= 16: `_gemv_dot_kernel`, tensor cores through shared memory: the decoded, scaled tile
  (exact in bf16) @ x^T.
- M > 16 (prefill, compute-bound): `_dequant_kernel` writes the weight in x.dtype to a scratch
  tensor, then torch's matmul (cuBLAS). Simpler than an in-kernel dequantizing GEMM; on the H200 the
  27B shapes at M = 1024 run at ~0.78x of bf16 F.linear (dequantize ~3.4 TB/s + cuBLAS).

Decoding. Words are read as int32 (8 codes; code p at bits 4p..4p+3 is element 8w + p, which is the
low-nibble-first byte order on a little-endian machine). For code p, one left shift puts its sign
bit on bit 31, an arithmetic right shift by 6 then puts its three magnitude bits (e1 e0 m) on
fp32 bits 24..22 (exponent LSBs and mantissa MSB) while bit 31 keeps the sign; masking bits
31, 24..22 leaves an fp32 whose value is exactly e2m1 * 2^-126, including the subnormal codes
(+-0.5 are fp32 subnormals: the arithmetic must not flush denormals, which Triton's plain fp32 ops
do not). Three integer ops per code, no table. Scales likewise: E4M3 bits moved up by 20 are
exactly scale * 2^-120. Powers of two are folded back by exact multiplies: per word the GEMV sum
(units of 2^-126) times block scale * 2^100, or for tensor cores the code times block scale *
2^100 (= code * scale * 2^-26: a normal number, exact in bf16), and at the end row scale * 2^26.

Measured on one H200 (selfcheck_nvfp4, CUDA-graph replay, L2 flushed, 27B shapes, bf16 x;
bench/results/2026-11-30-h200-s4): the packed-fp16 GEMV streams 2.7-3.1 TB/s at M = 1 on the
wide shapes (1.9 TB/s on the 5120 x 6144 o_proj), 1.9-2.7x faster than bf16 F.linear; at M = 2
it is 1.8-2.3x faster, at M = 4 1.1-1.5x, at M = 8 (two passes) 0.6-0.75x. The loop is bound by
instruction issue more than by HBM: ~2.6 SASS instructions per weight for one row of x, ~3.5 for
two, ~5.3 for four (bench/sass_count.py; the earlier one-word-per-thread version took 4.9, and the
fp32-decode GEMV ~6.3). The shared-memory tensor-core kernel (dot) runs at 0.4-0.9 TB/s. A packed-decode tensor-core
variant was tried and ran slower still: its decoded tiles reach the tensor cores through shared
memory 16 bits at a time.

Configs: a fixed table by (M, N, K) (`_gemv_config`), not triton.autotune: autotune times candidates
on the first call of each shape, which would slow start-up, run inside CUDA-graph capture, and make
the chosen kernel depend on timing noise.
"""

from __future__ import annotations

import json
import logging
import os

import torch
import triton
import triton.language as tl

from ninfer.kernels.pdl import pdl_enter, pdl_launch, pdl_release, pdl_wait
from ninfer.kernels.triton_compat import fix_interpreter, interpreting

fix_interpreter()  # TRITON_INTERPRET=1 only: see triton_compat
log = logging.getLogger(__name__)

GEMV_MAX_M = 16
MAX_ROWS_LIKE = 64  # rows of a rows_like product (as ninfer.kernels.triton_gemv's)
# Rows of x up to which the register-fed kernels (packed fp16, or from MMA_MIN_M the mma GEMV) run
# rather than the shared-memory tensor-core kernel.
HFMA_MAX_M = 8
# Rows of x per packed-fp16 pass: where the mma GEMV cannot run (K not whole 256-code steps), M = 5..8
# takes two passes over the weight (rows 0-3, then the rest), which still beats the dot kernel.
HFMA_ROWS_PER_PASS = 4
# From this many rows of x the register-fed tensor-core GEMV (triton_nvfp4_mma) runs instead: on the
# H200 the five 27B GEMVs at M = 3 take 126 us against 140, at M = 4 124 against 173, at M = 8 136
# (the packed-fp16 GEMV's two passes: 344); at M = 2 105 stays packed fp16 (mma 118-125), M = 1 90
# (bench/results/2026-12-04-h200-s17). One 16-row tile a program; 8 warps splitting K where K is whole
# steps of 8 warps (512), else 4.
PLAIN_MMA_MIN_M = 3
# With speculative decoding, tensor cores from one row: a verify row must round as its decode row does, so with
# packed fp16 at M = 1, 2 a C=1 verify of k = 3 drafts ran 4 packed-fp16 rows (1.9x one row's time), now one
# 4-row mma launch. On an H100 (s20, 27B NVFP4, MTP3 at C=1): a plain step 13 % slower (9.79 ms against 8.53),
# a k = 3 round 12 % faster (13.0 against 14.8 ms): +12-15 % tok/s at acceptance lengths 2.9-3.7
# (bench/results/2026-12-05-h100-s20). use_mma sets it per engine.
SPEC_MMA_MIN_M = 1
_MMA_MIN_M_ENV = os.environ.get("NINFER_NVFP4_MMA_MIN_M")  # a benchmark knob over both
MMA_MIN_M = int(_MMA_MIN_M_ENV or PLAIN_MMA_MIN_M)
MMA_TILES = 1
# A benchmark knob: JSON launch keys over the table's mma launch, e.g. {"TILES": 2, "WARPS": 2, "STAGES": 5}
# (WARPS only where K is whole steps of them)
MMA_LAUNCH = json.loads(os.environ.get("NINFER_NVFP4_MMA_LAUNCH") or "{}")
# A speculative engine stores its NVFP4 linears paired for the mma GEMV (NVFP4Linear.pair_for_mma_, where K allows:
# triton_nvfp4_mma.pair_weights), so a lane loads two steps of weights at once; the same blocks meet in the same mma
# as unpaired, so every product is bit for bit the unpaired one. Those weights take the mma GEMV from 1 to
# MMA_MAX_ROWS rows (the dot and packed-fp16 kernels read K order) and the dequantizing kernel above that.
# NINFER_NVFP4_PAIRED=0 keeps K order.
PAIRED_ENABLED = os.environ.get("NINFER_NVFP4_PAIRED", "1") != "0"
# Paired weights of N a multiple of 16 also stored tiled (triton_nvfp4_mma.tile_weights: each 16-row tile one
# contiguous run, so a program streams one region): on an H100 (s35) the five 27B GEMVs 3 % faster, the C=1 step
# 9.02 -> 8.48 ms and MTP3 at C=1 +3.9 %. NINFER_NVFP4_TILED=0 keeps paired rows apart
TILED_ENABLED = os.environ.get("NINFER_NVFP4_TILED", "1") != "0"
# Rows of x per mma launch in speculative verification (triton_nvfp4_mma.MAX_ROWS)
MMA_MAX_ROWS = 32
# Off when NINFER_NVFP4_MMA=0 or when its start-up check failed (use_mma below; the runner calls it).
MMA_ENABLED = os.environ.get("NINFER_NVFP4_MMA", "1") != "0"
# Its K loop unrolled twice: the prefetched registers swap roles instead of being copied each step.
HFMA_UNROLL = tl.constexpr(2)
_SCALE_UP = tl.constexpr(2.0**120)  # E4M3 bits << 20 read as fp32 = scale * 2^-120
_DOT_SCALE = tl.constexpr(2.0**100)  # dot: code * 2^-126 * scale * 2^100 = code * scale * 2^-26 (exact in bf16)
_DOT_UNSCALE = tl.constexpr(2.0**26)
_SIGN_E1E0M = tl.constexpr(-0x7E400000)  # 0x81C00000 as int32: fp32 bits 31 and 24..22
_F16_UNSCALE = tl.constexpr(2.0**14)  # fp16-decoded codes are code * 2^-14


@triton.jit
def _e2m1_times_2m126(words, shift):
    """int32 words, shift = 28 - 4p -> fp32 value of code p of each word, times 2^-126."""
    bits = ((words << shift) >> 6) & _SIGN_E1E0M
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_times_2m120(sbytes):
    """uint8 E4M3 scales with bit 7 clear (the quantizer writes no negative scales; the importer
    moves a negative block's sign onto its codes) -> fp32 scale * 2^-120, exact."""
    return (sbytes.to(tl.int32) << 20).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(sbytes):
    """uint8 E4M3 scales -> their fp32 values (the sign bit masked off: a scale's magnitude)."""
    return _e4m3_times_2m120(sbytes & 0x7F) * _SCALE_UP


@triton.jit
def _load_row(W, S, n, N, stride_wn, stride_sn, cols, cmask):
    """One weight row's words [BW] (int32) and their block-scale bytes [BW] over the tile `cols`."""
    n64 = n.to(tl.int64)
    mask = cmask & (n < N)
    words = tl.load(W + n64 * stride_wn + cols, mask=mask, other=0)
    sbytes = tl.load(S + n64 * stride_sn + cols // 2, mask=mask, other=0)
    return words, sbytes


@triton.jit
def _row_dot(words, sbytes, x0, x1, x2, x3, x4, x5, x6, x7):
    """[BW] fp32: per word the sum of its 8 products (units of 2^-126: FMAs with a subnormal factor
    round only the sum) times its block scale * 2^100. x0..x7: the x of code position p."""
    part = _e2m1_times_2m126(words, 28) * x0
    part += _e2m1_times_2m126(words, 24) * x1
    part += _e2m1_times_2m126(words, 20) * x2
    part += _e2m1_times_2m126(words, 16) * x3
    part += _e2m1_times_2m126(words, 12) * x4
    part += _e2m1_times_2m126(words, 8) * x5
    part += _e2m1_times_2m126(words, 4) * x6
    part += _e2m1_times_2m126(words, 0) * x7
    return part * (_e4m3(sbytes) * _DOT_SCALE)


@triton.jit
def _store_row(Y, RS, n, N, acc):
    rs = tl.load(RS + n, mask=n < N, other=0.0) * _DOT_UNSCALE
    tl.store(Y + n, (tl.sum(acc, axis=0) * rs).to(Y.dtype.element_ty), mask=n < N)


@triton.jit
def _gemv_fma_kernel(
    X, W, S, RS, Y,
    M, N, KW,
    stride_xm, stride_wn, stride_sn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """CUDA-core GEMV for one row of x: one program per BLOCK_N (4 or 8) weight rows, all of K.

    Word tiles of BLOCK_W = 32 * num_warps: one int32 word (8 codes) per thread and row. The
    thread's 8 x values come in one 16-byte load, are converted once for all BLOCK_N rows and split
    in registers by code position; each code is decoded by 3 integer ops and meets its x in one FMA.
    Rows are unrolled with their own accumulators (no cross-thread traffic until the end), and the
    next tile's words, scales and x are loaded before the current tile is computed (software
    double buffering: two tiles of loads in flight per thread).
    """
    n0 = tl.program_id(0) * BLOCK_N
    offs_w = tl.arange(0, BLOCK_W)
    offs_k = tl.arange(0, BLOCK_W * 8)
    acc0 = tl.zeros([BLOCK_W], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_W], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_W], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_W], dtype=tl.float32)
    acc4 = tl.zeros([BLOCK_W], dtype=tl.float32)
    acc5 = tl.zeros([BLOCK_W], dtype=tl.float32)
    acc6 = tl.zeros([BLOCK_W], dtype=tl.float32)
    acc7 = tl.zeros([BLOCK_W], dtype=tl.float32)
    cmask = offs_w < KW
    x = tl.load(X + offs_k, mask=offs_k < KW * 8, other=0.0)
    w0, s0 = _load_row(W, S, n0, N, stride_wn, stride_sn, offs_w, cmask)
    w1, s1 = _load_row(W, S, n0 + 1, N, stride_wn, stride_sn, offs_w, cmask)
    w2, s2 = _load_row(W, S, n0 + 2, N, stride_wn, stride_sn, offs_w, cmask)
    w3, s3 = _load_row(W, S, n0 + 3, N, stride_wn, stride_sn, offs_w, cmask)
    if BLOCK_N > 4:
        w4, s4 = _load_row(W, S, n0 + 4, N, stride_wn, stride_sn, offs_w, cmask)
        w5, s5 = _load_row(W, S, n0 + 5, N, stride_wn, stride_sn, offs_w, cmask)
        w6, s6 = _load_row(W, S, n0 + 6, N, stride_wn, stride_sn, offs_w, cmask)
        w7, s7 = _load_row(W, S, n0 + 7, N, stride_wn, stride_sn, offs_w, cmask)
    for t in range(BLOCK_W, KW + BLOCK_W, BLOCK_W):
        # next tile (masked off past K) while this one is computed
        cols = t + offs_w
        cmask = cols < KW
        ks = t * 8 + offs_k
        x_next = tl.load(X + ks, mask=ks < KW * 8, other=0.0)
        w0n, s0n = _load_row(W, S, n0, N, stride_wn, stride_sn, cols, cmask)
        w1n, s1n = _load_row(W, S, n0 + 1, N, stride_wn, stride_sn, cols, cmask)
        w2n, s2n = _load_row(W, S, n0 + 2, N, stride_wn, stride_sn, cols, cmask)
        w3n, s3n = _load_row(W, S, n0 + 3, N, stride_wn, stride_sn, cols, cmask)
        if BLOCK_N > 4:
            w4n, s4n = _load_row(W, S, n0 + 4, N, stride_wn, stride_sn, cols, cmask)
            w5n, s5n = _load_row(W, S, n0 + 5, N, stride_wn, stride_sn, cols, cmask)
            w6n, s6n = _load_row(W, S, n0 + 6, N, stride_wn, stride_sn, cols, cmask)
            w7n, s7n = _load_row(W, S, n0 + 7, N, stride_wn, stride_sn, cols, cmask)
        # x of word w, code p = 4*b2 + 2*b1 + b0 sits at [w, b2, b1, b0]: split the three minor axes
        even, odd = tl.split(tl.reshape(x.to(tl.float32), [BLOCK_W, 2, 2, 2]))
        e0, e1 = tl.split(even)
        o0, o1 = tl.split(odd)
        x0, x4 = tl.split(e0)
        x2, x6 = tl.split(e1)
        x1, x5 = tl.split(o0)
        x3, x7 = tl.split(o1)
        acc0 += _row_dot(w0, s0, x0, x1, x2, x3, x4, x5, x6, x7)
        acc1 += _row_dot(w1, s1, x0, x1, x2, x3, x4, x5, x6, x7)
        acc2 += _row_dot(w2, s2, x0, x1, x2, x3, x4, x5, x6, x7)
        acc3 += _row_dot(w3, s3, x0, x1, x2, x3, x4, x5, x6, x7)
        x, w0, s0, w1, s1, w2, s2, w3, s3 = x_next, w0n, s0n, w1n, s1n, w2n, s2n, w3n, s3n
        if BLOCK_N > 4:
            acc4 += _row_dot(w4, s4, x0, x1, x2, x3, x4, x5, x6, x7)
            acc5 += _row_dot(w5, s5, x0, x1, x2, x3, x4, x5, x6, x7)
            acc6 += _row_dot(w6, s6, x0, x1, x2, x3, x4, x5, x6, x7)
            acc7 += _row_dot(w7, s7, x0, x1, x2, x3, x4, x5, x6, x7)
            w4, s4, w5, s5, w6, s6, w7, s7 = w4n, s4n, w5n, s5n, w6n, s6n, w7n, s7n
    _store_row(Y, RS, n0, N, acc0)
    _store_row(Y, RS, n0 + 1, N, acc1)
    _store_row(Y, RS, n0 + 2, N, acc2)
    _store_row(Y, RS, n0 + 3, N, acc3)
    if BLOCK_N > 4:
        _store_row(Y, RS, n0 + 4, N, acc4)
        _store_row(Y, RS, n0 + 5, N, acc5)
        _store_row(Y, RS, n0 + 6, N, acc6)
        _store_row(Y, RS, n0 + 7, N, acc7)


@triton.jit
def _gemv_dot_kernel(
    X, W, S, RS, Y,
    M, N, KW,
    stride_xm, stride_wn, stride_sn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Tensor-core variant: the decoded, scaled tile [BLOCK_N, 8*BLOCK_W] (exact in x.dtype) @
    x^T [8*BLOCK_W, BLOCK_M]."""
    pdl_enter(USE_PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    rows = offs_n.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = offs_m < M
    offs_w = tl.arange(0, BLOCK_W)
    offs_k = tl.arange(0, BLOCK_W * 8)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for w0 in range(0, KW, BLOCK_W):
        cols = w0 + offs_w
        mask = nmask[:, None] & (cols < KW)[None, :]
        words = tl.load(W + rows[:, None] * stride_wn + cols[None, :], mask=mask, other=0)
        scale = _e4m3(tl.load(S + rows[:, None] * stride_sn + (cols // 2)[None, :], mask=mask, other=0))
        wt = _decode_tile(words, scale * _DOT_SCALE).to(X.dtype.element_ty)
        ks = w0 * 8 + offs_k
        xt = tl.load(X + offs_m[None, :] * stride_xm + ks[:, None], mask=mmask[None, :] & (ks < KW * 8)[:, None],
                     other=0.0)
        acc = tl.dot(wt, xt, acc, input_precision=DOT_PRECISION)
    rs = tl.load(RS + offs_n, mask=nmask, other=0.0) * _DOT_UNSCALE
    y = acc * rs[:, None]
    tl.store(Y + offs_m[None, :] * stride_ym + offs_n[:, None], y.to(Y.dtype.element_ty),
             mask=mmask[None, :] & nmask[:, None])


@triton.jit
def _codes(words):
    """int32 words [BN, BW] -> fp32 codes * 2^-126 [BN, BW, 2, 2, 2]: code p = 4*b2 + 2*b1 + b0 of
    word w at [., w, b2, b1, b0], so the row-major reshape to [BN, 8*BW] is in K order (column
    8w + p). Eight shifted decodes interleaved in registers by tl.join (each join appends a minor
    axis: bit 2 of p first, then bit 1, then bit 0)."""
    a0 = tl.join(_e2m1_times_2m126(words, 28), _e2m1_times_2m126(words, 12))  # p = 0, 4
    a1 = tl.join(_e2m1_times_2m126(words, 24), _e2m1_times_2m126(words, 8))  # p = 1, 5
    a2 = tl.join(_e2m1_times_2m126(words, 20), _e2m1_times_2m126(words, 4))  # p = 2, 6
    a3 = tl.join(_e2m1_times_2m126(words, 16), _e2m1_times_2m126(words, 0))  # p = 3, 7
    return tl.join(tl.join(a0, a2), tl.join(a1, a3))


@triton.jit
def _decode_tile(words, scale_w):
    """int32 words [BN, BW], per-word factors [BN, BW] -> fp32 [BN, 8 * BW] in K order."""
    codes = _codes(words) * scale_w[:, :, None, None, None]
    return tl.reshape(codes, [words.shape[0], words.shape[1] * 8])


@triton.jit
def _dequant_kernel(
    W, S, RS, OUT,
    N, KW,
    stride_wn, stride_sn, stride_on,
    ROWS: tl.constexpr, BLOCK_W: tl.constexpr, PAIR_SB: tl.constexpr = 0, TILED: tl.constexpr = False,
):
    """W in OUT's dtype; each program ROWS rows x BLOCK_W words (BLOCK_W = 32 * num_warps: one word
    per thread, 8 outputs stored as one 16-byte vector). PAIR_SB > 0: W and S stored paired
    (triton_nvfp4_mma.pair_weights, SB = PAIR_SB blocks a step), read where each block of K is stored; TILED: and
    tiled (triton_nvfp4_mma.tile_weights: 16 rows' 4 SB words, 2 SB scale bytes, of a load side by side)."""
    pid_w = tl.program_id(1)
    cols = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    cmask = cols < KW
    offs_k = pid_w * BLOCK_W * 8 + tl.arange(0, BLOCK_W * 8)
    if PAIR_SB > 0:  # block b = s SB + L (step s, lane L) is stored at 2 (s // 2) SB + 2 L + s % 2
        step = cols // 2 // PAIR_SB
        blocks = (step // 2) * (2 * PAIR_SB) + 2 * (cols // 2 % PAIR_SB) + step % 2
        src = 2 * blocks + cols % 2
    else:  # K order: contiguous words (one vector load a thread)
        blocks = cols // 2
        src = cols
    for r in range(0, ROWS):
        row = tl.program_id(0) * ROWS + r
        rmask = cmask & (row < N)
        row64 = row.to(tl.int64)
        if TILED:  # (rows a multiple of 16, contiguous)
            cw: tl.constexpr = 4 * PAIR_SB  # a row's words of one load, and 2 SB scale bytes
            tile = (row64 // 16) * 16
            w_at = tile * KW + (src // cw) * (16 * cw) + (row64 % 16) * cw + src % cw
            s_at = tile * (KW // 2) + (blocks // (cw // 2)) * (8 * cw) + (row64 % 16) * (cw // 2) + blocks % (cw // 2)
        else:
            w_at = row64 * stride_wn + src
            s_at = row64 * stride_sn + blocks
        words = tl.load(W + w_at, mask=rmask, other=0)
        scale = _e4m3(tl.load(S + s_at, mask=rmask, other=0))
        rs = tl.load(RS + row, mask=row < N, other=0.0) * _DOT_UNSCALE
        vals = _decode_tile(words[None, :], (scale * _DOT_SCALE)[None, :]) * rs  # as the reference rounds
        tl.store(OUT + row64 * stride_on + offs_k[None, :], vals.to(OUT.dtype.element_ty),
                 mask=((offs_k < KW * 8) & (row < N))[None, :])


# ---------------------------------------------------------------------------------------------
# Packed-fp16 GEMV for up to four rows of x per pass (kind "hfma", M <= HFMA_MAX_M)
#
# The fp32 decode above costs ~6-7 instructions per weight in the loop (SASS of the H200 build):
# the kernel is bound by instruction issue, not HBM. Here each thread takes whole 16-weight scale
# blocks: per weight row and step, one block's two int32 words (one 8-byte load) and its scale
# byte. A word's codes become bytes sign << 7 | magnitude << 1 (the even codes, each byte's low
# nibble, by two shifts, an AND and a `lop3`; the odd ones by a shift, an AND and a `lop3`), and
# one `prmt` per pair of bytes places two of them as the high bytes of an fp16 pair with zero low
# bytes: eleven instructions per word. Such an fp16 reads as code * 2^-14 (the magnitude bits
# e1 e0 m land on exponent bits 11..10 and mantissa bit 9; +-0.5 become fp16 subnormals, which fp16
# arithmetic keeps). The block's eight pairs meet x as fp16 pairs ((x0, x2), (x4, x6), (x1, x3),
# (x5, x7) per word) in one HMUL2 and seven HFMA2 per row of x; the two halves are added in fp16,
# converted, and the block scale applied in one fp32 FMA. So the decode is shared by every row of
# x, and the scale, the conversion and the address arithmetic by 16 weights; K is a compile-time
# constant, so every weight row's address is one pointer plus a constant offset. Precision: each
# fp16 product, 8-term sum and the sum of the halves rounds to 11 bits (finer than bf16's 8); x
# converts to fp16 exactly for |x| in [2^-14, 65504] and saturates beyond; products below fp16's
# normal range (|x| < 2 with code 0.5) keep an absolute error under 2^-25 * 2^14 * block scale *
# row scale.

_X_PAIRS = tl.constexpr("""
{
.reg .f32 a, b, c, d;
shl.b32 a, $4, 16; shl.b32 b, $5, 16; cvt.rn.satfinite.f16x2.f32 $0, b, a;
shl.b32 c, $6, 16; shl.b32 d, $7, 16; cvt.rn.satfinite.f16x2.f32 $1, d, c;
and.b32 a, $4, 0xFFFF0000; and.b32 b, $5, 0xFFFF0000; cvt.rn.satfinite.f16x2.f32 $2, b, a;
and.b32 c, $6, 0xFFFF0000; and.b32 d, $7, 0xFFFF0000; cvt.rn.satfinite.f16x2.f32 $3, d, c;
}
""")


def decode_word_ptx(word: str, regs: list[str]) -> list[str]:
    """PTX lines turning the int32 `word` (8 codes) into 4 fp16 pairs (c0, c2), (c4, c6), (c1, c3),
    (c5, c7) in `regs`, each worth code * 2^-14; scratch registers e, o, u and z (= 0) declared by the
    caller. e: the even codes (0, 2, 4, 6: each byte's low nibble) as bytes sign << 7 | magnitude << 1,
    o: the odd codes likewise; each byte becomes the high byte of an fp16 (zero low bytes from z)."""
    return [f"shl.b32 e, {word}, 1; shl.b32 u, {word}, 4; and.b32 u, u, 0x80808080; "
            f"lop3.b32 e, e, 0x0E0E0E0E, u, 0xEA;",
            f"shr.b32 o, {word}, 3; and.b32 u, {word}, 0x80808080; lop3.b32 o, o, 0x0E0E0E0E, u, 0xEA;",
            f"prmt.b32 {regs[0]}, e, z, 0x1404; prmt.b32 {regs[1]}, e, z, 0x3424; "
            f"prmt.b32 {regs[2]}, o, z, 0x1404; prmt.b32 {regs[3]}, o, z, 0x3424;"]


def _block_dot_asm(rows: int) -> str:
    """PTX for one 16-weight block (two words) against `rows` rows of x: the block's 8 code pairs
    decoded once, then per row one HMUL2 + seven HFMA2 and the fp32 sum of the two halves.
    Operands: outputs $0..$rows-1 (fp32), the two words, then row r's 8 x pairs in _X_PAIRS' order
    (x0, x2), (x4, x6), (x1, x3), (x5, x7): the first word's columns, then the second's."""
    lines = ["{", ".reg .b32 t<8>, e, o, u, z;", ".reg .f16 lo, hi;", "mov.b32 z, 0;"]
    for w in range(2):
        lines += decode_word_ptx(f"${rows + w}", [f"t{4 * w + i}" for i in range(4)])
    for r in range(rows):
        x = [f"${rows + 2 + 8 * r + j}" for j in range(8)]
        lines.append(" ".join([f"mul.rn.f16x2 u, t0, {x[0]};"] + [f"fma.rn.f16x2 u, t{j}, {x[j]}, u;" for j in range(1, 8)]))
        lines.append(f"mov.b32 {{lo, hi}}, u; add.rn.f16 lo, lo, hi; cvt.f32.f16 ${r}, lo;")
    lines.append("}")
    return "\n".join(lines)


_BLOCK_DOT1 = tl.constexpr(_block_dot_asm(1))
_BLOCK_DOT2 = tl.constexpr(_block_dot_asm(2))
_BLOCK_DOT3 = tl.constexpr(_block_dot_asm(3))
_BLOCK_DOT4 = tl.constexpr(_block_dot_asm(4))


@triton.jit
def _x_pairs(x01, x23, x45, x67):
    """bf16 pairs (x0, x1) .. (x6, x7) of 8 columns, as int32 -> fp16 pairs (x_p, x_p+4), p = 0..3."""
    p02, p46, p13, p57 = tl.inline_asm_elementwise(_X_PAIRS, "=r,=r,=r,=r,r,r,r,r", [x01, x23, x45, x67],
                                                   dtype=(tl.int32,) * 4, is_pure=True, pack=1)
    return p02, p46, p13, p57  # a plain tuple, which the interpreter can concatenate


@triton.jit
def _ld(ptr, ok, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(ptr)
    return tl.load(ptr, mask=ok, other=0)


@triton.jit
def _x_block(X32, blocks, KB, EVEN_K: tl.constexpr):
    """One row of x at the block tile: each block's 16 columns as 8 fp16 pairs (a tuple of [BB])."""
    j = tl.arange(0, 4)[None, :]
    ptr = X32 + blocks[:, None] * 8 + j
    ok = (blocks < KB)[:, None]
    lo = _ld(ptr, ok, EVEN_K)
    hi = _ld(ptr + 4, ok, EVEN_K)
    a, b = tl.split(tl.reshape(lo, [lo.shape[0], 2, 2]))
    x01, x45 = tl.split(a)
    x23, x67 = tl.split(b)
    c, d = tl.split(tl.reshape(hi, [hi.shape[0], 2, 2]))
    y01, y45 = tl.split(c)
    y23, y67 = tl.split(d)
    return _x_pairs(x01, x23, x45, x67) + _x_pairs(y01, y23, y45, y67)


@triton.jit
def _x_blocks(X32, blocks, KB, stride_x32, EVEN_K: tl.constexpr, X_ROWS: tl.constexpr):
    """Every row of x's pairs at the block tile, flat: row 0's 8 pairs, then row 1's, ... (the block
    dot's operand order)."""
    xs = ()
    for r in tl.static_range(X_ROWS):
        xs = xs + _x_block(X32 + r * stride_x32, blocks, KB, EVEN_K)
    return xs


@triton.jit
def _w_blocks(wps, sps, blocks, KB, EVEN_K: tl.constexpr):
    """Every weight row's two words per block and the blocks' scale bytes, flat: (wa, wb, s) per row."""
    ws = ()
    ok = blocks < KB
    for i in tl.static_range(len(wps)):
        wa, wb = tl.split(_ld(wps[i] + blocks[:, None] * 2 + tl.arange(0, 2)[None, :], ok[:, None], EVEN_K))
        ws = ws + (wa, wb, _ld(sps[i] + blocks, ok, EVEN_K))
    return ws


# L2 prefetch of one address per element: no register is written (the dummy output is discarded),
# so the fetch runs ahead of the loads that later hit it. Not under the interpreter (PREFETCH = 0).
_PREFETCH_L2 = tl.constexpr("prefetch.global.L2 [$1]; mov.u32 $0, 0;")


@triton.jit
def _prefetch_l2(ptrs):
    tl.inline_asm_elementwise(_PREFETCH_L2, "=r,l", [ptrs.to(tl.int64, bitcast=True)], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _prefetch_blocks(wps, sps, blocks, KB: tl.constexpr):
    """Start fetching every weight row's words and scale bytes at `blocks` into L2 (clamped to the
    row: a prefetch past K re-reads the row's last line)."""
    b = tl.minimum(blocks, KB - 1)
    for i in tl.static_range(len(wps)):
        _prefetch_l2(wps[i] + b * 2)
        _prefetch_l2(sps[i] + b)


@triton.jit
def _block_dot(wa, wb, xs, X_ROWS: tl.constexpr):
    """Per block and row of x: sum over the block's 16 codes of code * 2^-14 * x, fp32 [BB, XR]
    (columns past X_ROWS repeat row 0; they are not stored). xs: _x_blocks' pairs."""
    if X_ROWS == 1:
        o = tl.inline_asm_elementwise(_BLOCK_DOT1, "=f" + ",r" * 10, (wa, wb) + xs,
                                      dtype=tl.float32, is_pure=True, pack=1)
        return o[:, None]
    elif X_ROWS == 2:
        o0, o1 = tl.inline_asm_elementwise(_BLOCK_DOT2, "=f,=f" + ",r" * 18, (wa, wb) + xs,
                                           dtype=(tl.float32,) * 2, is_pure=True, pack=1)
        return tl.join(o0, o1)
    elif X_ROWS == 3:
        o0, o1, o2 = tl.inline_asm_elementwise(_BLOCK_DOT3, "=f,=f,=f" + ",r" * 26, (wa, wb) + xs,
                                               dtype=(tl.float32,) * 3, is_pure=True, pack=1)
        return tl.reshape(tl.join(tl.join(o0, o2), tl.join(o1, o0)), [o0.shape[0], 4])
    else:  # joins append a minor axis: [BB, 2, 2] -> [BB, 4] in row order 0..3, no data movement
        o0, o1, o2, o3 = tl.inline_asm_elementwise(_BLOCK_DOT4, "=f,=f,=f,=f" + ",r" * 34, (wa, wb) + xs,
                                                   dtype=(tl.float32,) * 4, is_pure=True, pack=1)
        return tl.reshape(tl.join(tl.join(o0, o2), tl.join(o1, o3)), [o0.shape[0], 4])


@triton.jit
def _hfma_step(accs, ws, xs, X_ROWS: tl.constexpr):
    """One K step for every weight row: acc += block dot * block scale * 2^-120 (2^120 goes back at
    the end; products below fp32's normal range stay exact enough: Triton's fp32 FMAs keep
    denormals)."""
    out = ()
    for i in tl.static_range(len(accs)):
        dot = _block_dot(ws[3 * i], ws[3 * i + 1], xs, X_ROWS)
        out = out + (accs[i] + dot * _e4m3_times_2m120(ws[3 * i + 2])[:, None],)
    return out


@triton.jit
def _rows_dot(X32, stride_x32, wps, sps, KW: tl.constexpr, BLOCK_W: tl.constexpr, X_ROWS: tl.constexpr,
              XR: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr = 0):
    """The packed-fp16 dot of every weight row (pointers wps to its KW words, sps to its KW / 2 scale
    bytes) with X_ROWS rows of x (X32: bf16 pairs as int32, rows stride_x32 apart): a tuple of
    [XR] fp32 sums, each to be multiplied by 2^120 * 2^14 * the row's row scale. Per step BLOCK_W
    words (BLOCK_W / 2 scale blocks, one per thread and row); each block decoded once for all rows
    of x; the next step's loads issued before this step's math (two steps in flight per thread).
    KW is a compile-time constant, so every row's address is a constant offset from one pointer;
    EVEN_K (BLOCK_W divides KW): no masks. Under PDL the first step's weights are loaded while the
    kernel before still runs (weights are constants); x only after pdl_wait. PREFETCH > 0: the
    weights PREFETCH steps ahead are prefetched into L2 (the first ones before pdl_wait), so more
    bytes are in flight than two steps of registers hold: what a short kernel or a kernel's last,
    thin wave of programs lacks."""
    BB: tl.constexpr = BLOCK_W // 2
    KB: tl.constexpr = KW // 2
    EVEN_K: tl.constexpr = KW % BLOCK_W == 0
    blocks = tl.arange(0, BB)
    accs = ()
    for _i in tl.static_range(len(wps)):
        accs = accs + (tl.zeros([BB, XR], dtype=tl.float32),)
    ws = _w_blocks(wps, sps, blocks, KB, EVEN_K)
    for d in tl.static_range(1, PREFETCH + 1):
        _prefetch_blocks(wps, sps, blocks + d * BB, KB)
    pdl_wait(USE_PDL)
    xs = _x_blocks(X32, blocks, KB, stride_x32, EVEN_K, X_ROWS)
    for t in tl.range(BB, KB, BB, loop_unroll_factor=HFMA_UNROLL):  # prefetch step t, compute step t - 1
        if PREFETCH > 0:
            _prefetch_blocks(wps, sps, t + PREFETCH * BB + blocks, KB)
        xs_next = _x_blocks(X32, t + blocks, KB, stride_x32, EVEN_K, X_ROWS)
        ws_next = _w_blocks(wps, sps, t + blocks, KB, EVEN_K)
        accs = _hfma_step(accs, ws, xs, X_ROWS)
        xs = xs_next
        ws = ws_next
    accs = _hfma_step(accs, ws, xs, X_ROWS)
    sums = ()
    for i in tl.static_range(len(accs)):
        sums = sums + (tl.sum(accs[i], axis=0),)
    return sums


@triton.jit
def _gemv_hfma_kernel(
    X32, W, S, RS, Y,
    N, stride_x32, stride_ym,
    KW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, EVEN_N: tl.constexpr, X_ROWS: tl.constexpr,
    XR: tl.constexpr, USE_PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
):
    """One program per BLOCK_N weight rows and all of K (_rows_dot), for X_ROWS (1..4; XR = X_ROWS
    rounded up to a power of two) rows of x. W, S: contiguous rows of KW words and KW / 2 scale
    bytes. EVEN_N: BLOCK_N divides N (no clamping of the last program's rows). USE_PDL: see
    ninfer.kernels.pdl (the next kernel may launch at once; this one waits inside _rows_dot)."""
    pdl_release(USE_PDL)
    n0 = tl.program_id(0) * BLOCK_N
    wps = ()
    sps = ()
    for i in tl.static_range(BLOCK_N):
        n = n0 + i
        if not EVEN_N:
            n = tl.minimum(n, N - 1)  # rows past N read the last row; they are not stored
        wps = wps + (W + n.to(tl.int64) * KW,)
        sps = sps + (S + n.to(tl.int64) * (KW // 2),)
    sums = _rows_dot(X32, stride_x32, wps, sps, KW, BLOCK_W, X_ROWS, XR, USE_PDL, PREFETCH)
    m = tl.arange(0, XR)
    for i in tl.static_range(BLOCK_N):
        n = n0 + i
        rs = tl.load(RS + n, mask=n < N, other=0.0) * _F16_UNSCALE
        tl.store(Y + m * stride_ym + n, (sums[i] * _SCALE_UP * rs).to(Y.dtype.element_ty),
                 mask=(m < X_ROWS) & (n < N))


# ---------------------------------------------------------------------------------------------
# Host side


def _words(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> int32 [N, K/8] view (K % 16 == 0: whole words, 4-byte aligned rows)."""
    if packed.stride(-1) != 1 or packed.storage_offset() % 4 or packed.stride(0) % 4:
        packed = packed.contiguous()
    return packed.view(torch.int32)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with each row's values contiguous (rows may stand apart: the mma GEMV takes their stride)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _x_words(x: torch.Tensor) -> torch.Tensor:
    """bf16 x [M, K] as int32 pairs [M, K / 2] (copied when its rows are not 4-byte aligned)."""
    aligned = x.storage_offset() % 2 == 0 and x.stride(0) % 2 == 0
    return (x if aligned else x.clone()).view(torch.int32)


def _hfma(block_n: int, num_warps: int, prefetch: int = 0) -> dict:
    return dict(kind="hfma", BLOCK_N=block_n, BLOCK_W=64 * num_warps, num_warps=num_warps, PREFETCH=prefetch)


def mma_warps(k: int) -> int:
    """Warps of an mma GEMV launch over rows k long: 8 where K is whole steps of 8 (512 codes), else 4."""
    return 8 if k % 512 == 0 else 4


def _gemv_config(m: int, n: int, k: int, paired: bool = False) -> dict:
    """Launch parameters by shape only (CUDA-graph capturable; no autotuning): the H200 sweeps'
    fastest tiles (bench/results/2026-11-30-h200-s4, and -s7 for the L2 prefetch distances at
    M = 1, 2). Few rows (N < 8192, e.g. 5120) want wide steps or prefetch to keep bytes in flight;
    prefetch pays only with long rows (K >= 4096), never at M >= 3."""
    if paired:  # stored for the mma GEMV's launch of mma_warps(k) warps: no other GEMV reads them, nor other warps
        knobs = {key: v for key, v in MMA_LAUNCH.items() if key not in ("WARPS", "STAGES", "PREFETCH")}
        return dict(kind="mma", TILES=MMA_TILES, WARPS=mma_warps(k), PAIRED=True) | knobs
    if MMA_ENABLED and MMA_MIN_M <= m <= HFMA_MAX_M and k % 256 == 0:  # tensor cores: triton_nvfp4_mma
        cfg = dict(kind="mma", TILES=MMA_TILES, WARPS=mma_warps(k)) | MMA_LAUNCH
        return cfg if k % (64 * cfg["WARPS"]) == 0 else cfg | {"WARPS": 4}
    return _hfma_config(m, n, k)


def use_mma(device: torch.device, speculative: bool = False) -> str:
    """Decide once per engine, before graphs are captured, whether the tensor-core GEMV serves on `device`
    (its start-up check against the reference, triton_nvfp4_mma.check_against_reference) and from how many
    rows: PLAIN_MMA_MIN_M, or SPEC_MMA_MIN_M for an engine that verifies drafts. Returns a status line for
    the log."""
    global MMA_ENABLED, MMA_MIN_M
    if not MMA_ENABLED:
        return "packed fp16 only (NINFER_NVFP4_MMA=0 or an earlier failed check)"
    from ninfer.kernels.triton_nvfp4_mma import check_against_reference

    problem = check_against_reference(device)
    if problem is not None:
        MMA_ENABLED = False
        return f"packed fp16 only (the tensor-core GEMV failed its check: {problem})"
    MMA_MIN_M = int(_MMA_MIN_M_ENV or (SPEC_MMA_MIN_M if speculative else PLAIN_MMA_MIN_M))
    rows = f"tensor cores from {MMA_MIN_M} row{'s' if MMA_MIN_M > 1 else ''}"
    return rows + (" (speculative decoding: verification rows round as decode rows)" if speculative else "")


def pair_model_for_mma_(model: torch.nn.Module) -> int:
    """A speculative engine's NVFP4 linears stored paired for the mma GEMV (PAIRED_ENABLED, after use_mma chose it
    from one row, where check_paired finds the paired launch bit for bit K order's), and tiled where N allows
    (TILED_ENABLED, where check_paired finds the tiled launch bit for bit too). Returns how many were paired."""
    global PAIRED_ENABLED, TILED_ENABLED
    from ninfer.kernels.triton_nvfp4_mma import check_paired
    from ninfer.quant.nvfp4 import NVFP4Linear

    if not (PAIRED_ENABLED and MMA_ENABLED and MMA_MIN_M == 1):
        return 0
    cuda = [m for m in model.modules() if isinstance(m, NVFP4Linear) and m.weight_packed.is_cuda]
    if not cuda:
        return 0
    problem = check_paired(cuda[0].weight_packed.device, tiled=TILED_ENABLED)
    if problem is not None and TILED_ENABLED:  # tiled storage alone may be at fault: keep paired storage then
        log.warning("NVFP4 weights stay untiled: %s", problem)
        TILED_ENABLED = False
        problem = check_paired(cuda[0].weight_packed.device)
    if problem is not None:
        log.warning("NVFP4 weights stay in K order: %s", problem)
        PAIRED_ENABLED = False
        return 0
    done = 0
    for module in cuda:
        done += module.pair_for_mma_(mma_warps(module.in_features), tiled=TILED_ENABLED)
    return done


def _hfma_config(m: int, n: int, k: int) -> dict:
    """The packed-fp16 GEMV's tiles (M <= HFMA_MAX_M), else the tensor-core dot kernel's."""
    if m <= HFMA_MAX_M:  # the packed-fp16 GEMV; BLOCK_W words per step = two per thread and weight row
        long_k = k >= 4096
        if m == 1:
            if n >= 8192:
                cfg = _hfma(8, 2)
            else:  # the MLP down projection (K = 17408): 21.2 us at (4, 2, 2) against 23.1 at (8, 4)
                cfg = _hfma(4, 2, 2) if k > 8192 else _hfma(8, 4)
        elif m == 2:
            if n >= 8192:
                cfg = _hfma(8, 2, 2 if long_k else 0)
            else:  # down 20.4 us at (8, 4) against 27.7 at (4, 2); out projection 9.3 at (4, 2, 2) against 11.8
                cfg = _hfma(8, 4) if k > 8192 else _hfma(4, 2, 2 if long_k else 0)
        else:
            cfg = _hfma(8, 2)
        prefetch = os.environ.get("NINFER_NVFP4_PREFETCH")  # a tuning knob for benchmarks: L2 prefetch distance
        return cfg | ({"PREFETCH": int(prefetch)} if prefetch else {})
    return dict(kind="dot", BLOCK_M=16, BLOCK_N=64 if n >= 8192 else 32, BLOCK_W=16, num_warps=4)


def nvfp4_gemv(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor,
               out: torch.Tensor | None = None, config: dict | None = None, paired: int = 0,
               tiled: bool = False) -> torch.Tensor:
    """x [M, K] (M small, last dim contiguous) -> y [M, N] in x.dtype. paired: the warps W was stored paired
    for (NVFP4Linear.pair_for_mma_), 0 for K order; tiled: and tiled (triton_nvfp4_mma.tile_weights)."""
    m, k = x.shape
    n = packed.shape[0]
    if packed.shape[1] * 2 != k:
        raise ValueError(f"nvfp4_gemv: x has K={k}, weight has K={packed.shape[1] * 2}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    words = _words(packed)
    sbytes = scale.view(torch.uint8)
    y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    cfg = dict(config or _gemv_config(m, n, k, bool(paired)))
    kind = cfg.pop("kind")
    if cfg.pop("PAIRED", False) and not paired:  # a config's claim (benchmarks): stored paired for its warps
        paired = cfg["WARPS"]
    tiled = cfg.pop("TILED", False) or tiled  # likewise
    args = (x, words, sbytes, row_scale, y, m, n, k // 8, x.stride(0), words.stride(0), sbytes.stride(0),
            y.stride(0))
    mma = kind == "mma" and x.dtype == torch.bfloat16 and (x.is_cuda or interpreting())
    if paired and not (mma and 1 <= m <= MMA_MAX_ROWS and cfg["WARPS"] == paired):  # only that launch reads them
        w = nvfp4_dequantize(packed, scale, row_scale, x.dtype, paired=paired, tiled=tiled)
        return torch.matmul(x, w.T, out=y)
    if mma:
        from ninfer.kernels.triton_nvfp4_mma import gemv_mma

        gemv_mma(_x_words(x), _rows(words), _rows(sbytes), row_scale, y, m, n, k, tiles=cfg["TILES"],
                 warps=cfg["WARPS"], depth=cfg.get("DEPTH"), unroll=cfg.get("UNROLL"), prefetch=cfg.get("PREFETCH", 0),
                 stages=cfg.get("STAGES", 0), paired=bool(paired), evict=cfg.get("EVICT", 0),
                 tiled=tiled, maxnreg=cfg.get("MAXNREG"), launch=pdl_launch(x.device))
        return y
    if kind == "mma":  # fp32 / fp16 x, or no GPU and no interpreter: the packed-fp16 GEMV's fallbacks
        cfg = _hfma_config(m, n, k)
        kind = cfg.pop("kind")
    if kind == "hfma" and (x.dtype != torch.bfloat16 or not (x.is_cuda or interpreting())):
        # PTX: bf16 x, on CUDA or in the interpreter (ptx_emulator); otherwise the fp32-decode kernels
        # (same rows and warps for one row)
        cfg = dict(kind="fma", BLOCK_M=1, BLOCK_N=cfg["BLOCK_N"], BLOCK_W=32 * cfg["num_warps"],
                   num_warps=cfg["num_warps"]) if m == 1 else _gemv_config(HFMA_MAX_M + 1, n, k)
        kind = cfg.pop("kind")
    if kind == "hfma":
        if m > HFMA_MAX_M or cfg["BLOCK_W"] != 64 * cfg["num_warps"]:
            raise ValueError(f"the hfma GEMV takes up to {HFMA_MAX_M} rows of x and BLOCK_W = 64 * num_warps")
        x32 = _x_words(x)
        words, sbytes = words.contiguous(), sbytes.contiguous()
        for r0 in range(0, m, HFMA_ROWS_PER_PASS):
            rows = min(HFMA_ROWS_PER_PASS, m - r0)
            # each pass takes its own row count's tiles: the same compiled variants as M = 1..4
            tiles = cfg if config is not None or m <= HFMA_ROWS_PER_PASS else _hfma_config(rows, n, k)
            _launch_hfma(x32, words, sbytes, row_scale, y, n, k, tiles, r0, rows)
        return y
    if kind == "fma":
        if m != 1 or cfg["BLOCK_N"] not in (4, 8):
            raise ValueError("the fma GEMV takes one row of x and 4 or 8 weight rows per program")
        grid = (triton.cdiv(n, cfg["BLOCK_N"]),)
        _gemv_fma_kernel[grid](*args, **cfg)
    else:
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
        precision = "ieee" if x.dtype == torch.float32 else "tf32"
        _gemv_dot_kernel[grid](*args, DOT_PRECISION=precision, **cfg, **pdl_launch(x.device))
    return y


def _launch_hfma(x32, words, sbytes, row_scale, y, n: int, k: int, tiles: dict, r0: int, rows: int) -> None:
    """The packed-fp16 GEMV over rows r0 .. r0 + rows - 1 (at most HFMA_ROWS_PER_PASS) of x with `tiles`."""
    tiles = {key: v for key, v in tiles.items() if key not in ("kind", "BLOCK_M")}
    if interpreting():
        tiles.pop("PREFETCH", None)  # no L2 to prefetch into; the emulator runs only the dot's PTX
    _gemv_hfma_kernel[(triton.cdiv(n, tiles["BLOCK_N"]),)](
        x32[r0:], words, sbytes, row_scale, y[r0:], n, x32.stride(0), y.stride(0),
        KW=k // 8, EVEN_N=n % tiles["BLOCK_N"] == 0, X_ROWS=rows, XR=triton.next_power_of_2(rows),
        **tiles, **pdl_launch(x32.device))


def _decode_passes(like: int, n: int, k: int, paired: bool = False) -> list[tuple[int, int, dict]]:
    """How a decode step of `like` rows runs its GEMV: (first row, rows, launch config) per pass."""
    cfg = _gemv_config(like, n, k, paired)
    if cfg["kind"] == "hfma" and like > HFMA_ROWS_PER_PASS:
        return [(r0, min(HFMA_ROWS_PER_PASS, like - r0), _hfma_config(min(HFMA_ROWS_PER_PASS, like - r0), n, k))
                for r0 in range(0, like, HFMA_ROWS_PER_PASS)]
    return [(0, like, cfg)]


def nvfp4_gemv_rows_like(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor,
                         like: int, paired: int = 0, tiled: bool = False) -> torch.Tensor:
    """Speculative verification (ninfer.kernels.linear.rows_like): x [like * width, K] bf16 on CUDA, the rows
    of decode row j (0 <= j < like) at j * width .. (j + 1) * width - 1; each row computed exactly as row j of
    a `like`-row decode GEMV computes it: that pass's kernel and tiles, with more rows of x per launch (the
    kernels' rows are independent: each row's products and sums do not depend on the others'), so the
    weights stream once per launch of up to 4 (packed fp16), 32 (mma: four tiles of 8 tokens sharing each
    decoded block) or 16 (dot) rows, not once per row. paired, tiled: as nvfp4_gemv's (the mma GEMV at every
    `like`)."""
    m, k = x.shape
    n = packed.shape[0]
    if m % like:
        raise ValueError(f"nvfp4_gemv_rows_like: {m} rows are not whole rows of {like} sequences")
    width = m // like
    words, sbytes = _words(packed).contiguous(), scale.view(torch.uint8).contiguous()
    x = x.contiguous()
    x32 = _x_words(x)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    for first, count, cfg in _decode_passes(like, n, k, bool(paired)):
        lo, hi = first * width, (first + count) * width
        kind = cfg["kind"]
        step = {"hfma": HFMA_ROWS_PER_PASS, "mma": MMA_MAX_ROWS}.get(kind, GEMV_MAX_M)
        for r0 in range(lo, hi, step):
            rows = min(step, hi - r0)
            if kind == "hfma":
                _launch_hfma(x32, words, sbytes, row_scale, y, n, k, cfg, r0, rows)
            elif kind == "mma":
                from ninfer.kernels.triton_nvfp4_mma import gemv_mma

                gemv_mma(x32[r0:], words, sbytes, row_scale, y[r0:], rows, n, k, tiles=cfg["TILES"],
                         warps=cfg["WARPS"], prefetch=cfg.get("PREFETCH", 0), stages=cfg.get("STAGES", 0),
                         paired=bool(paired), evict=cfg.get("EVICT", 0), tiled=tiled,
                         launch=pdl_launch(x.device))  # its default depth for the rows
            else:
                nvfp4_gemv(x[r0:r0 + rows], packed, scale, row_scale, out=y[r0:r0 + rows], config=cfg)
    return y


def nvfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16, rows: int = 8, num_warps: int = 4, paired: int = 0,
                     tiled: bool = False) -> torch.Tensor:
    """The weight [N, K] in `dtype` (same values as ninfer.quant.nvfp4.dequantize_nvfp4), in K order also from
    weights stored paired for `paired` warps, and tiled."""
    n = packed.shape[0]
    words = _words(packed)
    sbytes = scale.view(torch.uint8)
    if tiled and not (n % 16 == 0 and words.is_contiguous() and sbytes.is_contiguous()):
        raise ValueError(f"tiled weights are contiguous, N a multiple of 16; got N={n}")
    kw = words.shape[1]
    out = torch.empty(n, kw * 8, dtype=dtype, device=packed.device)
    block_w = 32 * num_warps
    grid = (triton.cdiv(n, rows), triton.cdiv(kw, block_w))
    _dequant_kernel[grid](words, sbytes, row_scale, out, n, kw, words.stride(0), sbytes.stride(0), out.stride(0),
                          ROWS=rows, BLOCK_W=block_w, PAIR_SB=4 * paired, TILED=tiled, num_warps=num_warps)
    return out


def nvfp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor,
                 bias: torch.Tensor | None = None, rows_like: int | None = None, paired: int = 0,
                 tiled: bool = False) -> torch.Tensor:
    """F.linear(x, W, bias) for x [..., K] with W in NVFP4; output in x.dtype. rows_like: see
    nvfp4_gemv_rows_like (bf16 x on CUDA; elsewhere, or past MAX_ROWS_LIKE rows, the plain product). paired: the
    warps W was stored paired for (NVFP4Linear.pair_for_mma_), 0 for K order."""
    n = packed.shape[0]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if (rows_like and x2.shape[0] % rows_like == 0 and x2.shape[0] <= MAX_ROWS_LIKE and x.dtype == torch.bfloat16
            and x.is_cuda):
        y = nvfp4_gemv_rows_like(x2, packed, scale, row_scale, rows_like, paired, tiled)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.view(*lead, n)
    # fp16 x takes the GEMV only for one row: the tensor-core tile (code * scale * 2^-26) is below
    # fp16's range; paired weights the mma GEMV for up to MMA_MAX_ROWS rows
    gemv_rows = MMA_MAX_ROWS if paired and x.dtype == torch.bfloat16 else GEMV_MAX_M
    if x2.shape[0] == 1 or (x2.shape[0] <= gemv_rows and x.dtype != torch.float16):
        y = nvfp4_gemv(x2, packed, scale, row_scale, paired=paired, tiled=tiled)
        if bias is not None:
            y = y + bias.to(y.dtype)
    else:
        w = nvfp4_dequantize(packed, scale, row_scale, x.dtype, paired=paired, tiled=tiled)
        y = torch.nn.functional.linear(x2, w, None if bias is None else bias.to(x.dtype))
    return y.view(*lead, n)
