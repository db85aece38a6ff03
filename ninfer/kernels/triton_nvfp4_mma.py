"""NVFP4 GEMV on Hopper's tensor cores where each lane owns whole scale blocks: for 1..32 rows of x,
`mma.sync.m16n8k16` (fp16 in, fp32 accumulate) fed from registers, the weights streamed several
steps ahead.

Why this layout (s17; before it every mma's 16 K values were one scale block, so the four lanes of a
row group loaded the same 32 bytes and picked their byte of each word by `prmt`): that layout filled
16 registers a row per lane with one step's loads, only one step fitted ahead, and on the H200 it
streamed ~1 TB/s, too few bytes in flight per SM for HBM's latency rather than too many
instructions. Here lane l = 4g + t takes block t of its warp's step (4 blocks of 16 codes), rows g
and g + 8 of each 16-row tile: one 8-byte load a row, no gathering, so DEPTH steps of weights
(3 registers a row each) are in flight per lane. The five 27B GEMVs (bench/results/2026-12-04-h200-s17)
take 124 us at M = 4 (packed fp16: 173), 136 at M = 8 (the earlier layout: 227) and 314 at M = 32
(578); at M = 1 the packed-fp16 GEMV stays ahead (90 against 118).

An mma then mixes four lanes' blocks: K is summed in any order A and B share, so mma i of a step
takes from lane t codes of block t only, and x is loaded to match (token g's 16 values of the
lane's block, 32 bytes). Because four blocks meet in one mma, the block scale is multiplied into
the decoded fp16 A fragment (exact: code * 2^-14 times an E4M3 scale has at most 6 significant
bits and is a multiple of 2^-24). Word a of a block decodes (decode_word_ptx) to pairs (c0, c2),
(c4, c6), (c1, c3), (c5, c7); mma 0 takes (c0, c2) as its k = 2t, 2t + 1 and (c1, c3) as k = 2t + 8,
2t + 9, mma 1 the other two, mmas 2 and 3 word b's; x pairs come from _x_pairs in the same order.

A token's sums are the same instructions whatever the other tokens: one tile of 8 tokens or four
share a launch, and rows past M are zeros that change no other column, so a row computes bit for
bit alike at every M (what speculative verification needs of decode). Warps interleave their steps
along K and are summed at the end in a fixed order (no atomics).

Bytes in flight without registers, timed in s20 on an H100 (bench/results/2026-12-05-h100-s20) and
refuted; the options stay for sweeps. `stages` lets Triton's software pipeline stage the loads through
shared memory with cp.async (45-64 registers, but 4.3-5.1 SASS instructions a weight against 3.5): 2.2-3.4x
slower. `prefetch` adds L2 prefetches (126 registers): ~1.8x slower. Fewer warps a program (more programs
resident) were slower at every M too. Neither option changes a bit of the result. Also refuted (s24, on an H100,
bench/results/2026-12-05-h100-s24): x's fp16 pairs made once per launch by a small kernel instead of in every
program (4.84 instead of 7.12 SASS instructions a weight at four token tiles), which made a C=8 k=3 verify step
4.4 ms slower; and a warpgroup (`tl.dot`, HGMMA) kernel over a fixed 32-token tile, flat in M and bit-exact but
4.4x this kernel's time at 8 rows (its decoded tile goes through shared memory, 1-2 programs an SM).

Paired storage (s30, `pair_weights`, PAIRED): a speculative engine stores its linears so that a lane's blocks of
steps 2q and 2q + 1 sit side by side; one 16-byte load then brings both steps' words and one 2-byte load their
scale bytes (K order: an 8-byte and a 1-byte load a step), while x is still read a step at a time with the four
lanes of a row group on four consecutive blocks. The blocks meeting in each mma are unchanged, so every product is
bit for bit K order's. Giving each lane consecutive blocks of K instead (no repacking) made the lanes read x 2-4
blocks apart, 2-4 times the cache lines a load: faster at one token row, much slower at 8 and 32
(bench/results/2026-12-06-h100-s30).

Programs over several row tiles (s31, PERSIST: program p taking tiles p, p + P, ..., its weight queue running on
into the next tile) were slower at every M they applied to (s32 on an H100, bench/results/2026-12-06-h100-s32: the
five 27B linears at M = 1 in 190 us with two programs an SM, 137 with three, against 114 with one program a tile)
and were removed. So was split K (s32: a row tile's K in 2-4 ranges, a program each, the last to arrive adding their
sums): at every M slower, the five 27B linears at M = 1 in 155-160 us against 116, the N = 5120 ones (320 row
tiles, fewer than the resident programs) included: mlp_down 30.7-32.6 us against 27.8.

Lane layout: a 1-D tensor of 32 * num_warps elements is one element per thread, element i in lane
i % 32 of warp i // 32 (Triton's default blocked layout); under the CPU interpreter
ninfer.kernels.ptx_emulator runs the PTX with that mapping.
"""

