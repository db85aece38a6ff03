"""NVFP4 weights: quantizer, torch reference dequantizer and the `NVFP4Linear` module.

Format (NVIDIA's NVFP4, weight-only here: activations stay bf16/fp32):
- values: E2M1 (1 sign bit, 2 exponent bits, 1 mantissa bit): codes 0..7 are the magnitudes
  0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8..15 their negatives (8 is -0);
- one FP8 E4M3 (float8_e4m3fn) block scale per 16 consecutive input (K) elements of a row;
- one FP32 global scale per quantized tensor: global_scale = 448 * 6 / amax(W), so the largest
  block scale lands at 448 (the E4M3 maximum) and the largest value at 6.

Stored per linear layer [N, K] (K % 16 == 0):
- `weight_packed`    uint8 [N, K/2]: two codes per byte along K; element 2j in the LOW nibble
  (bits 0-3), element 2j+1 in the HIGH nibble (bits 4-7). This is the order of ModelOpt and
  compressed-tensors checkpoints, so theirs load without repacking.
- `weight_scale`     float8_e4m3fn [N, K/16]: block scales (times global_scale).
- `weight_row_scale` float32 [N]: 1 / global_scale of the tensor each row came from. Per row, not
  one scalar, so that projections quantized separately (q/k/v, gate/up, ...) can be stacked into
  one module and keep their own global scales.

Dequantized weight: W[n, k] = e2m1(code[n, k]) * float(weight_scale[n, k // 16]) * weight_row_scale[n].
Rounding: block scales round-to-nearest-even into E4M3 (torch's cast); values round to the nearest
E2M1 magnitude, ties to the even code (as ModelOpt's `_cast_fp4`), saturating at 6.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

GROUP_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Linear layers quantize_model_ leaves in bf16 by default (matched against the leaf name or a dotted
# suffix of the module path): the MoE router and the shared-expert gate (tiny, steer routing), and
# Gated DeltaNet's in_proj_a / in_proj_b (N = value heads, 48 at 27B: no bytes to save, and they feed
# the decay and beta of the recurrent state).
DEFAULT_SKIP = ("gate", "shared_expert_gate", "in_proj_a", "in_proj_b")
_CHUNK_ELEMENTS = 1 << 24  # rows are quantized in chunks of ~16M elements to bound the temporaries


class NVFP4Weight(NamedTuple):
    packed: torch.Tensor  # uint8 [N, K/2]
    scale: torch.Tensor  # float8_e4m3fn [N, K/16]
    row_scale: torch.Tensor  # float32 [N]


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 values (already divided by their block scale) to 4-bit E2M1 codes (uint8).

    Thresholds are the midpoints between neighbouring magnitudes; at a tie the even code (mantissa
    bit 0) wins, hence '>' at 0.25, 1.25, 2.5, 5 and '>=' at 0.75, 1.75, 3.5. Beyond 6 saturates.
    """
    a = v.abs()
    code = (a > 0.25).to(torch.uint8)
    for threshold, inclusive in ((0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
                                 (5.0, False)):
        code += (a >= threshold) if inclusive else (a > threshold)
    negative = (v < 0) & (code > 0)  # no -0 codes
    return code | (negative.to(torch.uint8) << 3)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] -> bytes [..., K/2]: element 2j in the low nibble, 2j+1 in the high one."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., K/2] -> uint8 codes [..., K] (inverse of pack_codes)."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


