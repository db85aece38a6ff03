"""Int8 weight-only matmuls for CPU decoding (`--dtype int8`): bf16 activations, int8 weights.

A CPU decode step is a stream of the weights through memory (SmolLM2-135M: 270 MB in bf16 at ~8-13
GB/s on the 2-core dev machine), so halving their bytes shortens it: measured 47 against 30 ms a step at
a 128-token context. The matmul is torch's own CPU kernel (`aten._weight_int8pack_mm`: int8 [N, K]
weights, one scale per output row, bf16 input). Weights are quantized at load, symmetric per output
row (scale = amax / 127), so the artifact stays as it is. The embedding lookup keeps its bf16 table; a
tied output projection gets an int8 copy for the logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# From this many rows (a prefill chunk) the weight is widened to bf16 for torch's GEMM: 2.4x faster than the
# int8 weight-only kernel at 128 rows, 2.6-3.4x at 512 (2 cores); below it the int8 kernel wins
PREFILL_ROWS = 32


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (int8 [N, K], bf16 scales [N]) with weight ~= int8 * scale, rounding to nearest."""
    w = weight.float()
    # the kernel reads bf16 scales: quantize against the rounded scale, so each weight is within half a step
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).to(torch.bfloat16)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    return q, scale


class Int8Linear(nn.Module):
    """y = x @ (q * scale)^T (+ bias), x in any float dtype (computed in bf16, returned in x's dtype)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        q, scale = quantize_rows(weight)
        self.register_buffer("weight_int8", q)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.bfloat16 and self.bias is None and x.is_contiguous():  # no reshapes
            return self._matmul(x)
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = self._matmul(rows)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.shape[0] >= PREFILL_ROWS:  # compute-bound: the int8 values are exact in bf16, so a bf16 GEMM
            return F.linear(rows, self.weight_int8.to(torch.bfloat16)) * self.scale
        return torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self.scale)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 x @ W^T for the output head: a decode batch through the native CPU kernel (no bf16 rounding of
        the logits), else torch's."""
        from ninfer.kernels.cpu_native import qlinear_logits

        y = qlinear_logits(self, x)
        return y if y is not None else self(x).float()


def quantize_model_int8_(model: nn.Module) -> int:
    """Every plain linear (nn.Linear and its decode subclass, not quantized ones) of a CPU model becomes an
    Int8Linear in place; the output projection too (model.int8_logits). Returns how many were replaced."""
    from ninfer.kernels.linear import DecodeLinear

    if next(model.parameters()).device.type != "cpu":
        raise ValueError("int8 weight-only matmuls are a CPU path (--dtype int8 needs a CPU device)")
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) in (nn.Linear, DecodeLinear):
                setattr(module, name, Int8Linear(child.weight.detach(), child.bias))
                replaced += 1
    head = getattr(model, "lm_head", None)
    weight = head.weight_int8 if isinstance(head, Int8Linear) else None
    if weight is None:  # tied: the embedding table is the head
        model.int8_logits = Int8Linear(model.embed_tokens.weight.detach())
        replaced += 1
    else:
        model.int8_logits = head
    model.__dict__.pop("_decode_plan", None)  # a CPU decode loop built before holds the replaced linears
    return replaced