from __future__ import annotations

import functools
import json
import os

import torch
import triton
import triton.language as tl

from ninfer.kernels.pdl import pdl_release, pdl_wait
from ninfer.kernels.triton_compat import interpreting
from ninfer.kernels.triton_nvfp4 import _F16_UNSCALE, _prefetch_l2, _x_pairs, decode_word_ptx

K_STEP = 64  # codes of every row one warp takes per step: 4 scale blocks, one a lane
MAX_ROWS = 32  # rows of x a launch takes: four tiles of 8 tokens share each decoded block
# Launch keys (DEPTH, UNROLL, MAXNREG) for one token tile over few row tiles, a grid of at most three programs an SM
# (the 27B's N = 5120 linears: 320). With the table's depth mlp_down's 8-warp programs take 94 registers (Triton 3.6,
# `bench/sass_count.py`), so an SM holds two; capped at 80 (no spill) it holds three. On an H200 (s38,
# bench/results/2026-12-07-h200-s38) that took mlp_down from 25.4 to 22.7 us at 1..8 rows and the 27B's C=1 plain
# step from 7.73 to 7.59 ms, bit for bit the same. NINFER_NVFP4_MMA_FEW (JSON; "{}": the table's launch).
# The default applies to paired weights (a speculative engine's, the measured case); the variable to every launch.
FEW_PROGRAMS = json.loads(os.environ.get("NINFER_NVFP4_MMA_FEW") or '{"MAXNREG": 80}')
_FEW_ALL = "NINFER_NVFP4_MMA_FEW" in os.environ
# The same keys for three or four token tiles (17..32 rows: verification at C = 5..8), whose mlp_down programs take
# 98-128 registers (Triton 3.6; 2 bytes spilled at four tiles). Depth 2 under a cap of 128 spills nothing: on the
# H200 the five 27B linears at 24 rows 243.9 -> 227.4 us, at 32 rows 284.9 -> 285.3 (s38). NINFER_NVFP4_MMA_WIDE
# (JSON; "{}": the table's launch). Paired weights only by default, as above.
WIDE_TILES = json.loads(os.environ.get("NINFER_NVFP4_MMA_WIDE") or '{"DEPTH": 2, "MAXNREG": 128}')
_WIDE_ALL = "NINFER_NVFP4_MMA_WIDE" in os.environ  # as _FEW_ALL


