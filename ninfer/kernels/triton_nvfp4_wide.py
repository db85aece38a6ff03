"""NVFP4 product for a tile of up to 32 rows of x on Hopper's warpgroup tensor cores (`tl.dot`, which
Triton lowers to wgmma there): the decoded weight tile [BLOCK_N, BLOCK_K] in fp16 is the A operand (weights
as the instruction's M, so 64 weight rows fill it) and x^T [BLOCK_K, 32] the B operand (tokens as its N).

Why (issue 21, s24): speculative verification at C=8 and k=3 drafts takes 32 rows through every matmul. The
register-fed mma.sync GEMV (triton_nvfp4_mma) issues one instruction per 16 x 16 weights and 8 tokens and
converts x per program, so 32 rows cost 2.3x its 8-row launch. Here each decoded weight meets all 32 tokens
in one warpgroup instruction, so a launch costs about the same at 1 and at 32 rows.

A token's sums do not depend on the other tokens: every launch computes a fixed 32-token tile (rows past M
read as zeros and are not stored) with the same compiled kernel, the K loop in the same order, so a row
rounds bit for bit alike at every M (what verification needs of decode: a `like`-row decode step and its
verify rows take this kernel alike). M is not specialized (Triton would compile M = 1 apart).

Decode: each int32 word (8 codes) becomes four fp16 pairs worth code * 2^-14 (decode_word_ptx, as the
mma GEMV's), times the block's E4M3 scale in fp16 (exact: at most 6 significant bits, a multiple of 2^-24);
the row scale and 2^14 multiply the fp32 sums. x is converted to fp16 per K tile, as the mma GEMV does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.pdl import pdl_release, pdl_wait
from ninfer.kernels.triton_nvfp4 import _F16_UNSCALE, decode_word_ptx

TOKENS = 32  # rows of x a program computes: wgmma's N


def _decode_asm() -> str:
    """PTX: $4 a word of 8 codes, $5 its block's E4M3 scale byte -> $0..$3 the fp16 pairs (c0, c2), (c4, c6),
    (c1, c3), (c5, c7) times the scale."""
    lines = ["{", ".reg .b32 e, o, u, z, sc, p<4>;", ".reg .b16 c0, c1;", "mov.b32 z, 0;",
             "prmt.b32 sc, $5, $5, 0x4400; mov.b32 {c0, c1}, sc; cvt.rn.f16x2.e4m3x2 sc, c0;"]
    lines += decode_word_ptx("$4", ["p0", "p1", "p2", "p3"])
    lines += [f"mul.rn.f16x2 ${i}, p{i}, sc;" for i in range(4)]
    lines.append("}")
    return "\n".join(lines)


_DECODE = tl.constexpr(_decode_asm())


@triton.jit
def _halves(pair):
    """int32 fp16 pairs -> (low half, high half) as fp16."""
    lo = (pair & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    hi = (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def _decode_tile(words, sbytes):
    """int32 words [BN, BW], their blocks' scale bytes as int32 [BN, BW] -> fp16 [BN, 8 BW] in K order."""
    p02, p46, p13, p57 = tl.inline_asm_elementwise(_DECODE, "=r,=r,=r,=r,r,r", [words, sbytes],
                                                   dtype=(tl.int32,) * 4, is_pure=True, pack=1)
    c0, c2 = _halves(p02)
    c4, c6 = _halves(p46)
    c1, c3 = _halves(p13)
    c5, c7 = _halves(p57)
    # tl.join appends a minor axis: [.., b2, b1, b0] holds code 4 b2 + 2 b1 + b0 (as triton_nvfp4._codes)
    codes = tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))
    return tl.reshape(codes, [words.shape[0], words.shape[1] * 8])


@triton.jit
def _mac(acc, words, sbytes, x, WEIGHTS_AS_B: tl.constexpr):
    """acc += one K step: the decoded weights [BN, BK] against x ([TOKENS, BK] bf16)."""
    w = _decode_tile(words, sbytes.to(tl.int32))
    if WEIGHTS_AS_B:
        acc = tl.dot(x.to(tl.float16), tl.trans(w), acc)  # [TOKENS, BN]
    else:
        acc = tl.dot(w, tl.trans(x.to(tl.float16)), acc)  # [BN, TOKENS]
    return acc


