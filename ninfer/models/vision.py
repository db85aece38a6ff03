"""Qwen3.5 / 3.6 vision tower: a ViT over 16x16x2 patches and a 2x2 patch merger (no DeepStack).

Input: the packed patches the preprocessor makes, [N, C * Tp * P * P] (each patch flattened in
(channel, t, y, x) order, each 2x2 merge block contiguous, frames one after another), and
grid_thw [items, 3] in patches. Output: [N / 4, out_hidden] merged embeddings in the same order,
the rows that replace an item's `<|image_pad|>` / `<|video_pad|>` tokens.

Attention stays inside one frame (an image is one frame; a video has t), as the checkpoint was
trained. Frames of equal patch count run as one batched SDPA call, so the cost is one call per
distinct frame size, not one per frame.

State-dict names are the checkpoint's with `model.visual.` removed.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.models.layers import check_component_weights

# Qwen3_5VisionConfig's defaults, which are the released towers' values except out_hidden_size
# (the text hidden size: 5120 for 27B, 2048 for 35B-A3B), which checkpoints always state.
_HF_DEFAULTS: dict[str, Any] = {
    "depth": 27, "hidden_size": 1152, "num_heads": 16, "intermediate_size": 4304, "out_hidden_size": 3584,
    "in_channels": 3, "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
    "num_position_embeddings": 2304, "hidden_act": "gelu_pytorch_tanh",
}
_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "VisionConfig":
        """From the artifact's `vision` component config (HF field names, see vision_config_from_hf)."""
        names = {f.name for f in fields(cls)} - {"rope_theta"}
        theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
        config = cls(**{k: v for k, v in cfg.items() if k in names}, rope_theta=float(theta))
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"vision hidden_act {config.hidden_act!r} is not supported ({', '.join(_ACTIVATIONS)})")
        if config.hidden_size % config.num_heads or config.head_dim % 4:
            raise ValueError(f"vision head_dim {config.hidden_size}/{config.num_heads} must be a multiple of 4")
        side = round(config.num_position_embeddings ** 0.5)
        if side * side != config.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {config.num_position_embeddings} is not a square grid")
        return config

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2


def vision_config_from_hf(hf_config: dict[str, Any]) -> dict[str, Any] | None:
    """The `vision` component config from an HF VLM config.json (None when it has no vision_config):
    HF field names, the class defaults filled in, rope_parameters normalised to {rope_type, rope_theta}."""
    raw = hf_config.get("vision_config")
    if not isinstance(raw, dict):
        return None
    cfg = {k: raw.get(k, default) for k, default in _HF_DEFAULTS.items()}
    rope = dict(raw.get("rope_parameters") or {})
    cfg["rope_parameters"] = {"rope_type": rope.get("rope_type", "axial"),
                              "rope_theta": float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))}
    if cfg["rope_parameters"]["rope_type"] != "axial":
        raise ValueError(f"vision rope_type {cfg['rope_parameters']['rope_type']!r} is not supported (axial)")
    if raw.get("deepstack_visual_indexes"):
        raise ValueError("vision towers with DeepStack (deepstack_visual_indexes) are not supported")
    VisionConfig.from_dict(cfg)  # validate now, at conversion, not at load
    return cfg


# ---------------------------------------------------------------------------------------------
# Per-forward layout: computed once from grid_thw, shared by every block


