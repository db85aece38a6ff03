"""Layers shared by the model families: norms, rotary embeddings, SwiGLU MLP, projection merging."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ninfer.kernels import fused
from ninfer.kernels.linear import DecodeLinear, SplitSums


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32.

    zero_centered=True is the Gemma/Qwen3.5 form, y = x_hat * (1 + w) (weights initialised at 0);
    False is the Llama form, y = w * x_hat, with x_hat cast back to the input dtype first.
    """

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); or, with `residual`, (norm(residual + x), residual + x) in one fused pass."""
        if residual is None:
            return fused.rms_norm(x, self.weight, self.eps, self.zero_centered)
        return fused.add_rms_norm(residual, x, self.weight, self.eps, self.zero_centered)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE on the first `rotary_dim` channels of each head.

    positions may be [T] (text) or [3, T] (MRoPE t/h/w). With mrope_section, each frequency
    takes its angle from one axis; interleaved=True assigns axes round-robin (Qwen3.5: t,h,w,t,...).
    For text, all three axes agree and this reduces to ordinary RoPE.
    """

    def __init__(
        self, rotary_dim: int, theta: float, mrope_section: list[int] | None = None,
        mrope_interleaved: bool = False, inv_freq: torch.Tensor | None = None,
    ):
        super().__init__()
        self.rotary_dim = rotary_dim
        if inv_freq is None:
            inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.mrope_section = mrope_section
        self.mrope_interleaved = mrope_interleaved

    def _axis_of_frequency(self, n: int) -> torch.Tensor:
        axis = torch.zeros(n, dtype=torch.long)
        sec = self.mrope_section
        if self.mrope_interleaved:
            for a in (1, 2):
                axis[a : sec[a] * 3 : 3] = a
        else:
            axis[sec[0] : sec[0] + sec[1]] = 1
            axis[sec[0] + sec[1] : sum(sec)] = 2
        return axis

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq.to(positions.device)
        if positions.dim() == 1:
            freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, F]
        else:
            all_axes = positions.float()[:, :, None] * inv_freq[None, None, :]  # [3, T, F]
            if self.mrope_section is None:
                freqs = all_axes[0]
            else:
                axis = self._axis_of_frequency(inv_freq.numel()).to(positions.device)
                freqs = all_axes.gather(0, axis[None, None, :].expand(1, all_axes.shape[1], -1))[0]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class SwiGLU(nn.Module):
    FUSE = {"gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(self, ("gate_proj", "up_proj"), x)
        return self.down_proj(fused.silu_and_mul(gate, up))


# ---------------------------------------------------------------------------------------------
# Projection merging: linears that read the same input become one matmul after loading.
#
# A module lists its groups in a class attribute `FUSE = {merged name: (member names, ...)}` (names
# relative to the module, dotted for a child's); `fuse_projections_(model)` merges them once the
# weights are loaded, top-down (a parent's group may take a child's members, whose own group is then
# skipped). Forward code asks for the members by name through `project`, which runs the merged
# matmul once and hands out column views, or the separate modules before fusion: one forward code
# path for both. Checkpoint names do not change: the state dict of a merged plain nn.Linear is
# split back into its members' names (row views of the merged weight, no copies), and loading the
# members' names into a fused module merges them.


def _out_features(m: nn.Module) -> int:
    n = getattr(m, "out_features", None)
    return int(n) if n is not None else int(m.weight.shape[0])


def merge_linears(mods: Sequence[nn.Module]) -> nn.Module:
    """One module whose output is cat([m(x) for m in mods], -1): stacked weight rows (and biases).

    Plain nn.Linear: concatenated weight/bias in a new nn.Linear. Other linear-like types (e.g.
    quantized weights) provide `type(m).concat(mods) -> module`.
    """
    mods = list(mods)
    if all(type(m) is nn.Linear for m in mods):
        in_features = mods[0].in_features
        if any(m.in_features != in_features for m in mods):
            raise ValueError("merge_linears: input sizes differ")
        has_bias = [m.bias is not None for m in mods]
        if any(has_bias) and not all(has_bias):
            raise ValueError("merge_linears: some members have a bias and some do not")
        with torch.no_grad():
            weight = torch.cat([m.weight for m in mods], dim=0)
            bias = torch.cat([m.bias for m in mods], dim=0) if has_bias[0] else None
        merged = nn.Linear(in_features, weight.shape[0], bias=bias is not None, device="meta")
        merged.weight = nn.Parameter(weight, requires_grad=mods[0].weight.requires_grad)
        if bias is not None:
            merged.bias = nn.Parameter(bias, requires_grad=mods[0].bias.requires_grad)
        return merged
    concat = getattr(type(mods[0]), "concat", None)
    if concat is None or any(type(m) is not type(mods[0]) for m in mods):
        raise TypeError(f"merge_linears: cannot merge {[type(m).__name__ for m in mods]}")
    return concat(mods)


def _resolve(owner: nn.Module, name: str) -> tuple[nn.Module, str, nn.Module | None]:
    parent_path, _, leaf = name.rpartition(".")
    try:
        parent = owner.get_submodule(parent_path) if parent_path else owner
    except AttributeError:
        return owner, leaf, None
    return parent, leaf, parent._modules.get(leaf)


def fuse_linears_(owner: nn.Module, merged_name: str, names: Sequence[str]) -> int:
    """Merge owner's linears `names` (all reading the same input) into `owner.<merged_name>`.

    Members are grouped by module type (a plain nn.Linear is not stacked with a quantized one); each
    group of two or more becomes one module (`merged_name`, or `merged_name_<i>` for later groups),
    the members are removed. Returns the number of merged modules made; 0 when a member is missing
    (already merged, here or by a parent) - fusing twice is a no-op.
    """
    resolved = [_resolve(owner, n) for n in names]
    if any(m is None for _, _, m in resolved):
        return 0
    groups: dict[type, list[int]] = {}
    for i, (_, _, m) in enumerate(resolved):
        groups.setdefault(type(m), []).append(i)
    plan = owner.__dict__.setdefault("_proj_plan", {})
    made = 0
    for members in groups.values():
        if len(members) < 2:
            continue
        mods = [resolved[i][2] for i in members]
        merged = merge_linears(mods)
        attr = merged_name if made == 0 else f"{merged_name}_{made}"
        start = 0
        for i, m in zip(members, mods):
            size = _out_features(m)
            plan[names[i]] = (attr, start, size)
            start += size
            parent, leaf, _ = resolved[i]
            delattr(parent, leaf)
        owner.add_module(attr, merged)
        made += 1
    if made and not owner.__dict__.get("_proj_hooks"):
        owner.register_state_dict_post_hook(_split_state_dict_hook)
        owner.register_load_state_dict_pre_hook(_merge_load_hook)
        owner._proj_hooks = True
    return made


def project(owner: nn.Module, names: Sequence[str], x: torch.Tensor,
            split_sums: Sequence[str] = ()) -> list[torch.Tensor | SplitSums]:
    """Outputs of owner's linears `names` on x: column views of a merged matmul where merged (each
    merged module runs once), else each module's own output. split_sums: names whose output may come
    back as the Triton GEMM's partial sums (linear.SplitSums, for a consumer that reduces them itself),
    where their module is a DecodeLinear whose other members are all in split_sums too."""
    plan = owner.__dict__.get("_proj_plan") or {}
    members: dict[str, set[str]] = {}
    for name, (attr, _, _) in plan.items() if split_sums else ():
        members.setdefault(attr, set()).add(name)
    outs, done = [], {}
    for n in names:
        attr, start, size = plan.get(n) or (n, 0, None)
        y = done.get(attr)
        if y is None:
            module = owner.get_submodule(attr)
            if n in split_sums and isinstance(module, DecodeLinear) and members.get(attr, {n}) <= set(split_sums):
                y = module.split_sums(x)
            y = done[attr] = module(x) if y is None else y
        outs.append(y if size is None else y.narrow(-1, start, size))
    return outs


def _linear_groups(owner: nn.Module):
    """(merged attr, [(member name, start, size)]) of owner's merged nn.Linear modules (DecodeLinear
    included; a quantized linear is not an nn.Linear and keeps its merged names)."""
    groups: dict[str, list[tuple[str, int, int]]] = {}
    for name, (attr, start, size) in owner.__dict__.get("_proj_plan", {}).items():
        groups.setdefault(attr, []).append((name, start, size))
    for attr, members in groups.items():
        if isinstance(owner._modules.get(attr), nn.Linear):
            yield attr, members


def _split_state_dict_hook(owner, state_dict, prefix, local_metadata):
    for attr, members in _linear_groups(owner):
        for leaf in ("weight", "bias"):
            merged = state_dict.pop(f"{prefix}{attr}.{leaf}", None)
            if merged is None:
                continue
            for name, start, size in members:
                state_dict[f"{prefix}{name}.{leaf}"] = merged.narrow(0, start, size)


def _merge_load_hook(owner, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                     error_msgs):
    for attr, members in _linear_groups(owner):
        for leaf in ("weight", "bias"):
            keys = [f"{prefix}{name}.{leaf}" for name, _, _ in members]
            if all(k in state_dict for k in keys):
                state_dict[f"{prefix}{attr}.{leaf}"] = torch.cat([state_dict.pop(k) for k in keys], dim=0)


def fuse_projections_(model: nn.Module) -> int:
    """Merge every `FUSE` group of the model's modules (after the weights are loaded). Returns the
    number of merged modules made: 0 on a second call."""
    made = 0
    for module in list(model.modules()):  # pre-order: parents before children
        for merged_name, names in getattr(type(module), "FUSE", {}).items():
            made += fuse_linears_(module, merged_name, names)
    return made


def check_component_weights(module: nn.Module, tensors: dict[str, torch.Tensor], what: str) -> None:
    """Raise ValueError unless `tensors` are exactly `module`'s parameters at their shapes (a meta-device
    module is enough); converters call it so a partial or mis-shaped component fails at conversion."""
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    missing = sorted(expected.keys() - tensors.keys())
    unexpected = sorted(tensors.keys() - expected.keys())
    wrong = sorted(k for k in expected.keys() & tensors.keys() if tuple(tensors[k].shape) != expected[k])
    if missing or unexpected or wrong:
        shapes = [f"{k} {tuple(tensors[k].shape)} != {expected[k]}" for k in wrong[:3]]
        raise ValueError(f"{what}: missing {missing[:5]}, unexpected {unexpected[:5]}, wrong shape {shapes}")