@triton.jit
def _load_w(wptr, sptr, w0):
    """Step `w0` (words from the row start): the weight words and their scale bytes."""
    return tl.load(wptr + w0), tl.load(sptr + w0 // 2)


@triton.jit
def _load_x(xptr, w0, tok_ok):
    return tl.load(xptr + 8 * w0, mask=tok_ok[:, None], other=0.0)


@triton.jit(do_not_specialize=["M"])
def _wide_kernel(
    X, W32, S8, RS, Y,
    M, N, KW, stride_xm, stride_ym,
    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, EVEN_N: tl.constexpr,
    STAGES: tl.constexpr, TOKENS: tl.constexpr = 32, WEIGHTS_AS_B: tl.constexpr = False, DEPTH: tl.constexpr = 1,
    USE_PDL: tl.constexpr = False,
):
    """Program (i, j): weight rows BLOCK_N i .. (i + 1) - 1 against tokens TOKENS j .. TOKENS (j + 1) - 1, all
    of K in steps of BLOCK_W words (8 BLOCK_W codes). W32: rows of KW words; S8: rows of KW / 2 scale bytes.
    DEPTH (1 or 2) steps of weights are loaded ahead in registers (their loads feed no dot directly, so Triton's
    pipeline does not stage them); x, a dot operand, is Triton's to pipeline (STAGES). WEIGHTS_AS_B: x is the dot's A operand, the decoded weights its B."""
    pdl_release(USE_PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    if not EVEN_N:
        rows = tl.minimum(rows, N - 1)  # rows past N read the last row; they are not stored
    rows64 = rows.to(tl.int64)
    toks = tl.program_id(1) * TOKENS + tl.arange(0, TOKENS)
    tok_ok = toks < M
    cols = tl.arange(0, BLOCK_W)
    wptr = W32 + rows64[:, None] * KW + cols[None, :]
    sptr = S8 + rows64[:, None] * (KW // 2) + (cols // 2)[None, :]
    xptr = X + toks[:, None].to(tl.int64) * stride_xm + tl.arange(0, 8 * BLOCK_W)[None, :]
    if WEIGHTS_AS_B:
        acc = tl.zeros([TOKENS, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, TOKENS], dtype=tl.float32)
    pdl_wait(USE_PDL)
    wa, sa = _load_w(wptr, sptr, 0)
    if DEPTH == 2:
        wb, sb = _load_w(wptr, sptr, BLOCK_W)
        for w0 in tl.range(0, KW - 2 * BLOCK_W, BLOCK_W, num_stages=STAGES):
            wc, sc = _load_w(wptr, sptr, w0 + 2 * BLOCK_W)
            acc = _mac(acc, wa, sa, _load_x(xptr, w0, tok_ok), WEIGHTS_AS_B)
            wa, sa = wb, sb
            wb, sb = wc, sc
        acc = _mac(acc, wa, sa, _load_x(xptr, KW - 2 * BLOCK_W, tok_ok), WEIGHTS_AS_B)
        acc = _mac(acc, wb, sb, _load_x(xptr, KW - BLOCK_W, tok_ok), WEIGHTS_AS_B)
    else:
        for w0 in tl.range(0, KW - BLOCK_W, BLOCK_W, num_stages=STAGES):
            wb, sb = _load_w(wptr, sptr, w0 + BLOCK_W)
            acc = _mac(acc, wa, sa, _load_x(xptr, w0, tok_ok), WEIGHTS_AS_B)
            wa, sa = wb, sb
        acc = _mac(acc, wa, sa, _load_x(xptr, KW - BLOCK_W, tok_ok), WEIGHTS_AS_B)
    rs = tl.load(RS + rows) * _F16_UNSCALE
    ytile = Y + toks[:, None].to(tl.int64) * stride_ym + rows[None, :]
    keep = tok_ok[:, None] & row_ok[None, :]
    if WEIGHTS_AS_B:
        tl.store(ytile, (acc * rs[None, :]).to(Y.dtype.element_ty), mask=keep)
    else:
        tl.store(ytile, tl.trans(acc * rs[:, None]).to(Y.dtype.element_ty), mask=keep)


def wide_fits(k: int, block_w: int) -> bool:
    """Whether the kernel takes this K: whole steps of block_w words (8 block_w codes)."""
    return k % (8 * block_w) == 0


def gemm_wide(x: torch.Tensor, words: torch.Tensor, sbytes: torch.Tensor, row_scale: torch.Tensor, y: torch.Tensor,
              *, block_n: int, block_w: int, warps: int, stages: int, launch: dict, tokens: int = TOKENS,
              weights_as_b: bool = False, depth: int = 1) -> None:
    """y[:M] = x @ W^T for bf16 x [M, K] (last dim contiguous), W as int32 code words [N, K / 8] and scale
    bytes [N, K / 16] (contiguous rows); launch: the PDL launch options (ninfer.kernels.pdl). Neither
    `stages` nor `warps` changes a result; `block_n` and `block_w` may (the compiled dot differs)."""
    m, k = x.shape
    n = words.shape[0]
    if not wide_fits(k, block_w) or k < 8 * block_w * depth:
        raise ValueError(f"the wide NVFP4 kernel takes K a multiple of {8 * block_w}; got K={k}")
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, tokens))
    _wide_kernel[grid](x, words, sbytes, row_scale, y, m, n, k // 8, x.stride(0), y.stride(0), BLOCK_N=block_n,
                       BLOCK_W=block_w, EVEN_N=n % block_n == 0, STAGES=stages, TOKENS=tokens, WEIGHTS_AS_B=weights_as_b, DEPTH=depth,
                       num_warps=warps, **launch)
