"""Skinny GEMM for decode: y = x @ W^T (+ b) with a few rows of x (M <= 16) and a large W.

At batch 1..16 a linear layer is a pure stream of W through the chip: every weight byte is read once
and used M times, so the kernel is built for HBM bandwidth, not arithmetic:

- W is [N, K] row-major (nn.Linear's layout). Each program owns a BLOCK_N x K slab of W (or, with
  split-K, a K piece of it) and walks K in BLOCK_K steps; x's few rows are re-read from L2 each step.
- Loads of W are unmasked along K when BLOCK_K divides K (rows past N are clamped to a valid row,
  their outputs are not stored), so they vectorise to 16-byte accesses; big tiles and software
  pipelining (num_stages) keep several loads per thread in flight.
- Two inner products, picked per config:
  * "fma" (M <= 4): fp32 multiply-adds on the CUDA cores into a [BLOCK_M, BLOCK_N, BLOCK_K]
    accumulator, reduced over K once at the end (on the H200: small programs, 4 rows x 256 of K,
    2 warps, 4-6 pipeline stages, win at M = 1 for all but the q/k/v-like shapes);
  * "dot" (any M <= 16): tensor cores on the swapped product W_tile @ x_tile^T ([BLOCK_N, 16]),
    x's rows zero-padded to 16, so W is the MMA's big operand (cp.async-pipelined tiles).
- Split-K writes fp32 partials to a [SPLIT_K, M, N] workspace and a second small kernel sums them
  in a fixed order (+ bias, cast): no atomics, so results are bitwise identical run to run, eager or
  replayed in a CUDA graph.

Configs come from a fixed table per shape class (`pick_config`); nothing is tuned at run time. The
offline helper `bench.selfcheck_gemv.tune_gemv` times a few candidates on the device and
prints the winners for the table. No host syncs, workspace sized from shapes alone: CUDA-graph
capturable. Kernels also run on CPU fp32 tensors under TRITON_INTERPRET=1 (tests/test_gemv.py).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton
import triton.language as tl

from ninfer.kernels.pdl import pdl_enter, pdl_launch
from ninfer.kernels.triton_compat import fix_interpreter

fix_interpreter()  # TRITON_INTERPRET=1 only: see triton_compat

MAX_M = 16
MAX_ROWS_LIKE = 64  # rows of a `rows_like` product: a verify forward of 8 sequences x (7 drafts + 1)


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    dot: bool  # tensor-core inner product (x padded to 16 rows) instead of CUDA-core FMAs
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 1

    def short(self) -> str:
        kind = "dot" if self.dot else "fma"
        return f"{kind}_n{self.block_n}_k{self.block_k}_s{self.split_k}_w{self.num_warps}_p{self.num_stages}"


@triton.jit
def _gemv_kernel(
    X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym, stride_ys, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    USE_DOT: tl.constexpr, IEEE: tl.constexpr, HAS_BIAS: tl.constexpr, NUM_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr = False, ROW_BLOCKS: tl.constexpr = 1,
):
    """One (BLOCK_N rows of W, K piece, BLOCK_M rows of x) per program. Y: the output (no split) or the
    fp32 partials [SPLIT_K, M, N] (stride_ys between splits; bias then added by the reduction).
    ROW_BLOCKS > 1 (a rows_like product): grid axis 0 enumerates (W block, x row block) pairs with the
    row blocks fastest, so the programs that share a W tile run side by side and all but the first
    read it from L2: the weights stream from HBM about once however many row blocks there are."""
    pdl_enter(USE_PDL)
    pid_n = tl.program_id(0) // ROW_BLOCKS
    pid_m = tl.program_id(0) % ROW_BLOCKS
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(offs_n < N, offs_n, N - 1).to(tl.int64)  # clamped: unmasked W loads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # a block of x's rows
    m_ok = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_ptrs = W + rows[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    if USE_DOT:
        x_ptrs = X + offs_m[None, :] * stride_xm + offs_k[:, None]  # [BLOCK_K, BLOCK_M]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
            if EVEN_K:
                w = tl.load(w_ptrs + k)
                xt = tl.load(x_ptrs + k, mask=m_ok[None, :], other=0.0)
            else:
                k_ok = (k + offs_k) < k_hi
                w = tl.load(w_ptrs + k, mask=k_ok[None, :], other=0.0)
                xt = tl.load(x_ptrs + k, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            if IEEE:
                acc = tl.dot(w, xt, acc, input_precision="ieee")
            else:
                acc = tl.dot(w, xt, acc)
        out = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    else:
        x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
            if EVEN_K:
                w = tl.load(w_ptrs + k)
                x = tl.load(x_ptrs + k, mask=m_ok[:, None], other=0.0)
            else:
                k_ok = (k + offs_k) < k_hi
                w = tl.load(w_ptrs + k, mask=k_ok[None, :], other=0.0)
                x = tl.load(x_ptrs + k, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            acc3 += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
        out = tl.sum(acc3, axis=2)  # [BLOCK_M, BLOCK_N]
    n_ok = offs_n < N
    if HAS_BIAS:
        out += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = Y + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, out.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _gemv_fma_rows_kernel(
    X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym, stride_ys, k_per_split, GROUPS,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, NUM_STAGES: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """_gemv_kernel's CUDA-core ("fma") path for a rows_like product: one program takes BLOCKS_PER_PROGRAM
    row blocks of x against one W tile, loading each W tile once for all of them. Every row block keeps an
    accumulator of its own with exactly the shape, layout and arithmetic of _gemv_kernel's, so each row
    rounds bit for bit as in a program of its own. Grid axis 0: (W block, group of row blocks), the groups
    fastest; axis 1: the K split."""
    pdl_enter(USE_PDL)
    pid_n = tl.program_id(0) // GROUPS
    first = (tl.program_id(0) % GROUPS) * BLOCKS_PER_PROGRAM
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(offs_n < N, offs_n, N - 1).to(tl.int64)  # clamped: unmasked W loads
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_ptrs = W + rows[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    accs = ()
    for _b in tl.static_range(BLOCKS_PER_PROGRAM):
        accs = accs + (tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32),)
    for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            w = tl.load(w_ptrs + k)
        else:
            k_ok = (k + offs_k) < k_hi
            w = tl.load(w_ptrs + k, mask=k_ok[None, :], other=0.0)
        updated = ()
        for b in tl.static_range(BLOCKS_PER_PROGRAM):
            offs_m = (first + b) * BLOCK_M + tl.arange(0, BLOCK_M)
            x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
            if EVEN_K:
                x = tl.load(x_ptrs + k, mask=(offs_m < M)[:, None], other=0.0)
            else:
                x = tl.load(x_ptrs + k, mask=(offs_m < M)[:, None] & k_ok[None, :], other=0.0)
            updated = updated + (accs[b] + w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :],)
        accs = updated
    n_ok = offs_n < N
    for b in tl.static_range(BLOCKS_PER_PROGRAM):
        offs_m = (first + b) * BLOCK_M + tl.arange(0, BLOCK_M)
        out = tl.sum(accs[b], axis=2)  # [BLOCK_M, BLOCK_N]
        if HAS_BIAS:
            out += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y_ptrs = Y + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, out.to(Y.dtype.element_ty), mask=(offs_m < M)[:, None] & n_ok[None, :])


@triton.jit
def _splitk_reduce_kernel(P, B, Y, M, N, stride_ym, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Y[m, n] = sum_s P[s, m, n] (+ b[n]), the splits summed in order 0..SPLIT_K-1."""
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(P + (s * M + m) * N + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(B + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + m * stride_ym + offs, acc.to(Y.dtype.element_ty), mask=ok)


# ---- configs ------------------------------------------------------------------------------------


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 132  # CPU (interpreter): any fixed number keeps the configs deterministic


def m_bucket(m: int) -> int:
    return 1 if m <= 1 else 2 if m <= 2 else 4 if m <= 4 else 8 if m <= 8 else 16


# Tuned on an H200 (132 SMs, bf16) by selfcheck_gemv.tune_gemv: (m bucket, shape class) -> config;
# split_k=0 picks the split from the shape (`_auto_split`: no split on the 27B shapes, where the
# winners ran unsplit; splits N-poor shapes of other models). Ties within timing noise (~0.5%) went
# to the config with more programs (mid, M <= 2: 64 rows, not 128). Shape classes (Qwen3.6-27B):
# "wide" N >= 4K (lm_head, MLP gate_up), "mid" K < N < 4K (merged q/k/v, GDN in-projection),
# "square" K/2 < N <= K (o_proj, GDN out_proj), "tall" N <= K/2 (MLP down).
_C = GemvConfig
_TABLE: dict[tuple[int, str], GemvConfig] = {
    (1, "mid"): _C(dot=True, block_n=64, block_k=128, split_k=0, num_warps=4, num_stages=4),
    (1, "square"): _C(dot=False, block_n=4, block_k=256, split_k=0, num_warps=2, num_stages=4),
    (1, "tall"): _C(dot=False, block_n=4, block_k=256, split_k=0, num_warps=2, num_stages=4),
    (1, "wide"): _C(dot=False, block_n=4, block_k=256, split_k=0, num_warps=2, num_stages=6),
    (2, "mid"): _C(dot=True, block_n=64, block_k=128, split_k=0, num_warps=4, num_stages=4),
    (2, "square"): _C(dot=True, block_n=64, block_k=256, split_k=0, num_warps=4, num_stages=4),
    (2, "tall"): _C(dot=False, block_n=8, block_k=256, split_k=0, num_warps=2, num_stages=4),
    (2, "wide"): _C(dot=False, block_n=4, block_k=512, split_k=0, num_warps=2, num_stages=4),
    (4, "mid"): _C(dot=True, block_n=64, block_k=128, split_k=0, num_warps=4, num_stages=4),
    (4, "square"): _C(dot=True, block_n=64, block_k=256, split_k=0, num_warps=4, num_stages=4),
    (4, "tall"): _C(dot=True, block_n=64, block_k=256, split_k=0, num_warps=4, num_stages=4),
    (4, "wide"): _C(dot=True, block_n=32, block_k=128, split_k=0, num_warps=4, num_stages=6),
    (8, "mid"): _C(dot=True, block_n=64, block_k=128, split_k=0, num_warps=4, num_stages=4),
    (8, "square"): _C(dot=True, block_n=64, block_k=256, split_k=0, num_warps=4, num_stages=4),
    (8, "tall"): _C(dot=True, block_n=64, block_k=256, split_k=0, num_warps=4, num_stages=4),
    (8, "wide"): _C(dot=True, block_n=32, block_k=128, split_k=0, num_warps=4, num_stages=6),
    (16, "mid"): _C(dot=True, block_n=64, block_k=128, split_k=0, num_warps=4, num_stages=4),
    (16, "square"): _C(dot=True, block_n=64, block_k=256, split_k=0, num_warps=4, num_stages=4),
    (16, "tall"): _C(dot=True, block_n=64, block_k=256, split_k=0, num_warps=4, num_stages=4),
    (16, "wide"): _C(dot=True, block_n=32, block_k=128, split_k=0, num_warps=4, num_stages=6),
}


def shape_class(n: int, k: int) -> str:
    if n >= 4 * k:
        return "wide"
    if n > k:
        return "mid"
    if 2 * n > k:
        return "square"
    return "tall"


def _default_config(m: int) -> GemvConfig:
    """Untuned fallback: CUDA-core FMAs for M <= 2, tensor cores above (split-K where N is short)."""
    if m <= 2:
        return GemvConfig(dot=False, block_n=8 if m == 1 else 4, block_k=512, num_warps=4)
    return GemvConfig(dot=True, block_n=64, block_k=128, split_k=0, num_warps=4, num_stages=4)


def _auto_split(cfg: GemvConfig, n: int, k: int, sms: int) -> int:
    """Split K while the programs number fewer than half the SMs (each piece keeps >= 4 K tiles).
    On an H200, 80 programs of 64 rows x K=17408 stream faster unsplit than split 4 ways (tuning)."""
    blocks = triton.cdiv(n, cfg.block_n)
    split = 1
    while 2 * blocks * split < sms and k // (2 * split) >= 4 * cfg.block_k and split < 16:
        split *= 2
    return split


@functools.lru_cache(maxsize=4096)
def pick_config(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype) -> GemvConfig:
    """The table's config for this problem (the untuned default where it has none), fitted to it.
    Cached per problem (call `pick_config.cache_clear()` after changing `_TABLE`)."""
    cfg = _TABLE.get((m_bucket(m), shape_class(n, k))) or _default_config(m)
    return resolve_config(cfg, m, n, k, device, dtype)


def resolve_config(cfg: GemvConfig, m: int, n: int, k: int, device: torch.device,
                   dtype: torch.dtype) -> GemvConfig:
    """`cfg` made concrete for one problem: automatic split (split_k=0) resolved, tiles fitted."""
    cfg = fit_config(cfg, m, n, k, dtype)
    if cfg.split_k == 0:
        cfg = dataclasses.replace(cfg, split_k=_auto_split(cfg, n, k, sm_count(device)))
    return cfg


def fit_config(cfg: GemvConfig, m: int, n: int, k: int, dtype: torch.dtype) -> GemvConfig:
    """Shrink a config to a (small) problem: tiles no larger than the problem, legal dot shapes."""
    block_k = max(16, min(cfg.block_k, triton.next_power_of_2(k)))
    if cfg.dot:
        block_n = max(16, min(cfg.block_n, triton.next_power_of_2(n)))
    else:
        block_n = max(1, min(cfg.block_n, triton.next_power_of_2(n)))
        if m_bucket(m) > 4:  # the FMA accumulator is [BLOCK_M, BLOCK_N, BLOCK_K]: keep it in registers
            return fit_config(_default_config(m), m, n, k, dtype)
    split = cfg.split_k if cfg.split_k == 0 else max(1, min(cfg.split_k, triton.cdiv(k, block_k)))
    if dtype == torch.float32:  # fp32 tiles are twice the bytes: halve K to keep registers in check
        block_k = max(16, block_k // 2)
    return dataclasses.replace(cfg, block_n=block_n, block_k=block_k, split_k=split)


# ---- launch -------------------------------------------------------------------------------------

# The multi-row CUDA-core kernel for rows_like products (_gemv_fma_rows_kernel): one program takes several
# row blocks, each with the decode kernel's own shapes, loads and accumulator, so a W tile is loaded once
# for all of them. On the H200 its rows are bitwise _gemv_kernel's at the 27B shape (verify_exactness,
# B = 1, 2; tests/test_gemv.py's CUDA test), and a k=3 verify at C=1 takes 1.33x a plain step instead of
# 2.39x (bench/results/2026-12-03-h200-s12, -s13). NINFER_GEMV_ROWS=0 turns it off: the row blocks then
# run as programs of their own, ordered so those sharing a W tile run side by side (L2 reuse).
MULTI_ROW_FMA = os.environ.get("NINFER_GEMV_ROWS", "1") == "1"
# fp32 registers per thread that one rows_like program's accumulators may take (the 1-row configs' own
# accumulator takes 16: 4 W rows x 256 of K over 64 threads)
ROWS_ACC_REGISTERS = 128


def _blocks_per_program(cfg: GemvConfig, block_m: int, row_blocks: int) -> int:
    """Row blocks one program takes in a rows_like product: CUDA-core configs only (tensor-core tiles
    already hold 16 rows), as many as fit ROWS_ACC_REGISTERS."""
    if cfg.dot:
        return 1
    per_block = block_m * cfg.block_n * cfg.block_k // (32 * cfg.num_warps)
    return max(1, min(row_blocks, ROWS_ACC_REGISTERS // max(per_block, 1)))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None, rows_like: int | None = None) -> torch.Tensor:
    """x [..., K] (at most 16 rows in all), weight [N, K] (last dim contiguous), bias [N] -> [..., N].

    rows_like (speculative verification): compute every row exactly as a product of `rows_like` rows
    computes it (that problem's config and row block, the rows in blocks of it, up to MAX_ROWS_LIKE
    rows in all), so a verified position rounds as a plain decode step of the same batch does."""
    x2, m, n, k = _rows(x, weight, rows_like)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.reshape(*x.shape[:-1], n)
    if k == 0:
        y.zero_()
        if bias is not None:
            y += bias
        return y.reshape(*x.shape[:-1], n)
    plan = _plan(x2, m, n, k, config, rows_like)
    if plan.split == 1:
        _run(plan, x2, weight, bias, y, y.stride(0), 0)
    else:
        part = torch.empty((plan.split, m, n), dtype=torch.float32, device=x.device)
        _run(plan, x2, weight, None, part, n, m * n)
        _reduce(part, bias, y)
    return y.reshape(*x.shape[:-1], n)


def gemv_split_sums(x: torch.Tensor, weight: torch.Tensor, rows_like: int | None = None) -> torch.Tensor:
    """gemv(x, weight) (no bias) before its split-K reduction: fp32 partial sums [S, M, N] (S = 1 unsplit) of
    the 2-D x's M rows. Summed in order 0..S-1 from 0.0 and rounded to x's dtype they are gemv's output bit for
    bit (`split_sums_total`), so a consumer that sums them itself saves the reduction's launch."""
    x2, m, n, k = _rows(x, weight, rows_like)
    if m == 0 or n == 0 or k == 0:
        return torch.zeros((1, m, n), dtype=torch.float32, device=x.device)
    plan = _plan(x2, m, n, k, None, rows_like)
    part = torch.empty((plan.split, m, n), dtype=torch.float32, device=x.device)
    _run(plan, x2, weight, None, part, n, m * n)
    return part


def split_sums_total(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """gemv_split_sums' partials [S, M, N] reduced: [M, N] in `dtype`, what gemv returns."""
    y = torch.empty(part.shape[1:], dtype=dtype, device=part.device)
    if y.numel():
        _reduce(part, None, y)
    return y


def _rows(x: torch.Tensor, weight: torch.Tensor, rows_like: int | None):
    """x as 2-D rows with a contiguous last dim, checked against the weight: (x2, M, N, K)."""
    k = x.shape[-1]
    n = weight.shape[0]
    if weight.shape[-1] != k or weight.stride(-1) != 1:
        raise ValueError(f"gemv: weight {tuple(weight.shape)} (strides {weight.stride()}) vs x [..., {k}]")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m > (MAX_ROWS_LIKE if rows_like else MAX_M):
        raise ValueError(f"gemv: {m} rows > {MAX_ROWS_LIKE if rows_like else MAX_M}")
    return x2, m, n, k


@dataclasses.dataclass(frozen=True)
class _Plan:
    """One product's launch: kernel, grid, constexprs, the K split and its piece length."""

    kernel: object
    grid: tuple
    common: dict
    extra: tuple
    split: int
    k_per_split: int


def _plan(x2: torch.Tensor, m: int, n: int, k: int, config: GemvConfig | None, rows_like: int | None) -> _Plan:
    like = rows_like or m
    if config is None:
        cfg = pick_config(like, n, k, x2.device, x2.dtype)
    else:
        cfg = resolve_config(config, like, n, k, x2.device, x2.dtype)
    block_m = 16 if cfg.dot else triton.next_power_of_2(like)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)  # no empty pieces
    row_blocks = triton.cdiv(m, block_m)
    per_program = _blocks_per_program(cfg, block_m, row_blocks) if rows_like and MULTI_ROW_FMA else 1
    groups = triton.cdiv(row_blocks, per_program)
    grid = (triton.cdiv(n, cfg.block_n) * groups, split)
    common = dict(BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0,
                  NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps, **pdl_launch(x2.device))
    if per_program > 1:
        return _Plan(_gemv_fma_rows_kernel, grid, dict(common, BLOCKS_PER_PROGRAM=per_program), (groups,), split,
                     k_per_split)
    common = dict(common, USE_DOT=cfg.dot, IEEE=x2.dtype == torch.float32, ROW_BLOCKS=row_blocks)
    return _Plan(_gemv_kernel, grid, common, (), split, k_per_split)


def _run(plan: _Plan, x2, weight, bias, out, stride_out: int, stride_split: int) -> None:
    """The product into `out`: the output (unsplit) or fp32 partials (stride_split between splits)."""
    m, k = x2.shape
    b = bias if bias is not None else weight  # unused pointer
    plan.kernel[plan.grid](x2, weight, b, out, m, weight.shape[0], k, x2.stride(0), weight.stride(0), stride_out,
                           stride_split, plan.k_per_split, *plan.extra, HAS_BIAS=bias is not None, **plan.common)


def _reduce(part: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> None:
    """y = the splits of `part` summed in order (+ bias), in y's dtype."""
    split, m, n = part.shape
    block = min(1024, triton.next_power_of_2(n))
    _splitk_reduce_kernel[(triton.cdiv(n, block), m)](part, bias if bias is not None else part, y, m, n,
                                                      y.stride(0), SPLIT_K=split, HAS_BIAS=bias is not None,
                                                      BLOCK=block, num_warps=4, **pdl_launch(part.device))