@torch.no_grad()
def quantize_nvfp4(weight: torch.Tensor, global_scale: torch.Tensor | float | None = None) -> NVFP4Weight:
    """Quantize a [N, K] weight (any float dtype, CPU or CUDA; K % 16 == 0) to NVFP4.

    global_scale defaults to 448 * 6 / amax(weight) (1 for an all-zero weight). Vectorised over the
    whole tensor; rows go in chunks only to bound the fp32 temporaries of large weights.
    """
    if weight.dim() != 2:
        raise ValueError(f"quantize_nvfp4 wants a 2-D weight, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if k % GROUP_SIZE:
        raise ValueError(f"quantize_nvfp4: K={k} is not a multiple of {GROUP_SIZE}")
    device = weight.device
    if global_scale is None:
        amax = weight.detach().abs().amax().float()
        global_scale = torch.where(amax > 0, (E4M3_MAX * E2M1_MAX) / amax, torch.ones_like(amax))
    global_scale = torch.as_tensor(global_scale, dtype=torch.float32, device=device).reshape(())
    packed = torch.empty(n, k // 2, dtype=torch.uint8, device=device)
    scale = torch.empty(n, k // GROUP_SIZE, dtype=torch.float8_e4m3fn, device=device)
    rows = max(1, _CHUNK_ELEMENTS // max(k, 1))
    for start in range(0, n, rows):
        blocks = weight[start:start + rows].float().view(-1, k // GROUP_SIZE, GROUP_SIZE)
        block_scale = (blocks.abs().amax(-1) / E2M1_MAX * global_scale).clamp_(max=E4M3_MAX)
        block_scale = block_scale.to(torch.float8_e4m3fn)  # round-to-nearest-even into E4M3
        divisor = block_scale.float()
        # values in units of their block scale: w * global_scale / block_scale; an all-zero (or
        # E4M3-underflowing) block has scale 0 and gets code 0
        mult = torch.where(divisor > 0, global_scale / divisor, torch.zeros_like(divisor))
        codes = _e2m1_codes(blocks * mult[..., None]).view(-1, k)
        packed[start:start + rows] = pack_codes(codes)
        scale[start:start + rows] = block_scale
    row_scale = (1.0 / global_scale).expand(n).clone()
    return NVFP4Weight(packed, scale, row_scale)


def positive_block_scales(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same weight with every block scale's sign bit clear: a negative block's 16 codes change
    sign instead (exact). Our quantizer never writes negative scales and the GPU kernels rely on
    it; imported checkpoints are brought to this form."""
    sbits = scale.view(torch.uint8)
    negative = (sbits & 0x80) != 0
    if not bool(negative.any()):
        return packed, scale
    flip = negative.repeat_interleave(GROUP_SIZE // 2, dim=-1).to(torch.uint8) * 0x88  # both nibbles' sign bits
    return packed ^ flip, (sbits & 0x7F).view(torch.float8_e4m3fn)


def e2m1_table(device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 E2M1 code values as fp32 (index = code)."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([values, -values])


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Torch reference: [N, K] in `dtype` (computed in fp32, rounded once at the end)."""
    n, half = packed.shape
    k = half * 2
    values = e2m1_table(packed.device)[unpack_codes(packed).long()]  # [N, K] fp32
    values = values.view(n, k // GROUP_SIZE, GROUP_SIZE) * scale.float()[..., None]
    return (values.view(n, k) * row_scale.float()[:, None]).to(dtype)


# ---------------------------------------------------------------------------------------------
# Module


class NVFP4Linear(nn.Module):
    """y = x @ W^T (+ bias) with W stored as NVFP4; activations keep their dtype.

    CUDA tensors with Triton available run the dequantizing kernels of
    `ninfer.kernels.triton_nvfp4` (GEMV for up to 16 rows, or 32 once paired for the tensor-core GEMV,
    dequantize + cuBLAS above); otherwise the weight is dequantized to x.dtype and multiplied with F.linear
    (the reference).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        if in_features % GROUP_SIZE:
            raise ValueError(f"NVFP4Linear: in_features={in_features} is not a multiple of {GROUP_SIZE}")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8,
                                                          device=device))
        self.register_buffer("weight_scale", torch.zeros(out_features, in_features // GROUP_SIZE,
                                                         dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_row_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.paired = 0  # the warps the codes and scales are stored paired for (pair_for_mma_), 0: K order
        self.tiled = False  # paired and tiled too (pair_for_mma_)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype or torch.get_default_dtype(),
                                                 device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_weights(cls, q: NVFP4Weight, bias: torch.Tensor | None = None) -> "NVFP4Linear":
        n, half = q.packed.shape
        mod = cls(half * 2, n, bias=bias is not None, device="meta")
        mod.weight_packed, mod.weight_scale, mod.weight_row_scale = q.packed, q.scale, q.row_scale.float()
        if bias is not None:
            mod.bias = nn.Parameter(bias.detach(), requires_grad=False)
        return mod

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "NVFP4Linear":
        """Quantize an nn.Linear (on its device)."""
        return cls.from_weights(quantize_nvfp4(linear.weight), linear.bias)

    @classmethod
    def concat(cls, mods: Sequence["NVFP4Linear"]) -> "NVFP4Linear":
        """One module whose output is cat([m(x) for m in mods], -1): the rows stacked (each keeps its
        own row scale)."""
        mods = list(mods)
        if not mods or any(type(m) is not cls for m in mods):
            raise TypeError(f"NVFP4Linear.concat: needs {cls.__name__} modules, got {[type(m).__name__ for m in mods]}")
        if any(m.paired for m in mods):
            raise ValueError("NVFP4Linear.concat: merge before pair_for_mma_")
        k = mods[0].in_features
        if any(m.in_features != k for m in mods):
            raise ValueError("NVFP4Linear.concat: input sizes differ")
        has_bias = [m.bias is not None for m in mods]
        if any(has_bias) and not all(has_bias):
            raise ValueError("NVFP4Linear.concat: some members have a bias and some do not")
        with torch.no_grad():
            q = NVFP4Weight(torch.cat([m.weight_packed for m in mods]), torch.cat([m.weight_scale for m in mods]),
                            torch.cat([m.weight_row_scale for m in mods]))
            bias = torch.cat([m.bias for m in mods]) if has_bias[0] else None
        return cls.from_weights(q, bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        packed, scale = self.weight_packed, self.weight_scale
        if self.tiled:
            from ninfer.kernels.triton_nvfp4_mma import untile_weights

            packed, scale = untile_weights(packed, scale, self.paired)
        if self.paired:
            from ninfer.kernels.triton_nvfp4_mma import unpair_weights

            packed, scale = unpair_weights(packed, scale, self.paired)
        return dequantize_nvfp4(packed, scale, self.weight_row_scale, dtype)

    def pair_for_mma_(self, warps: int, tiled: bool = False) -> bool:
        """Store the codes and block scales paired for the tensor-core GEMV's launches of `warps` warps
        (ninfer.kernels.triton_nvfp4_mma.pair_weights: two steps of a lane's weights in one load), in place, where
        K allows; tiled: and each 16-row tile's weights as one run, where N is a multiple of 16 (tile_weights).
        Products stay bit for bit what they were. Only for serving: the buffers then no longer hold a
        checkpoint's layout (dequantize still gives the weight in K order). Returns whether it did."""
        from ninfer.kernels.triton_nvfp4_mma import pair_weights, pairable, tile_weights

        if self.paired or not pairable(self.in_features, warps):
            return False
        packed, scale = pair_weights(self.weight_packed, self.weight_scale, warps)
        self.tiled = tiled and self.out_features % 16 == 0
        if self.tiled:
            packed, scale = tile_weights(packed, scale, warps)
        self.weight_packed.copy_(packed)
        self.weight_scale.copy_(scale)
        self.paired = warps
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ninfer.kernels.backend import use_triton

        if use_triton(x):
            from ninfer.kernels.linear import rows_like
            from ninfer.kernels.triton_nvfp4 import nvfp4_linear

            return nvfp4_linear(x, self.weight_packed, self.weight_scale, self.weight_row_scale, self.bias,
                                rows_like=rows_like.current, paired=self.paired, tiled=self.tiled)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize(x.dtype), bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format=nvfp4")


def nvfp4_head_logits(head: NVFP4Linear, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 logits through an NVFP4 lm_head, in calls the GEMV takes (16 rows; one in fp16): a larger
    call would dequantize the whole head (~2.5 GB at a 248k vocabulary) for one matmul."""
    rows = 1 if hidden.dtype == torch.float16 else 16
    if hidden.shape[0] <= rows:
        return head(hidden).float()
    return torch.cat([head(part).float() for part in hidden.split(rows)])


def quantize_nvfp4_stack(weight: torch.Tensor) -> NVFP4Weight:
    """[E, N, K] (e.g. fused routed experts) -> NVFP4 with one global scale per matrix: packed
    [E, N, K/2], scales [E, N, K/16], row scales [E, N]."""
    parts = [quantize_nvfp4(w) for w in weight]
    return NVFP4Weight(*(torch.stack(t) for t in zip(*parts)))


class NVFP4Experts(nn.Module):
    """Routed experts (ninfer.kernels.moe.Experts) with NVFP4 weights: gate_up_proj [E, 2I, H] and
    down_proj [E, H, I] as `<name>_packed`, `<name>_scale`, `<name>_row_scale` buffers, one global
    scale per expert matrix (the row scales). Decode on CUDA (bf16, up to triton_moe.MAX_TOKENS
    tokens) runs ninfer.kernels.triton_nvfp4_moe; otherwise the experts are dequantized to x.dtype
    for the torch path (prefill: one layer's experts at a time, a transient the KV sizing measures)."""

    PROJ = ("gate_up", "down")

    def __init__(self, num_experts: int, hidden: int, intermediate: int, device: torch.device | str | None = None):
        super().__init__()
        if hidden % GROUP_SIZE or intermediate % GROUP_SIZE:
            raise ValueError(f"NVFP4Experts: hidden={hidden} and intermediate={intermediate} must be multiples "
                             f"of {GROUP_SIZE}")
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        for proj, (n, k) in zip(self.PROJ, ((2 * intermediate, hidden), (hidden, intermediate))):
            self.register_buffer(f"{proj}_packed", torch.zeros(num_experts, n, k // 2, dtype=torch.uint8, device=device))
            self.register_buffer(f"{proj}_scale", torch.zeros(num_experts, n, k // GROUP_SIZE,
                                                               dtype=torch.float8_e4m3fn, device=device))
            self.register_buffer(f"{proj}_row_scale", torch.ones(num_experts, n, dtype=torch.float32, device=device))

    @classmethod
    def from_experts(cls, experts: nn.Module) -> "NVFP4Experts":
        """Quantize an Experts module (on its device)."""
        num_experts, inter2, hidden = experts.gate_up_proj.shape
        mod = cls(num_experts, hidden, inter2 // 2, device="meta")
        for proj in cls.PROJ:
            q = quantize_nvfp4_stack(getattr(experts, f"{proj}_proj").detach())
            setattr(mod, f"{proj}_packed", q.packed)
            setattr(mod, f"{proj}_scale", q.scale)
            setattr(mod, f"{proj}_row_scale", q.row_scale.float())
        return mod

    def weights(self, proj: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return getattr(self, f"{proj}_packed"), getattr(self, f"{proj}_scale"), getattr(self, f"{proj}_row_scale")

    def dequantize(self, proj: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [E, N, K] weight in `dtype` (as dequantize_nvfp4 per expert)."""
        packed, scale, row_scale = self.weights(proj)
        e, n, half = packed.shape
        flat = (packed.reshape(e * n, half), scale.reshape(e * n, -1), row_scale.reshape(e * n))
        from ninfer.kernels.backend import use_triton

        if use_triton(packed):
            from ninfer.kernels.triton_nvfp4 import nvfp4_dequantize

            return nvfp4_dequantize(*flat, dtype=dtype).view(e, n, half * 2)
        return dequantize_nvfp4(*flat, dtype).view(e, n, half * 2)

    def forward(self, x: torch.Tensor, top_ids: torch.Tensor, top_weights: torch.Tensor) -> torch.Tensor:
        from ninfer.kernels.backend import use_triton
        from ninfer.kernels.moe import routed_experts

        if use_triton(x) and x.dtype == torch.bfloat16:
            from ninfer.kernels import triton_moe, triton_nvfp4_moe

            if top_ids.shape[0] <= triton_moe.MAX_TOKENS:
                return triton_nvfp4_moe.fused_experts_nvfp4(x, top_ids, top_weights, self.weights("gate_up"),
                                                            self.weights("down"))
        return routed_experts(x, top_ids, top_weights, self.dequantize("gate_up", x.dtype),
                              self.dequantize("down", x.dtype))

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden}, intermediate={self.intermediate}, "
                f"format=nvfp4")


# ---------------------------------------------------------------------------------------------
# Whole models


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(name == p or name.endswith("." + p) for p in patterns)


def quantizable(name: str, out_features: int, in_features: int, skip: Iterable[str] = DEFAULT_SKIP, *,
                lm_head: bool = False) -> bool:
    """Whether the linear `name` (module path in the text model, e.g. "layers.3.mlp.down_proj") gets
    NVFP4: inside a decoder layer, not skipped, K a multiple of 16. lm_head=True also admits the
    output projection "lm_head" (an untied one: callers never offer a tied head, which is the
    embedding table). Shared by quantize_model_ and the converter, which decides from tensor names alone."""
    parts = name.split(".")
    in_layer = len(parts) >= 3 and parts[0] == "layers" and parts[1].isdigit()
    if not (in_layer or (lm_head and name == "lm_head")):
        return False  # embeddings, final norm, lm_head unless asked for, ...
    return not _matches(name, skip) and in_features % GROUP_SIZE == 0 and out_features > 0


def manifest_entry(modules: Iterable[str], mtp_modules: Iterable[str] = ()) -> dict:
    """What an artifact's manifest records under `quantization` for NVFP4 weights: `modules`, relative to
    the text component (e.g. "layers.0.mlp.down_proj"), and `mtp_modules` (where any), relative to the
    MTP head's (e.g. "layers.0.self_attn.q_proj")."""
    entry = {"weights": "nvfp4", "group_size": GROUP_SIZE, "modules": sorted(modules, key=_natural_key)}
    if mtp_modules:
        entry["mtp_modules"] = sorted(mtp_modules, key=_natural_key)
    return entry


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in name.split(".")]


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, leaf, module)


def _check_unfused(model: nn.Module) -> None:
    if any(m.__dict__.get("_proj_plan") for m in model.modules()):
        raise ValueError("quantize the model before fuse_projections_ (merged projections mix layers "
                         "that are skipped, e.g. the MoE router, with quantized ones)")


@torch.no_grad()
def quantize_model_(model: nn.Module, skip: Iterable[str] = DEFAULT_SKIP, lm_head: bool = False) -> list[str]:
    """Replace, in place, every quantizable nn.Linear of the decoder layers with an NVFP4Linear
    (quantized on the weight's device), dropping the bf16 weight. Returns the replaced module names.

    Layer by layer, one linear at a time: peak memory stays at the unquantized model plus one
    layer's temporaries. Embeddings, the MoE router (`mlp.gate`), `shared_expert_gate` and
    GDN's in_proj_a/in_proj_b stay unquantized. The routed MoE experts (`Experts`, fused
    gate_up_proj / down_proj) become NVFP4Experts.
    lm_head=True also quantizes an untied `lm_head` (opt-in: its logits then carry the 4-bit error).
    A model with tied embeddings has no head of its own (the logits read the embedding table, which
    stays unquantized), so there lm_head=True quantizes nothing more.
    Call before `fuse_projections_` (the merged q/k/v, gate/up, ... are then NVFP4Linear.concat).
    """
    _check_unfused(model)
    skip = tuple(skip)
    lm_head = lm_head and not getattr(model, "tie_word_embeddings", False)
    done = []
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and quantizable(name, module.out_features, module.in_features, skip,
                                                     lm_head=lm_head):
            _set_module(model, name, NVFP4Linear.from_linear(module))
            module.weight = None  # drop the bf16 storage now, not when the old module is collected
            done.append(name)
        elif _is_experts(module) and quantizable_experts(name, module.gate_up_proj.shape, skip):
            _set_module(model, name, NVFP4Experts.from_experts(module))
            module.gate_up_proj = module.down_proj = None
            done.append(name)
    return done


def _is_experts(module: nn.Module) -> bool:
    from ninfer.kernels.moe import Experts

    return type(module) is Experts


def quantizable_experts(name: str, gate_up_shape, skip: Iterable[str] = DEFAULT_SKIP) -> bool:
    """Whether fused routed experts `name` (e.g. "layers.0.mlp.experts", gate_up [E, 2I, H]) get NVFP4."""
    _, inter2, hidden = gate_up_shape
    return (quantizable(name, inter2, hidden, skip) and (inter2 // 2) % GROUP_SIZE == 0)


def replace_with_nvfp4_(model: nn.Module, names: Iterable[str]) -> None:
    """Swap the named nn.Linear modules for empty NVFP4Linear of the same shape (on the same device),
    ready for load_state_dict: the loader's path for quantized artifacts."""
    _check_unfused(model)
    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError:  # e.g. "lm_head" listed for a model that ties its embeddings
            raise ValueError(f"quantized module {name!r} is not in the model") from None
        if isinstance(module, (NVFP4Linear, NVFP4Experts)):
            continue
        if _is_experts(module):
            num_experts, inter2, hidden = module.gate_up_proj.shape
            _set_module(model, name, NVFP4Experts(num_experts, hidden, inter2 // 2, device=module.gate_up_proj.device))
            continue
        if type(module) is not nn.Linear:
            raise ValueError(f"quantized module {name!r} is a {type(module).__name__}, not a Linear")
        device = module.weight.device
        bias_dtype = module.bias.dtype if module.bias is not None else None
        _set_module(model, name, NVFP4Linear(module.in_features, module.out_features, module.bias is not None,
                                             device=device, dtype=bias_dtype))