def _as_grids(grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> list[tuple[int, int, int]]:
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
    return [(int(t), int(h), int(w)) for t, h, w in rows]


def _merge_block_order(values: torch.Tensor, h: int, w: int, merge: int) -> torch.Tensor:
    """[h, w, ...] in raster order -> [h*w, ...] in the packing order (2x2 blocks contiguous)."""
    rest = values.shape[2:]
    blocks = values.reshape(h // merge, merge, w // merge, merge, *rest).transpose(1, 2)
    return blocks.reshape(h * w, *rest)


@dataclass
class FrameGroups:
    """The cu_seqlens of the packed sequence, grouped for batched attention: each entry is
    (frame length L, row index of its F frames' patches [F*L], or None when that is all rows in order)."""

    groups: list[tuple[int, torch.Tensor | None]]

    @classmethod
    def build(cls, grids: list[tuple[int, int, int]], device: torch.device) -> "FrameGroups":
        starts_by_len: dict[int, list[int]] = {}
        offset = 0
        for t, h, w in grids:
            for _ in range(t):
                starts_by_len.setdefault(h * w, []).append(offset)
                offset += h * w
        groups: list[tuple[int, torch.Tensor | None]] = []
        for length, starts in starts_by_len.items():
            if len(starts_by_len) == 1:  # one frame size: the whole sequence in order, no gather
                groups.append((length, None))
                continue
            first = torch.tensor(starts, device=device, dtype=torch.long)
            groups.append((length, (first[:, None] + torch.arange(length, device=device)).reshape(-1)))
        return cls(groups)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v [N, heads, d] -> [N, heads, d], full attention within each frame only."""
        if len(self.groups) == 1 and self.groups[0][1] is None:
            return self._frames(q, k, v, self.groups[0][0])
        out = torch.empty_like(q)
        for length, index in self.groups:
            o = self._frames(q.index_select(0, index), k.index_select(0, index), v.index_select(0, index), length)
            out.index_copy_(0, index, o)
        return out

    @staticmethod
    def _frames(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int) -> torch.Tensor:
        n, heads, d = q.shape
        q, k, v = (x.reshape(n // length, length, heads, d).transpose(1, 2) for x in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v)  # [frames, heads, L, d]; scale 1/sqrt(d)
        return o.transpose(1, 2).reshape(n, heads, d)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class VisionRotary(nn.Module):
    """2-D axial RoPE: the first half of the rotated pairs turn with the patch row, the second half
    with the column, over the whole head dim (rotate-half layout). Angles in fp32."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    def forward(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows, cols [N] -> cos, sin [N, 1, head_dim] (fp32, broadcast over heads)."""
        half = self.head_dim // 2
        # computed here rather than stored: no buffer to materialize when the tower is built on meta
        inv_freq = self.theta ** -(torch.arange(0, half, 2, device=rows.device, dtype=torch.float32) / half)
        freqs = torch.cat([rows[:, None].float() * inv_freq, cols[:, None].float() * inv_freq], dim=-1)
        angles = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Modules


class PatchEmbed(nn.Module):
    """Conv3d with kernel = stride = one patch; kept as a Conv3d for the checkpoint's weight shape."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # the conv sees exactly one patch per output: a matmul over the (c, t, y, x)-flattened patch
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.flatten(1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], frames: FrameGroups) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        return self.proj(frames.attention(q, k, v).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], frames: FrameGroups) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, frames)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm per patch, then each 2x2 block (4 consecutive rows) as one vector -> MLP (exact GELU)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        merged = cfg.hidden_size * cfg.merge_unit
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(merged, merged, bias=True)
        self.linear_fc2 = nn.Linear(merged, cfg.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.linear_fc1.in_features)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    """patches [N, patch_dim] + grid_thw [items, 3] -> merged embeddings [N / merge_unit, out_hidden]."""

    def __init__(self, config: dict[str, Any] | VisionConfig):
        super().__init__()
        cfg = config if isinstance(config, VisionConfig) else VisionConfig.from_dict(config)
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.rotary = VisionRotary(cfg.head_dim, cfg.rope_theta)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)

    def num_tokens(self, grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> list[int]:
        """Merged tokens per item: t * h * w / 4, the placeholder count in the prompt."""
        return [t * h * w // self.config.merge_unit for t, h, w in _as_grids(grid_thw)]

    def forward(self, patches: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        grids = self._check(patches, grid_thw)
        frames = FrameGroups.build(grids, patches.device)
        x = self.patch_embed(patches)
        x = x + self._position_embeddings(grids, x.device).to(x.dtype)
        rope = self.rotary(*self._patch_coordinates(grids, x.device))
        for block in self.blocks:
            x = block(x, rope, frames)
        return self.merger(x)

    def _check(self, patches: torch.Tensor, grid_thw) -> list[tuple[int, int, int]]:
        cfg = self.config
        grids = _as_grids(grid_thw)
        merge = cfg.spatial_merge_size
        bad = [g for g in grids if min(g) < 1 or g[1] % merge or g[2] % merge]
        if bad:
            raise ValueError(f"grid_thw {bad}: h and w must be positive multiples of {merge}")
        total = sum(t * h * w for t, h, w in grids)
        if patches.dim() != 2 or patches.shape != (total, cfg.patch_dim):
            raise ValueError(f"patches {tuple(patches.shape)} do not match grid_thw: want ({total}, {cfg.patch_dim})")
        return grids

    def _patch_coordinates(self, grids, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, col) of every patch in packing order; each frame of a video repeats its image's."""
        merge = self.config.spatial_merge_size
        rows, cols = [], []
        for t, h, w in grids:
            r = torch.arange(h, device=device)[:, None].expand(h, w)
            c = torch.arange(w, device=device)[None, :].expand(h, w)
            rows.append(_merge_block_order(r, h, w, merge).repeat(t))
            cols.append(_merge_block_order(c, h, w, merge).repeat(t))
        return torch.cat(rows), torch.cat(cols)

    def _position_embeddings(self, grids, device) -> torch.Tensor:
        """The learned square table resampled to each item's (h, w) grid (bilinear, corners
        aligned: the table's corners land on the grid's corner patches), in packing order, fp32."""
        side = round(self.config.num_position_embeddings ** 0.5)
        table = self.pos_embed.weight.float().t().reshape(1, -1, side, side)
        resized: dict[tuple[int, int], torch.Tensor] = {}
        out = []
        for t, h, w in grids:
            if (h, w) not in resized:
                grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]
                resized[(h, w)] = _merge_block_order(grid.permute(1, 2, 0), h, w, self.config.spatial_merge_size)
            out.append(resized[(h, w)].repeat(t, 1))
        return torch.cat(out).to(device)

    @torch.no_grad()
    def init_random_(self, seed: int) -> None:
        """Deterministic synthetic weights in place: normal(0, 0.02) matrices and embeddings,
        LayerNorms at (1, 0), biases 0 (transformers' initialisation)."""
        generators: dict[torch.device, torch.Generator] = {}
        for name, p in self.named_parameters():
            if p.device not in generators:
                generators[p.device] = torch.Generator(device=p.device).manual_seed(seed)
            if ".norm" in f".{name}" and name.endswith("weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=generators[p.device])


def build_vision_tower(config: dict[str, Any]) -> VisionTower:
    """The tower for an artifact's `vision` component config."""
    return VisionTower(config)


def check_vision_weights(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Raise ValueError unless `tensors` are exactly the tower's parameters at their shapes
    (the converter calls it, so a partial or mis-shaped tower fails at conversion, not at load)."""
    with torch.device("meta"):
        module = build_vision_tower(config)
    check_component_weights(module, tensors, "vision weights do not match the vision config")
