"""Linear layers that take our Triton skinny GEMM (ninfer.kernels.triton_gemv) at decode batch sizes.

- `linear(x, weight, bias)`: F.linear, except on CUDA (`backend.use_triton`) with at most
  `triton_gemv.MAX_M` rows (leading dims flattened), bf16/fp16 x and weight of the same dtype and a
  weight whose last dim is contiguous: then the Triton kernel. `NINFER_GEMV=cublas` (read at every
  call, for A/B runs) keeps F.linear everywhere; `NINFER_KERNELS=reference` does too.
- `DecodeLinear`: an nn.Linear (same parameters, same state-dict names) whose forward is `linear`.
- `use_decode_linears_(model)`: turns every module of exact type nn.Linear into a DecodeLinear in
  place (the module object keeps its parameters, hooks and identity: no copy); subclasses such as
  quantized linears are left alone. Idempotent. Merged projections keep their checkpoint names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.kernels import backend

ENV_VAR = "NINFER_GEMV"
MAX_ROWS = 16  # = triton_gemv.MAX_M (not imported here: triton may be absent)
MAX_ROWS_LIKE = 64  # = triton_gemv.MAX_ROWS_LIKE
_DTYPES = (torch.bfloat16, torch.float16)


class rows_like:
    """Inside this context (a speculative verify forward), `linear` computes each row of a decode-sized
    product exactly as a product of `rows` rows would (triton_gemv.gemv's rows_like): the verify rows of
    B sequences round as the plain decode step of B sequences does. The choice is made when a kernel is
    launched, so it also holds for a CUDA graph captured inside the context. Not thread-safe by design:
    the engine thread alone runs forwards."""

    current: int | None = None

    def __init__(self, rows: int):
        self.rows = rows

    def __enter__(self) -> "rows_like":
        self._saved, rows_like.current = rows_like.current, self.rows
        return self

    def __exit__(self, *exc) -> None:
        rows_like.current = self._saved


def cublas_forced() -> bool:
    return os.environ.get(ENV_VAR, "").strip().lower() == "cublas"


def takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` runs the Triton kernel."""
    k = x.shape[-1] if x.dim() else 0
    return (
        x.dim() >= 1
        and x.dtype in _DTYPES
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.shape[1] == k
        and weight.stride(1) == 1
        and 0 < x.numel() <= (MAX_ROWS_LIKE if rows_like.current else MAX_ROWS) * k
        and backend.use_triton(x)
        and not cublas_forced()
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight^T (+ bias): the Triton skinny GEMM for decode-sized x on CUDA, else F.linear (inside
    rows_like on the CPU, one product per verify position: `_by_position`)."""
    if takes_gemv(x, weight) and (bias is None or bias.dtype == x.dtype):
        from ninfer.kernels import triton_gemv

        return triton_gemv.gemv(x, weight, bias, rows_like=rows_like.current)
    like = rows_like.current
    if like and not x.is_cuda and x.dim() == 2 and x.shape[0] > like and x.shape[0] % like == 0:
        return _by_position(x, weight, bias, like)
    return F.linear(x, weight, bias)


def _by_position(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, like: int) -> torch.Tensor:
    """rows_like on the CPU: the verify rows of `like` sequences (sequence-major, `width` positions each) as one
    product of `like` rows per position, so each rounds as the plain decode step's product of `like` rows does.
    One F.linear of all rows rounds differently there (a product of 2+ rows is not bitwise each row's own: s27
    found a seeded sampled request whose output changed at width 4). The positions go through one batched product,
    whose entries are bitwise the separate products (tests/test_gemv.py checks it) at the cost of one F.linear (a
    loop of them cost ~7x). On CUDA the Triton GEMV's rows_like does this; past its 64 rows, or in float32, the
    verify stays one product (faster at large batches, rounding may differ in the last bits)."""
    width = x.shape[0] // like
    xs = x.reshape(like, width, -1).transpose(0, 1).contiguous()  # [width, like, K]
    ws = weight.t().expand(width, *weight.t().shape)
    y = torch.bmm(xs, ws) if bias is None else torch.baddbmm(bias.expand(width, like, -1), xs, ws)
    return y.transpose(0, 1).reshape(x.shape[0], -1)


class DecodeLinear(nn.Linear):
    """nn.Linear whose forward takes the Triton skinny GEMM at decode batch sizes (see `linear`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def split_sums(self, x: torch.Tensor) -> "SplitSums | None":
        """The output before the Triton GEMM's split-K reduction, for a consumer that sums the splits itself
        (one launch fewer); None where forward would not run that GEMM (or the layer has a bias)."""
        if self.bias is not None or x.dim() != 2 or not takes_gemv(x, self.weight):
            return None
        from ninfer.kernels import triton_gemv

        return SplitSums(triton_gemv.gemv_split_sums(x, self.weight, rows_like=rows_like.current), 0,
                         self.out_features, x.dtype)


@dataclass
class SplitSums:
    """Columns [start, start + size) of a decode-sized linear's output, kept as the Triton GEMM's fp32 partial
    sums [S, M, N] (triton_gemv.gemv_split_sums). The consumer sums the S splits in order from 0.0 and rounds
    to `dtype`, which is the linear's output bit for bit; `total()` does that with the GEMM's own reduction."""

    partials: torch.Tensor
    start: int
    size: int
    dtype: torch.dtype

    def narrow(self, dim: int, start: int, size: int) -> "SplitSums":
        """Columns [start, start + size) of these (dim -1 only, as a merged projection's views take them)."""
        assert dim == -1
        return SplitSums(self.partials, self.start + start, size, self.dtype)

    def total(self) -> torch.Tensor:
        from ninfer.kernels import triton_gemv

        return triton_gemv.split_sums_total(self.partials, self.dtype).narrow(-1, self.start, self.size)


def use_decode_linears_(model: nn.Module) -> int:
    """Every module of exact type nn.Linear in `model` (the root too) becomes a DecodeLinear, in place:
    same object, parameters and hooks (merged projections keep splitting into their checkpoint names:
    `layers` treats any nn.Linear subclass as plain). Returns the number changed (0 on a second call)."""
    changed = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = DecodeLinear
            changed += 1
    return changed
