"""NVFP4 GEMV on Hopper's tensor cores for 1..8 rows of x: `mma.sync.m16n8k16` (fp16 in, fp32
accumulate) fed straight from registers, so the decoded weights never pass through shared memory.

Why: the packed-fp16 GEMV (triton_nvfp4._gemv_hfma_kernel) pays one HFMA2 per two weights per row of
x, so its instructions per weight grow with M (~2.6 at M = 1, ~5.3 at M = 4, two passes at M = 8),
and NVFP4 decode at C = 8 ran slower than bf16. Here the weights are the mma's A operand (16 weight
rows x 16 K) and x^T its B operand (16 K x 8 tokens): one decode serves all eight tokens, and the
multiply-adds cost the tensor cores, not the issue slots.

Layout. An mma's 16 K values are one scale block. The block scale multiplies the decoded fp16 A
fragment (one HMUL2 per two weights, exact: see _pair_mma_asm), so every token tile's mma accumulate in
place and a token tile costs its two mma alone (before, 8 fp32 FMA per block pair and tile). Lane l = 4g + t
holds rows g and g + 8 of a 16-row tile; of each block (two words) it takes byte t of both words,
i.e. codes 2t, 2t + 1 (word 0) and 8 + 2t, 9 + 2t (word 1). Any order of K that A and B share leaves
the dot product unchanged, so the decode's pairs (c0, c2), (c1, c3) are the A fragment's a0 / a2,
and x is paired to match: (x[2t], x[8 + 2t]) and (x[2t + 1], x[9 + 2t]). Three `prmt` gather a
lane's bytes of two blocks into one word, which decodes as in the packed-fp16 GEMV (11 instructions
for 8 codes, worth code * 2^-14). Each warp takes 4 blocks (32 bytes of every row) per step; the
warps of a program interleave their steps along K and are summed at the end, so the result is
deterministic (no atomics).

This relies on Triton giving a 1-D tensor of 32 * num_warps elements one element per thread, element
i in lane i % 32 of warp i // 32 (its default blocked layout; the [.., 4] loads keep a row in one
thread). Under Triton's CPU interpreter ninfer.kernels.ptx_emulator runs the PTX with the same lane
mapping; the CUDA tests check the kernel against the reference on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.pdl import pdl_release, pdl_wait
from ninfer.kernels.triton_nvfp4 import _F16_UNSCALE, _x_pairs, decode_word_ptx

K_STEP = 64  # codes of every row one warp takes per step: 4 scale blocks, 32 bytes
# Rows of x one launch takes: up to four tiles of 8 tokens share each decoded weight block. Decode
# (M <= 8) runs one tile; speculative verification (nvfp4_gemv_rows_like) up to four, so 8 sequences'
# 4 verify positions stream the weights once, each token's sums computed as a one-tile launch does.
MAX_ROWS = 32

_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"


def _pair_mma_asm(pair: int, xt: int = 1) -> str:
    """PTX for two scale blocks (2 pair, 2 pair + 1 of the step) of a 16-row tile against `xt` tiles of
    8 tokens: the blocks are decoded and scaled once (scale folded into the fp16 A fragment, exactly), then
    each token tile runs the same two mma accumulating in place, so a token's sums do not depend on how
    many tiles share the launch.
    With o = 4 xt outputs: $4j..$4j+3 tile j's acc + A @ B for D[g][2t], D[g][2t+1], D[g+8][2t],
    D[g+8][2t+1]. Inputs: $o..$o+3 row g's four words of the two blocks, $o+4..$o+7 row g + 8's; $o+8
    the byte selector t | (t + 4) << 4; from $o+9 four x pairs per token tile (block 0's b0, block 1's
    b0, block 0's b1, block 1's b1: _x_pairs' order); then the step's scale bytes of rows g and g + 8;
    then four accumulators per token tile."""
    o = 4 * xt
    x0, s0, a0 = o + 9, o + 9 + 4 * xt, o + 11 + 4 * xt
    lines = ["{", ".reg .b32 e, o, u, z, p, q, G, H, sc, g<4>, h<4>, sg0, sh0, sg1, sh1;", ".reg .b16 c0, c1;",
             "mov.b32 z, 0;"]
    for word, first in (("G", o), ("H", o + 4)):  # byte t of each of the four words -> one word of 8 codes
        lines.append(f"prmt.b32 p, ${first}, ${first + 1}, ${o + 8}; prmt.b32 q, ${first + 2}, ${first + 3}, ${o + 8}; "
                     f"prmt.b32 {word}, p, q, 0x5410;")
    lines += decode_word_ptx("G", [f"g{i}" for i in range(4)])  # g0 = (c0, c2) block 0, g1 block 1, g2 = (c1, c3) block 0
    lines += decode_word_ptx("H", [f"h{i}" for i in range(4)])
    # block 2 pair + i's scales of rows g and g + 8 (bytes i of $s0, $s0 + 1) as fp16 pairs (s, s); code * 2^-14
    # times an E4M3 scale has at most 6 significant bits and is a multiple of 2^-24, so fp16 holds it exactly
    for i in range(2):
        b = 2 * pair + i
        lines.append(f"prmt.b32 sc, ${s0}, ${s0 + 1}, {hex(b | b << 4 | (4 + b) << 8 | (4 + b) << 12)}; "
                     f"mov.b32 {{c0, c1}}, sc; cvt.rn.f16x2.e4m3x2 sg{i}, c0; cvt.rn.f16x2.e4m3x2 sh{i}, c1;")
        lines.append(f"mul.rn.f16x2 g{i}, g{i}, sg{i}; mul.rn.f16x2 g{i + 2}, g{i + 2}, sg{i}; "
                     f"mul.rn.f16x2 h{i}, h{i}, sh{i}; mul.rn.f16x2 h{i + 2}, h{i + 2}, sh{i};")
    for j in range(xt):
        xj, aj = x0 + 4 * j, a0 + 4 * j
        out = "{" + ", ".join(f"${4 * j + c}" for c in range(4)) + "}"
        acc = "{" + ", ".join(f"${aj + c}" for c in range(4)) + "}"
        lines.append(f"{_MMA} {out}, {{g0, h0, g2, h2}}, {{${xj}, ${xj + 2}}}, {acc};")
        lines.append(f"{_MMA} {out}, {{g1, h1, g3, h3}}, {{${xj + 1}, ${xj + 3}}}, {out};")
    lines.append("}")
    return "\n".join(lines)


# [pair][token tiles - 1]
_PAIR_MMA0_1 = tl.constexpr(_pair_mma_asm(0, 1))
_PAIR_MMA1_1 = tl.constexpr(_pair_mma_asm(1, 1))
_PAIR_MMA0_2 = tl.constexpr(_pair_mma_asm(0, 2))
_PAIR_MMA1_2 = tl.constexpr(_pair_mma_asm(1, 2))
_PAIR_MMA0_3 = tl.constexpr(_pair_mma_asm(0, 3))
_PAIR_MMA1_3 = tl.constexpr(_pair_mma_asm(1, 3))
_PAIR_MMA0_4 = tl.constexpr(_pair_mma_asm(0, 4))
_PAIR_MMA1_4 = tl.constexpr(_pair_mma_asm(1, 4))


def _mma_constraints(xt: int) -> str:
    return ",".join(["=f"] * (4 * xt) + ["r"] * (11 + 4 * xt) + ["f"] * (4 * xt))


_MMA_CONSTRAINTS_1 = tl.constexpr(_mma_constraints(1))
_MMA_CONSTRAINTS_2 = tl.constexpr(_mma_constraints(2))
_MMA_CONSTRAINTS_3 = tl.constexpr(_mma_constraints(3))
_MMA_CONSTRAINTS_4 = tl.constexpr(_mma_constraints(4))


@triton.jit
def _pair_mma(acc, ws, sel, xs, sgw, shw, PAIR: tl.constexpr, XT: tl.constexpr):
    """acc (4 [L] fp32 per token tile) += blocks 2 PAIR, 2 PAIR + 1 of one row tile. ws: rows g's then
    g + 8's four words of those blocks; xs: the pair's four x pairs per token tile; sgw / shw: the
    step's scale bytes (int32)."""
    args = ws + (sel,) + xs + (sgw, shw) + acc
    # spelled out: Triton takes neither a conditional expression over two PTX strings nor a tuple of them
    if PAIR == 0:
        if XT == 1:
            out = tl.inline_asm_elementwise(_PAIR_MMA0_1, _MMA_CONSTRAINTS_1, args,
                                            dtype=(tl.float32,) * 4, is_pure=True, pack=1)
        elif XT == 2:
            out = tl.inline_asm_elementwise(_PAIR_MMA0_2, _MMA_CONSTRAINTS_2, args,
                                            dtype=(tl.float32,) * 8, is_pure=True, pack=1)
        elif XT == 3:
            out = tl.inline_asm_elementwise(_PAIR_MMA0_3, _MMA_CONSTRAINTS_3, args,
                                            dtype=(tl.float32,) * 12, is_pure=True, pack=1)
        else:
            out = tl.inline_asm_elementwise(_PAIR_MMA0_4, _MMA_CONSTRAINTS_4, args,
                                            dtype=(tl.float32,) * 16, is_pure=True, pack=1)
    else:
        if XT == 1:
            out = tl.inline_asm_elementwise(_PAIR_MMA1_1, _MMA_CONSTRAINTS_1, args,
                                            dtype=(tl.float32,) * 4, is_pure=True, pack=1)
        elif XT == 2:
            out = tl.inline_asm_elementwise(_PAIR_MMA1_2, _MMA_CONSTRAINTS_2, args,
                                            dtype=(tl.float32,) * 8, is_pure=True, pack=1)
        elif XT == 3:
            out = tl.inline_asm_elementwise(_PAIR_MMA1_3, _MMA_CONSTRAINTS_3, args,
                                            dtype=(tl.float32,) * 12, is_pure=True, pack=1)
        else:
            out = tl.inline_asm_elementwise(_PAIR_MMA1_4, _MMA_CONSTRAINTS_4, args,
                                            dtype=(tl.float32,) * 16, is_pure=True, pack=1)
    res = ()
    for c in tl.static_range(4 * XT):  # a plain tuple, which the interpreter can concatenate
        res = res + (out[c],)
    return res


@triton.jit
def _load4(ptr):
    """16 bytes per lane ([L] int32 pointers) -> four [L] int32 words, in order."""
    v = tl.load(ptr[:, None] + tl.arange(0, 4)[None, :])
    a, b = tl.split(tl.reshape(v, [v.shape[0], 2, 2]))
    w0, w2 = tl.split(a)
    w1, w3 = tl.split(b)
    return w0, w1, w2, w3


@triton.jit
def _load_step(wrows, srows, xrows, xoks, kb):
    """One step's operands for this lane (kb: the step's first scale block): per weight row its 8
    words (32 bytes, the same for the 4 lanes of a row) and 4 scale bytes as one int32, and per token
    tile token g's x pairs of the 4 blocks (the words 8b + t and 8b + 4 + t: x[16b + 2t ..] and
    x[16b + 8 + 2t ..])."""
    words = ()
    scales = ()
    for j in tl.static_range(len(wrows)):
        words = words + _load4(wrows[j] + kb * 2) + _load4(wrows[j] + kb * 2 + 4)
        scales = scales + (tl.load(srows[j] + kb // 4),)
    return words, scales, _load_xs(xrows, xoks, kb)


@triton.jit
def _load_xs(xrows, xoks, kb):
    """_load_x of every token tile: tile j's 8 pairs at 8 j."""
    xs = ()
    for j in tl.static_range(len(xrows)):
        xs = xs + _load_x(xrows[j], xoks[j], kb)
    return xs


@triton.jit
def _load_x(xrow, xok, kb):
    """Token g's x pairs of the step's 4 blocks, in the order _pair_mma takes them per block pair."""
    xs = ()
    for pair in tl.static_range(2):
        b = kb + 2 * pair
        q0 = tl.load(xrow + b * 8, mask=xok, other=0)
        q1 = tl.load(xrow + b * 8 + 4, mask=xok, other=0)
        r0 = tl.load(xrow + b * 8 + 8, mask=xok, other=0)
        r1 = tl.load(xrow + b * 8 + 12, mask=xok, other=0)
        xs = xs + _x_pairs(q0, q1, r0, r1)
    return xs


@triton.jit
def _step_mma(accs, words, scales, xs, sel, TILES: tl.constexpr, XT: tl.constexpr):
    """accs (4 per row tile and token tile, row tile i's at 4 XT i) += one step (4 blocks) of every
    row tile."""
    out = ()
    for i in tl.static_range(TILES):
        acc = ()
        for c in tl.static_range(4 * XT):
            acc = acc + (accs[4 * XT * i + c],)
        for pair in tl.static_range(2):
            # row g's words at 16 i, row g + 8's at 16 i + 8; the pair's four at 4 pair
            ws = (words[16 * i + 4 * pair], words[16 * i + 4 * pair + 1], words[16 * i + 4 * pair + 2],
                  words[16 * i + 4 * pair + 3], words[16 * i + 4 * pair + 8], words[16 * i + 4 * pair + 9],
                  words[16 * i + 4 * pair + 10], words[16 * i + 4 * pair + 11])
            x = ()
            for j in tl.static_range(XT):  # token tile j's pairs: 8 j + 4 pair ..
                x = x + (xs[8 * j + 4 * pair], xs[8 * j + 4 * pair + 1], xs[8 * j + 4 * pair + 2],
                         xs[8 * j + 4 * pair + 3])
            acc = _pair_mma(acc, ws, sel, x, scales[2 * i], scales[2 * i + 1], pair, XT)
        out = out + acc
    return out


@triton.jit
def _gemv_mma_kernel(
    X32, W32, S32, RS, Y,
    M, N, stride_x32, stride_ym,
    KW: tl.constexpr, TILES: tl.constexpr, WARPS: tl.constexpr, EVEN_N: tl.constexpr, XT: tl.constexpr = 1,
    USE_PDL: tl.constexpr = False,
):
    """One program per 16 * TILES weight rows and all of K, its WARPS warps interleaving their steps;
    M <= 8 XT rows of x (X32: bf16 pairs as int32), XT tiles of 8 tokens sharing each decoded block.
    W32: rows of KW words; S32: rows of KW / 8 int32 (4 scale bytes each); KW a multiple of 8 * WARPS
    (K of 64 * WARPS)."""
    pdl_release(USE_PDL)
    LANES: tl.constexpr = 32 * WARPS
    STEPS: tl.constexpr = KW // 8 // WARPS
    idx = tl.arange(0, LANES)
    lane = idx % 32
    warp = idx // 32
    g = lane // 4
    t = lane % 4
    sel = t | (t + 4) << 4
    n0 = tl.program_id(0) * (16 * TILES)
    wrows = ()
    srows = ()
    for i in tl.static_range(TILES):
        for h in tl.static_range(2):
            n = n0 + 16 * i + 8 * h + g
            if not EVEN_N:
                n = tl.minimum(n, N - 1)  # rows past N read the last row; they are not stored
            wrows = wrows + (W32 + n.to(tl.int64) * KW,)
            srows = srows + (S32 + n.to(tl.int64) * (KW // 8),)
    xrows = ()
    xoks = ()
    for j in tl.static_range(XT):
        xrows = xrows + (X32 + (8 * j + g) * stride_x32 + t,)
        xoks = xoks + (8 * j + g < M,)
    accs = ()
    for _i in tl.static_range(4 * TILES * XT):
        accs = accs + (tl.zeros([LANES], dtype=tl.float32),)
    kb = warp * 4  # this warp's first step: scale blocks 4 w .. 4 w + 3
    words = ()
    scales = ()
    for j in tl.static_range(2 * TILES):  # the first step's weights before waiting on the kernel before
        words = words + _load4(wrows[j] + kb * 2) + _load4(wrows[j] + kb * 2 + 4)
        scales = scales + (tl.load(srows[j] + kb // 4),)
    pdl_wait(USE_PDL)
    xs = _load_xs(xrows, xoks, kb)
    for step in tl.range(1, STEPS, loop_unroll_factor=2):  # load step `step` while computing step `step - 1`
        words_next, scales_next, xs_next = _load_step(wrows, srows, xrows, xoks, (step * WARPS + warp) * 4)
        accs = _step_mma(accs, words, scales, xs, sel, TILES, XT)
        words = words_next
        scales = scales_next
        xs = xs_next
    accs = _step_mma(accs, words, scales, xs, sel, TILES, XT)
    # sum the warps' steps; lane l = 4 g + t holds rows g, g + 8 and tokens 2t, 2t + 1
    rl = tl.arange(0, 32)
    rg = rl // 4
    tok = 2 * (rl % 4)
    for i in tl.static_range(TILES):
        for h in tl.static_range(2):
            n = n0 + 16 * i + 8 * h + rg
            rs = tl.load(RS + n, mask=n < N, other=0.0) * _F16_UNSCALE
            for j in tl.static_range(XT):
                for c in tl.static_range(2):
                    part = tl.sum(tl.reshape(accs[4 * XT * i + 4 * j + 2 * h + c], [WARPS, 32]), axis=0)
                    m = 8 * j + tok + c
                    tl.store(Y + m * stride_ym + n, (part * rs).to(Y.dtype.element_ty), mask=(m < M) & (n < N))


def mma_fits(m: int, k: int, warps: int) -> bool:
    """Whether the mma GEMV takes this shape: 1..MAX_ROWS rows of x, whole K tiles for every warp."""
    return 1 <= m <= MAX_ROWS and k % (K_STEP * warps) == 0


def gemv_mma(x32, words, sbytes, row_scale, y, m: int, n: int, k: int, *, tiles: int, warps: int,
             launch: dict) -> None:
    """y[:m] = x @ W^T: x32 the bf16 rows of x as int32 pairs, words / sbytes W's codes and scale bytes
    (contiguous rows), launch: the PDL launch options (ninfer.kernels.pdl). `tiles` (16-row tiles a
    program) changes no result: each row tile is computed on its own."""
    if not mma_fits(m, k, warps):
        raise ValueError(f"the mma GEMV takes 1..{MAX_ROWS} rows of x and K a multiple of {K_STEP * warps}; "
                         f"got M={m}, K={k}")
    s32 = sbytes.view(torch.int32)
    xt = triton.cdiv(m, 8)
    grid = (triton.cdiv(n, 16 * tiles),)
    _gemv_mma_kernel[grid](x32, words, s32, row_scale, y, m, n, x32.stride(0), y.stride(0), KW=k // 8, TILES=tiles,
                           WARPS=warps, EVEN_N=n % (16 * tiles) == 0, XT=xt, num_warps=warps, **launch)


def check_against_reference(device: torch.device) -> str | None:
    """The kernel beside the dequantized reference on one fixed problem on `device` (8 rows of x,
    ragged N, the table's tile): None when it agrees, else why not. The runner calls this at
    start-up, before capturing graphs, when the model has NVFP4 weights: the lane layout the kernel
    assumes is Triton's, so a Triton that lays 1-D tensors out otherwise must not serve from it."""
    from ninfer.kernels.triton_nvfp4 import nvfp4_gemv
    from ninfer.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4

    try:
        gen = torch.Generator(device="cpu").manual_seed(99)
        n, k, m = 80, 1024, 8
        w = (torch.randn(n, k, generator=gen) * 0.02).to(device)
        packed, scale, row_scale = quantize_nvfp4(w)
        x = torch.randn(m, k, generator=gen).to(device=device, dtype=torch.bfloat16)
        want = x.float() @ dequantize_nvfp4(packed, scale, row_scale).T
        got = nvfp4_gemv(x, packed, scale, row_scale, config=dict(kind="mma", TILES=2, WARPS=8))
        err = (got.float() - want).abs().max().item()
        bound = 2**-8 * want.abs().max().item()
    except Exception as exc:  # a Triton build that cannot compile it: the packed-fp16 GEMV runs
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if not err <= bound:
        return f"max error {err:.3g} over the bound {bound:.3g}"
    return None