def _decode_asm(byte: int = 0) -> str:
    """PTX: a lane's block of weight rows g and g + 8 ($16, $17: row g's two words, $18, $19 row g + 8's;
    $20, $21 their E4M3 scale bytes, byte `byte` of each) -> the A fragments of the step's four mma, scaled,
    in $4i .. $4i + 3 for mma i: (row g, row g + 8) at its k = 2t, 2t + 1, then at k = 2t + 8, 2t + 9."""
    sel = f"0x{4 + byte}{4 + byte}{byte}{byte}"  # bytes (g, g, g + 8, g + 8) of the two scales
    lines = ["{", ".reg .b32 e, o, u, z, sc, sg, sh, p<8>, q<8>;", ".reg .b16 c0, c1;", "mov.b32 z, 0;",
             f"prmt.b32 sc, $20, $21, {sel}; mov.b32 {{c0, c1}}, sc; "
             "cvt.rn.f16x2.e4m3x2 sg, c0; cvt.rn.f16x2.e4m3x2 sh, c1;"]
    lines += decode_word_ptx("$16", ["p0", "p1", "p2", "p3"])
    lines += decode_word_ptx("$17", ["p4", "p5", "p6", "p7"])
    lines += decode_word_ptx("$18", ["q0", "q1", "q2", "q3"])
    lines += decode_word_ptx("$19", ["q4", "q5", "q6", "q7"])
    for i in range(4):
        lo = 4 * (i // 2) + i % 2  # mma i's pair at k = 2t, 2t + 1; its pair at 2t + 8, 2t + 9 is lo + 2
        lines.append(f"mul.rn.f16x2 ${4 * i}, p{lo}, sg; mul.rn.f16x2 ${4 * i + 1}, q{lo}, sh; "
                     f"mul.rn.f16x2 ${4 * i + 2}, p{lo + 2}, sg; mul.rn.f16x2 ${4 * i + 3}, q{lo + 2}, sh;")
    lines.append("}")
    return "\n".join(lines)


_DECODE = tl.constexpr(_decode_asm())  # every step, or a pair's first (paired weights)
_DECODE1 = tl.constexpr(_decode_asm(1))  # a pair's second step
_MMA = tl.constexpr("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, "
                    "{$8, $9}, {$10, $11, $12, $13};")


@triton.jit
def _decode(wag, wbg, wah, wbh, sg, sh, BYTE: tl.constexpr = 0):
    """BYTE: which byte of sg and sh holds the step's scales (1: a pair's second step, paired weights)."""
    args = [wag, wbg, wah, wbh, sg, sh]
    if BYTE == 0:  # a static choice (a constexpr chosen by a conditional expression does not compile)
        a = tl.inline_asm_elementwise(_DECODE, "=r," * 16 + "r,r,r,r,r,r", args, dtype=(tl.int32,) * 16,
                                      is_pure=True, pack=1)
    else:
        a = tl.inline_asm_elementwise(_DECODE1, "=r," * 16 + "r,r,r,r,r,r", args, dtype=(tl.int32,) * 16,
                                      is_pure=True, pack=1)
    res = ()
    for c in tl.static_range(16):  # a plain tuple, which the interpreter can concatenate
        res = res + (a[c],)
    return res


@triton.jit
def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    d0, d1, d2, d3 = tl.inline_asm_elementwise(_MMA, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
                                               [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
                                               dtype=(tl.float32,) * 4, is_pure=True, pack=1)
    return d0, d1, d2, d3


@triton.jit
def _load_w(wrows, srows, blk, PAIRED: tl.constexpr = False, EVICT: tl.constexpr = 0):
    """Every weight row's words and scale bytes at stored block `blk` ([L]), flat per row: (word a, word b, scale
    byte as int32); PAIRED: blocks blk and blk + 1 (blk even: a lane's pair, pair_weights), (word a, word b) of
    each in one 16-byte load, then both scale bytes in one int32 (byte i: block blk + i) from one 2-byte load.
    EVICT: the loads marked evict-first (weights stream through L2 once)."""
    policy: tl.constexpr = "evict_first" if EVICT else ""
    ws = ()
    for j in tl.static_range(len(wrows)):
        wp = wrows[j] + 2 * blk
        if PAIRED:
            sp = (srows[j] + blk).to(tl.pointer_type(tl.int16), bitcast=True)
            ws = ws + _words4(wp, policy) + (tl.load(sp, eviction_policy=policy).to(tl.int32),)
        else:
            wa, wb = tl.split(tl.load(wp[:, None] + tl.arange(0, 2)[None, :], eviction_policy=policy))
            ws = ws + (wa, wb, tl.load(srows[j] + blk, eviction_policy=policy).to(tl.int32))
    return ws


@triton.jit
def _words4(ptr, policy: tl.constexpr = ""):
    """16 bytes per lane ([L] int32 pointers, 16-byte aligned) -> four [L] int32 words, in order."""
    v = tl.load(ptr[:, None] + tl.arange(0, 4)[None, :], eviction_policy=policy)
    a, b = tl.split(tl.reshape(v, [v.shape[0], 2, 2]))
    w0, w2 = tl.split(a)
    w1, w3 = tl.split(b)
    return w0, w1, w2, w3


@triton.jit
def _load_step(ws, i: tl.constexpr, PAIRED: tl.constexpr, TILES: tl.constexpr):
    """Step i of a load (_load_w's values of the 2 TILES weight rows) in _step's layout: per tile (word a, word b,
    scales) of row g, then of row g + 8; paired, step i (0, 1) of the pair (the scales' byte i is the step's),
    else the load itself."""
    if PAIRED:  # (one return at the end: the compiler takes no early return under a condition)
        out = ()
        for r in tl.static_range(2 * TILES):
            out = out + (ws[5 * r + 2 * i], ws[5 * r + 2 * i + 1], ws[5 * r + 4])
    else:
        out = ws
    return out


@triton.jit
def _load_w_staged(wrows, srows, blk, t):
    """As _load_w, each scale byte read as its aligned 32-bit word (the four lanes t of a row group share it; a
    load of a whole word is what cp.async can stage) and shifted down to byte t."""
    ws = ()
    for j in tl.static_range(len(wrows)):
        wa, wb = tl.split(tl.load(wrows[j][:, None] + (2 * blk)[:, None] + tl.arange(0, 2)[None, :]))
        word = tl.load((srows[j] + (blk - t)).to(tl.pointer_type(tl.int32), bitcast=True))
        ws = ws + (wa, wb, word >> (8 * t))
    return ws


@triton.jit
def _prefetch_w(wrows, srows, blk, KB: tl.constexpr):
    """Start fetching block `blk` ([L], clamped to the row) of every weight row into L2: bytes in flight
    that hold no register."""
    b = tl.minimum(blk, KB - 1)
    for j in tl.static_range(len(wrows)):
        _prefetch_l2(wrows[j] + 2 * b)
        _prefetch_l2(srows[j] + b)


@triton.jit
def _load4(ptr, ok):
    """16 bytes per lane ([L] int32 pointers, masked by ok) -> four [L] int32 words, in order."""
    v = tl.load(ptr[:, None] + tl.arange(0, 4)[None, :], mask=ok[:, None], other=0)
    a, b = tl.split(tl.reshape(v, [v.shape[0], 2, 2]))
    w0, w2 = tl.split(a)
    w1, w3 = tl.split(b)
    return w0, w1, w2, w3


@triton.jit
def _load_x(xrows, xoks, blk):
    """Every token tile's x of block `blk`: token g's 16 bf16 as 8 int32 words a tile, flat."""
    xs = ()
    for j in tl.static_range(len(xrows)):
        xs = xs + _load4(xrows[j] + 8 * blk, xoks[j]) + _load4(xrows[j] + 8 * blk + 4, xoks[j])
    return xs


@triton.jit
def _step(accs, ws, xw, TILES: tl.constexpr, XT: tl.constexpr, BYTE: tl.constexpr = 0):
    """accs (row tile i, token tile j's four at 4 (XT i + j)) += one step of every row tile (its scales in byte
    BYTE of ws' scale values)."""
    xp = ()
    for j in tl.static_range(XT):  # fp16 pairs (x0, x2), (x4, x6), (x1, x3), (x5, x7), then of x8 ..
        xp = xp + _x_pairs(xw[8 * j], xw[8 * j + 1], xw[8 * j + 2], xw[8 * j + 3])
        xp = xp + _x_pairs(xw[8 * j + 4], xw[8 * j + 5], xw[8 * j + 6], xw[8 * j + 7])
    out = ()
    for i in tl.static_range(TILES):
        a = _decode(ws[6 * i], ws[6 * i + 1], ws[6 * i + 3], ws[6 * i + 4], ws[6 * i + 2], ws[6 * i + 5], BYTE)
        for j in tl.static_range(XT):
            d0 = accs[4 * (XT * i + j)]
            d1 = accs[4 * (XT * i + j) + 1]
            d2 = accs[4 * (XT * i + j) + 2]
            d3 = accs[4 * (XT * i + j) + 3]
            # mma i's x pairs: xp[8 j + lo], xp[8 j + lo + 2] with lo = 0, 1, 4, 5 (as _decode_asm's)
            d0, d1, d2, d3 = _mma(a[0], a[1], a[2], a[3], xp[8 * j], xp[8 * j + 2], d0, d1, d2, d3)
            d0, d1, d2, d3 = _mma(a[4], a[5], a[6], a[7], xp[8 * j + 1], xp[8 * j + 3], d0, d1, d2, d3)
            d0, d1, d2, d3 = _mma(a[8], a[9], a[10], a[11], xp[8 * j + 4], xp[8 * j + 6], d0, d1, d2, d3)
            d0, d1, d2, d3 = _mma(a[12], a[13], a[14], a[15], xp[8 * j + 5], xp[8 * j + 7], d0, d1, d2, d3)
            out = out + (d0, d1, d2, d3)
    return out


@triton.jit
def _tile_rows(W32, S8, n0, N, WR: tl.constexpr, SR: tl.constexpr, g, TILES: tl.constexpr, EVEN_N: tl.constexpr,
               KW: tl.constexpr = 0):
    """The lane's weight rows (g and g + 8 of each 16-row tile from row n0): their word and scale-byte pointers
    (rows WR words and SR scale bytes apart). KW > 0: tiled storage (tile_weights), each 16-row tile's KW * 16
    words (KW * 8 scale bytes) together, its rows WR words (SR bytes) apart within a load's chunk."""
    wrows = ()
    srows = ()
    for i in tl.static_range(TILES):
        for h in tl.static_range(2):
            n = n0 + 16 * i + 8 * h + g
            if not EVEN_N:
                n = tl.minimum(n, N - 1)  # rows past N read the last row; they are not stored
            if KW > 0:
                tile = (n // 16).to(tl.int64)
                wrows = wrows + (W32 + tile * (16 * KW) + (n % 16) * WR,)
                srows = srows + (S8 + tile * (8 * KW) + (n % 16) * SR,)
            else:
                wrows = wrows + (W32 + n.to(tl.int64) * WR,)
                srows = srows + (S8 + n.to(tl.int64) * SR,)
    return wrows, srows


@triton.jit
def _store_tiles(accs, RS, Y, n0, M, N, stride_ym, TILES: tl.constexpr, XT: tl.constexpr, WARPS: tl.constexpr):
    """Sum the warps' steps and store rows n0 .. n0 + 16 TILES - 1 of y; lane l = 4 g + t holds rows g, g + 8 and
    tokens 2t, 2t + 1 of each tile."""
    rl = tl.arange(0, 32)
    rg = rl // 4
    tok = 2 * (rl % 4)
    for i in tl.static_range(TILES):
        for h in tl.static_range(2):
            n = n0 + 16 * i + 8 * h + rg
            rs = tl.load(RS + n, mask=n < N, other=0.0) * _F16_UNSCALE
            for j in tl.static_range(XT):
                for c in tl.static_range(2):
                    part = tl.sum(tl.reshape(accs[4 * (XT * i + j) + 2 * h + c], [WARPS, 32]), axis=0)
                    m = 8 * j + tok + c
                    tl.store(Y + m * stride_ym + n, (part * rs).to(Y.dtype.element_ty), mask=(m < M) & (n < N))


@triton.jit
def _zeros(count: tl.constexpr, LANES: tl.constexpr):
    """`count` fp32 accumulators of a value a lane."""
    out = ()
    for _i in tl.static_range(count):
        out = out + (tl.zeros([LANES], dtype=tl.float32),)
    return out


@triton.jit
def _drain(accs, queue, xw, xrows, xoks, blk, DEPTH: tl.constexpr, LOADS: tl.constexpr, G: tl.constexpr,
           STEPS: tl.constexpr, SB: tl.constexpr, NG: tl.constexpr, PAIRED: tl.constexpr, TILES: tl.constexpr,
           XT: tl.constexpr):
    """The steps of a row tile's last DEPTH loads, in the queue already (x loaded one step ahead while one is left)."""
    for d in tl.static_range(DEPTH):
        cur = _part(queue, NG * d, NG)
        for i in tl.static_range(G):
            if (LOADS - DEPTH + d) * G + i + 1 < STEPS:  # (inline: a constexpr in a variable is a runtime value)
                xw_next = _load_x(xrows, xoks, blk + ((LOADS - DEPTH + d) * G + i + 1) * SB)
            accs = _step(accs, _load_step(cur, i, PAIRED, TILES), xw, TILES, XT, i)
            if (LOADS - DEPTH + d) * G + i + 1 < STEPS:
                xw = xw_next
    return accs


@triton.jit
def _part(tup, first, count: tl.constexpr):
    res = ()
    for c in tl.static_range(count):
        res = res + (tup[first + c],)
    return res


@triton.jit
def _gemv_mma_kernel(
    X32, W32, S8, RS, Y,
    M, N, stride_x32, stride_ym,
    KW: tl.constexpr, TILES: tl.constexpr, WARPS: tl.constexpr, EVEN_N: tl.constexpr, XT: tl.constexpr,
    DEPTH: tl.constexpr, UNROLL: tl.constexpr = 1, USE_PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
    STAGES: tl.constexpr = 0, PAIRED: tl.constexpr = False, EVICT: tl.constexpr = 0, W_ROW: tl.constexpr = 0,
    S_ROW: tl.constexpr = 0, TILED: tl.constexpr = False,
):
    """One program per 16 * TILES weight rows and all of K, its WARPS warps interleaving steps of 4
    blocks; M <= 8 XT rows of x (X32: bf16 pairs as int32). W32: rows of KW words; S8: rows of KW / 2
    scale bytes. DEPTH (<= the steps a warp takes) steps of weights are loaded ahead, x one step; PREFETCH > 0:
    the weights PREFETCH steps past those are prefetched into L2. STAGES > 0: instead of that register queue,
    Triton's software pipeline stages STAGES steps of loads through shared memory (cp.async), so the bytes in
    flight hold no registers. PAIRED: W32 and S8 in pair_weights' order (a lane's blocks of steps 2q and 2q + 1
    side by side), loaded a pair of steps at a time (DEPTH then counts pairs); the same blocks meet in the same
    mma as unpaired, so every result is bit for bit the unpaired launch's. W_ROW / S_ROW: the rows' strides in
    words / scale bytes where they are stored apart (padded rows; 0: KW, KW / 2). TILED (paired only): W32 and S8
    in tile_weights' order, each 16-row tile's loads one after another, so a program streams one contiguous run."""
    pdl_release(USE_PDL)
    LANES: tl.constexpr = 32 * WARPS
    KB: tl.constexpr = KW // 2
    SB: tl.constexpr = 4 * WARPS  # blocks per step of all warps
    STEPS: tl.constexpr = KB // SB
    G: tl.constexpr = 2 if PAIRED else 1  # steps a weight load covers
    LOADS: tl.constexpr = STEPS // G
    NG: tl.constexpr = (2 * G + 1) * 2 * TILES  # values a load gives: _load_w's of 2 TILES rows
    idx = tl.arange(0, LANES)
    lane = idx % 32
    g = lane // 4
    blk = (idx // 32) * 4 + lane % 4  # this lane's block at step 0 (in K)
    wblk = blk * G  # and where its first load's blocks are stored (paired: its pair of the first two steps)
    pid = tl.program_id(0)
    n0 = pid * (16 * TILES)
    WR: tl.constexpr = 2 * G * SB if TILED else (W_ROW if W_ROW else KW)  # tiled: a row's words of one load
    SR: tl.constexpr = G * SB if TILED else (S_ROW if S_ROW else KB)
    QS: tl.constexpr = 16 if TILED else 1  # tiled: a load's blocks of all 16 rows lie between one load and the next
    TKW: tl.constexpr = KW if TILED else 0  # (a conditional expression as an argument is no constexpr)
    wrows, srows = _tile_rows(W32, S8, n0, N, WR, SR, g, TILES, EVEN_N, TKW)
    xrows = ()
    xoks = ()
    for j in tl.static_range(XT):
        xrows = xrows + (X32 + (8 * j + g) * stride_x32,)
        xoks = xoks + (8 * j + g < M,)
    accs = _zeros(4 * TILES * XT, LANES)
    if STAGES > 0:
        pdl_wait(USE_PDL)
        t = lane % 4
        for s in tl.range(0, STEPS, num_stages=STAGES, loop_unroll_factor=UNROLL):
            ws = _load_w_staged(wrows, srows, blk + s * SB, t)
            xw = _load_x(xrows, xoks, blk + s * SB)
            accs = _step(accs, ws, xw, TILES, XT)
    else:
        queue = ()
        for d in tl.static_range(DEPTH):  # the first loads' weights before waiting on the kernel before
            queue = queue + _load_w(wrows, srows, wblk + d * G * SB * QS, PAIRED, EVICT)
        for s in tl.static_range(PREFETCH):  # (unpaired only)
            _prefetch_w(wrows, srows, blk + (DEPTH + s) * SB, KB)
        pdl_wait(USE_PDL)
        xw = _load_x(xrows, xoks, blk)
        for q in tl.range(0, LOADS - DEPTH, loop_unroll_factor=UNROLL):  # load q + DEPTH; compute load q's steps
            if PREFETCH > 0:
                _prefetch_w(wrows, srows, blk + (q + DEPTH + PREFETCH) * SB, KB)
            nxt = _load_w(wrows, srows, wblk + (q + DEPTH) * G * SB * QS, PAIRED, EVICT)
            cur = _part(queue, 0, NG)
            for i in tl.static_range(G):  # x one step ahead
                xw_next = _load_x(xrows, xoks, blk + (q * G + i + 1) * SB)
                accs = _step(accs, _load_step(cur, i, PAIRED, TILES), xw, TILES, XT, i)
                xw = xw_next
            queue = _part(queue, NG, NG * (DEPTH - 1)) + nxt
        # the last DEPTH loads' steps, loaded already
        accs = _drain(accs, queue, xw, xrows, xoks, blk, DEPTH, LOADS, G, STEPS, SB, NG, PAIRED, TILES, XT)
    _store_tiles(accs, RS, Y, n0, M, N, stride_ym, TILES, XT, WARPS)


def mma_fits(m: int, k: int, warps: int) -> bool:
    """Whether the kernel takes this shape: 1..MAX_ROWS rows of x, whole steps of 4 blocks for every warp."""
    return 1 <= m <= MAX_ROWS and k % (K_STEP * warps) == 0


def default_depth(xt: int, k: int = 0) -> int:
    """Steps of weights loaded ahead by token tiles: fewer where the accumulators and x take the registers
    (the H200 sweep: at one tile 4 beat 1, 6 and 8; at four tiles 2 beat 3 and 4). Long rows (K > 8192, the
    27B MLP down projection, N = 5120) take 3 at one tile: 80 registers instead of 98 fit three 8-warp programs
    an SM, so its 320 programs run in one wave, not 1.2 (s20 on an H100: 25.7-27.7 us against 29.9-35.0 at
    M = 1..8, bench/results/2026-12-05-h100-s20)."""
    if xt == 1 and k > 8192:
        return 3
    return (4, 3, 2, 2)[xt - 1]


def pairable(k: int, warps: int) -> bool:
    """Whether weights of rows k long can be stored paired for launches of `warps` warps: whole steps of every
    warp, an even number of them."""
    return k % (K_STEP * warps) == 0 and (k // K_STEP // warps) % 2 == 0


def pair_order(k: int, warps: int, device=None) -> torch.Tensor:
    """Paired storage (PAIRED): stored block p of a row holds block pair_order[p] (in K). Unpaired, lane L = 4 w + t
    (warp w, row-group lane t) takes block s * SB + L at step s (SB = 4 warps); paired, its blocks of steps 2q and
    2q + 1 are stored side by side at 2 q SB + 2 L and 2 q SB + 2 L + 1, so one 16-byte load brings both steps'
    words and one 2-byte load their scales, while x is still read a step at a time, four lanes on four
    consecutive blocks (a layout that instead gave each lane consecutive blocks of K loaded x 2-4 blocks apart:
    bench/results/2026-12-06-h100-s30)."""
    sb = 4 * warps
    p = torch.arange(k // 16, device=device)
    q, r = p // (2 * sb), p % (2 * sb)
    return (2 * q + r % 2) * sb + r // 2


def pair_weights(packed: torch.Tensor, scale: torch.Tensor, warps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 codes [N, K/2] (uint8) and block scales [N, K/16] stored paired for `warps`-warp launches (new
    tensors; the row scales do not move)."""
    return _reorder(packed, scale, pair_order(packed.shape[1] * 2, warps, packed.device))


def _reorder(packed: torch.Tensor, scale: torch.Tensor, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = packed.shape[0]
    scale_bytes = scale.view(torch.uint8)[:, order].contiguous()  # (index the bytes: fp8 indexing is not everywhere)
    return packed.view(n, -1, 8)[:, order].reshape(n, -1).contiguous(), scale_bytes.view(scale.dtype)


def tile_weights(packed: torch.Tensor, scale: torch.Tensor, warps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights stored paired for `warps` warps (pair_weights) and tiled (TILED): each 16-row tile's rows side by side
    one load at a time (a load: two steps of every warp, 8 blocks a warp of each row), so a program of the mma GEMV
    reads one contiguous run instead of 16 rows far apart. Same shapes, new tensors; N a multiple of 16."""
    n, half_k = packed.shape
    if n % 16 or not pairable(half_k * 2, warps):
        raise ValueError(f"tiled weights take N a multiple of 16 and whole pairs of steps; got N={n}, K={half_k * 2}")
    return _swap_tile_axes(packed, scale, warps, rows_first=True)


def untile_weights(packed: torch.Tensor, scale: torch.Tensor, warps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tile_weights undone: the codes and block scales back in paired order."""
    return _swap_tile_axes(packed, scale, warps, rows_first=False)


def _swap_tile_axes(packed, scale, warps: int, *, rows_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Within each 16-row tile, swap its row axis and its load axis: (rows, loads) -> (loads, rows) when the
    input is rows_first (paired order), else back. Codes and scale bytes alike."""
    n, half_k = packed.shape
    loads = half_k * 2 // K_STEP // warps // 2
    inner = (16, loads) if rows_first else (loads, 16)

    def swapped(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(n // 16, *inner, -1).transpose(1, 2).reshape(n, -1).contiguous()

    return swapped(packed), swapped(scale.view(torch.uint8)).view(scale.dtype)


def unpair_weights(packed: torch.Tensor, scale: torch.Tensor, warps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pair_weights undone: the codes and block scales back in K order."""
    return _reorder(packed, scale, torch.argsort(pair_order(packed.shape[1] * 2, warps, packed.device)))


def gemv_mma(x32, words, sbytes, row_scale, y, m: int, n: int, k: int, *, tiles: int, warps: int,
              launch: dict, depth: int | None = None, unroll: int | None = None, prefetch: int = 0,
              stages: int = 0, paired: bool = False, evict: int = 0, tiled: bool = False,
              maxnreg: int | None = None) -> None:
    """y[:m] = x @ W^T: x32 the bf16 rows of x as int32 pairs, words / sbytes W's codes and scale bytes
    (rows of contiguous values, any row stride; paired: in pair_weights' order for `warps`), launch: the PDL launch options
    (ninfer.kernels.pdl). Neither `tiles` (16-row tiles a program), `depth` (steps, or pairs of steps, loaded
    ahead), `unroll` (the K loop's), `prefetch` (L2 prefetch distance in steps; none under the interpreter, which
    has no L2), `stages` (shared-memory staging instead of the register queue), `paired`, `evict` (weight loads
    evict-first), `maxnreg` (a cap on registers a thread, so more programs fit an SM) changes a result; `warps` does
    (which blocks meet in one mma)."""
    if not mma_fits(m, k, warps):
        raise ValueError(f"the mma GEMV takes 1..{MAX_ROWS} rows of x and K a multiple of {K_STEP * warps}; "
                         f"got M={m}, K={k}")
    if paired and (stages or prefetch or not pairable(k, warps)):
        raise ValueError(f"paired weights take neither staging nor prefetch, and K={k} whole pairs of steps of "
                         f"{warps} warps")
    if tiled and not (paired and n % 16 == 0 and words.is_contiguous() and sbytes.is_contiguous()):
        raise ValueError(f"tiled weights are contiguous paired weights of N a multiple of 16; got N={n}")
    xt = triton.cdiv(m, 8)
    grid = (triton.cdiv(n, 16 * tiles),)
    keys = {}
    if FEW_PROGRAMS and xt == 1 and (paired or _FEW_ALL) and y.is_cuda and grid[0] <= 3 * _sm_count(y.device):
        keys = FEW_PROGRAMS
    elif xt >= 3 and (paired or _WIDE_ALL):
        keys = WIDE_TILES
    depth, unroll, maxnreg = depth or keys.get("DEPTH"), unroll or keys.get("UNROLL"), maxnreg or keys.get("MAXNREG")
    per_load = 2 if paired else 1
    loads = k // K_STEP // warps // per_load
    depth = max(1, min(depth or -(-default_depth(xt, k) // per_load), loads))
    unroll = unroll or (1 if stages else depth)  # the queue of loaded steps then rotates by renaming registers
    _gemv_mma_kernel[grid](x32, words, sbytes.view(torch.uint8), row_scale, y, m, n, x32.stride(0), y.stride(0),
                            KW=k // 8, TILES=tiles, WARPS=warps, EVEN_N=n % (16 * tiles) == 0, XT=xt, DEPTH=depth,
                            UNROLL=unroll, PREFETCH=0 if interpreting() else prefetch, STAGES=stages, PAIRED=paired,
                            EVICT=evict, W_ROW=_row_stride(words, k // 8), S_ROW=_row_stride(sbytes, k // 16), TILED=tiled,
                            num_warps=warps, num_stages=max(stages, 1), **launch,
                            **({"maxnreg": maxnreg} if maxnreg and not interpreting() else {}))


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _row_stride(t: torch.Tensor, row: int) -> int:
    """A launch's W_ROW / S_ROW: 0 for rows stored back to back (one compiled kernel for them all), else the stride."""
    assert t.stride(-1) == 1, "the mma GEMV reads rows of contiguous values"
    return 0 if t.stride(0) == row else t.stride(0)


def check_against_reference(device: torch.device) -> str | None:
    """The kernel beside the dequantized reference on one fixed problem on `device` (8 rows of x,
    ragged N, the table's tile): None when it agrees, else why not. The runner calls this at
    start-up, before capturing graphs, when the model has NVFP4 weights: the lane layout the kernel
    assumes is Triton's, so a Triton that lays 1-D tensors out otherwise must not serve from it."""
    from ninfer.kernels.triton_nvfp4 import nvfp4_gemv
    from ninfer.quant.nvfp4 import dequantize_nvfp4

    try:
        x, (packed, scale, row_scale) = _check_problem(device)
        want = x.float() @ dequantize_nvfp4(packed, scale, row_scale).T
        got = nvfp4_gemv(x, packed, scale, row_scale, config=dict(kind="mma", TILES=2, WARPS=8, DEPTH=2))
        err = (got.float() - want).abs().max().item()
        bound = 2**-8 * want.abs().max().item()
    except Exception as exc:  # a Triton build that cannot compile it: the packed-fp16 GEMV runs
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if not err <= bound:
        return f"max error {err:.3g} over the bound {bound:.3g}"
    return None


def check_paired(device: torch.device, tiled: bool = False) -> str | None:
    """The mma launch and the dequantizing kernel (prefill) on paired weights (and tiled ones) beside K order's, on
    check_against_reference's problem: None when bit for bit equal, else why not (the runner then keeps K order)."""
    from ninfer.kernels.triton_nvfp4 import nvfp4_dequantize, nvfp4_gemv

    try:
        x, (packed, scale, row_scale) = _check_problem(device)
        paired = pair_weights(packed, scale, 8)
        want = nvfp4_gemv(x, packed, scale, row_scale, config=dict(kind="mma", TILES=2, WARPS=8, DEPTH=2))
        got = nvfp4_gemv(x, *paired, row_scale, paired=8, config=dict(kind="mma", TILES=2, WARPS=8, DEPTH=1))
        dequantized = torch.equal(nvfp4_dequantize(*paired, row_scale, paired=8),
                                  nvfp4_dequantize(packed, scale, row_scale))
        if tiled:
            tiles = tile_weights(*paired, 8)
            got_tiled = nvfp4_gemv(x, *tiles, row_scale, paired=8, tiled=True)
            dequantized_tiled = torch.equal(nvfp4_dequantize(*tiles, row_scale, paired=8, tiled=True),
                                            nvfp4_dequantize(packed, scale, row_scale))
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if not torch.equal(got, want):
        return "the mma GEMV gives other products on paired weights than on K order"
    if not dequantized:
        return "the dequantizing kernel gives another weight from paired storage"
    if tiled and not torch.equal(got_tiled, want):
        return "the mma GEMV gives other products on tiled weights than on K order"
    return None if not tiled or dequantized_tiled else "the dequantizing kernel gives another weight from tiled storage"


def _check_problem(device: torch.device):
    """8 rows of bf16 x and an 80 x 1024 NVFP4 weight (ragged N for 32-row programs), fixed by a seed."""
    from ninfer.quant.nvfp4 import quantize_nvfp4

    gen = torch.Generator(device="cpu").manual_seed(99)
    w = (torch.randn(80, 1024, generator=gen) * 0.02).to(device)
    x = torch.randn(8, 1024, generator=gen).to(device=device, dtype=torch.bfloat16)
    return x, quantize_nvfp4(w)
