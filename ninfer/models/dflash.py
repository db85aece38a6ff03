"""DFlash and DFlash2 block drafters (z-lab) on the paged KV cache.

Per qwen35-architecture.md section 5. A drafter of N Qwen3-style layers (plain RMSNorm w * x_hat,
q/k norms, full-head RoPE, SwiGLU, no output gate) fills a whole block in one forward:

    context   = hidden_norm(fc(features))        features: the trunk's hidden states after each layer in
                                                 target_layer_ids, concatenated in that order (HF
                                                 output_hidden_states index id + 1: decoder layer id's
                                                 output, before the final norm)
    block     = [last verified token, mask, ..., mask]              block_size tokens
    per layer   queries from the block only; keys/values = the context's k/v projections (cached by
                `context_kv`) followed by the block's own
    drafts    = the trunk's lm_head on norm(block output) at positions 1..block_size-1

It has no embedding or head of its own: `attach_(trunk)` shares the trunk's. Attention inside the
block follows z-lab: bidirectional, except where config `is_causal` says otherwise; when the config
leaves `is_causal` out, sliding_attention layers are causal (z-lab's rule) and full_attention
layers are not.

DFlash2 (variant "dflash2") adds, per layer, a grouped dynamic causal convolution along the block
before and after attention and before and after the MLP (`GroupedDynamicConv`), and replaces
independent argmaxes by a `CandidateSelector` walking the per-position top-k candidates.

KV, for whoever schedules it: KV index i of a sequence holds the context entry of position i once
`context_kv` has run for it (the trunk's features of a committed token). `draft` writes the block's
own K/V at the block's slots, past the committed frontier: they are stale once drafting ends and
are overwritten by the next `context_kv` at the accepted positions, or by the next block, before
anything reads them again (each layer writes its block K/V before attending). So the page table
given to `draft` must cover the block (the verification window needs the same pages).

Sliding windows are applied by the torch reference attention only. The CUDA path runs the block as
decode rows of the paged kernel, which has no window, so layers typed sliding_attention see the
whole context there: a drafter-quality matter (acceptance at contexts beyond the window), never one
of output correctness, which verification keeps exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.forward import CacheSpec, ForwardBatch, ModelCache
from ninfer.kernels import fused
from ninfer.kernels.attention import dequantize_kv, paged_attention, sequence_slots
from ninfer.kernels.backend import use_triton
from ninfer.models.layers import (
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    check_component_weights,
    fuse_projections_,
    project,
)

VARIANTS = ("dflash", "dflash2")
_ARCHITECTURES = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash2"}

# HF config fields of the drafter's layers, kept under their names in the component config.
_LAYER_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "rms_norm_eps", "attention_bias", "vocab_size", "hidden_act", "layer_types", "sliding_window",
    "is_causal", "num_target_layers", "max_position_embeddings",
)
# Fields z-lab reads from `dflash_config` first, then from the top level (both layouts exist).
_DRAFT_FIELDS = (
    "block_size", "mask_token_id", "target_layer_ids", "input_embedding_scale", "output_multiplier",
    "final_logit_softcapping", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
)
_DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def dflash_config_from_hf(hf_config: dict[str, Any], variant: str | None = None) -> dict[str, Any]:
    """The `dflash` / `dflash2` component config from a z-lab drafter's config.json: the layer fields
    and the draft fields under their HF names (the draft fields lifted out of `dflash_config`),
    rope folded into rope_parameters, and `variant`. variant None: from `architectures`."""
    declared = {_ARCHITECTURES[a] for a in hf_config.get("architectures") or [] if a in _ARCHITECTURES}
    if variant is None:
        variant = declared.pop() if len(declared) == 1 else "dflash"
    if variant not in VARIANTS:
        raise ValueError(f"drafter variant must be one of {VARIANTS}, not {variant!r}")
    if declared and variant not in declared:
        raise ValueError(f"the checkpoint declares {hf_config['architectures']}, not a {variant} drafter")
    cfg = {k: hf_config[k] for k in _LAYER_FIELDS if hf_config.get(k) is not None}
    nested = hf_config.get("dflash_config") or {}
    for k in _DRAFT_FIELDS:
        value = nested.get(k, hf_config.get(k))
        if value is not None:
            cfg[k] = value
    cfg.setdefault("block_size", 16)
    cfg.setdefault("layer_types", ["full_attention"] * cfg["num_hidden_layers"])
    rope = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope.setdefault("rope_theta", hf_config.get("rope_theta", 10_000.0))
    cfg["rope_parameters"] = rope
    cfg["variant"] = variant
    _validate(cfg)
    return cfg


def _validate(cfg: dict[str, Any]) -> None:
    missing = [k for k in ("mask_token_id", "target_layer_ids") if cfg.get(k) is None]
    if cfg["variant"] == "dflash2":
        missing += [k for k in _DFLASH2_FIELDS if cfg.get(k) is None]
    if missing:
        raise ValueError(f"{cfg['variant']} config lacks {missing}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"drafter hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
    if cfg["rope_parameters"]["rope_type"] != "default":
        raise ValueError(f"drafter rope_type {cfg['rope_parameters']['rope_type']!r} is not supported (default)")
    if len(cfg["layer_types"]) != cfg["num_hidden_layers"]:
        raise ValueError("drafter layer_types must name every layer")
    if cfg["variant"] == "dflash2" and cfg["hidden_size"] % cfg["conv_group_size"]:
        raise ValueError("conv_group_size must divide hidden_size")


def _text_positions(positions: torch.Tensor) -> torch.Tensor:
    """The drafter's RoPE is 1-D: the temporal mRoPE axis (all axes agree for text)."""
    return positions if positions.dim() == 1 else positions[0]


# ---------------------------------------------------------------------------------------------
# Attention over cached context + the block


@dataclass
class DraftBlock:
    """A `draft` call's batch: B sequences of `size` tokens each (the last `size` KV indices of each
    sequence), plus its decode-row views for the CUDA kernel, built on first use."""

    batch: ForwardBatch
    size: int
    page_size: int
    rows: dict[bool, ForwardBatch] = field(default_factory=dict)

    def decode_rows(self, causal: bool) -> ForwardBatch:
        """One single-query row per block token: its sequence's pages and the number of KV indices it
        sees (the whole block; causal: the block up to itself). Device ops and host lists only."""
        if causal not in self.rows:
            b, n, batch = self.batch.num_seqs, self.size, self.batch
            device = batch.seq_lens.device
            j = torch.arange(n, device=device)
            offset = j - (n - 1) if causal else torch.zeros_like(j)
            lens = (batch.seq_lens[:, None] + offset).reshape(-1).to(torch.int32)
            lens_cpu = [s + (j - n + 1 if causal else 0) for s in batch.seq_lens_cpu for j in range(n)]
            self.rows[causal] = ForwardBatch(
                input_ids=batch.input_ids, positions=batch.positions,
                query_start_loc=torch.arange(b * n + 1, dtype=torch.int32, device=device), seq_lens=lens,
                page_table=batch.page_table.repeat_interleave(n, dim=0, output_size=b * n),
                slot_mapping=batch.slot_mapping, state_slots=batch.state_slots, query_lens_cpu=[1] * (b * n),
                seq_lens_cpu=lens_cpu,
            )
        return self.rows[causal]


def block_mask(n: int, size: int, causal: bool, window: int | None, device=None) -> torch.Tensor:
    """[size, n] bool: which of a sequence's n KV indices each of its last `size` (the block) sees.
    The window counts KV indices, each query from its own index (z-lab's mask)."""
    q = torch.arange(n - size, n, device=device)[:, None]
    k = torch.arange(n, device=device)[None, :]
    seen = torch.ones(size, n, dtype=torch.bool, device=device)
    if causal:
        seen &= k <= q
    if window:
        seen &= q - k < window
        if not causal:
            seen &= k - q < window
    return seen


def _gather(cache: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor, dtype: torch.dtype):
    if scale is None:
        return cache[slots].to(dtype)
    return dequantize_kv(cache.view(torch.uint8)[slots].view(cache.dtype), scale[slots], dtype)


def block_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block: DraftBlock,
                        scale: float, causal: bool, window: int | None, k_scale=None, v_scale=None) -> torch.Tensor:
    """q [B * size, Hq, D] -> [B * size, Hq, D]: each block query over its sequence's context and block,
    masked by `block_mask`. One SDPA per sequence (host lengths: the torch reference)."""
    out = torch.empty_like(q)
    size = block.size
    for i, n in enumerate(block.batch.seq_lens_cpu):
        slots = sequence_slots(block.batch, i, block.page_size)
        k = _gather(k_cache, k_scale, slots, q.dtype).transpose(0, 1)[None]  # [1, Hkv, n, D]
        v = _gather(v_cache, v_scale, slots, q.dtype).transpose(0, 1)[None]
        rows = slice(i * size, (i + 1) * size)
        o = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], k, v, scale=scale, enable_gqa=True,
                                           attn_mask=block_mask(n, size, causal, window, q.device))
        out[rows] = o[0].transpose(0, 1)
    return out


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys/values also come from the context features (`context_kv`)."""

    FUSE = {"kv_proj": ("k_proj", "v_proj")}  # the context needs k, v only: q stays its own matmul

    def __init__(self, cfg: dict[str, Any], layer_type: str, kv_layer: int):
        super().__init__()
        hidden, eps, bias = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6), cfg.get("attention_bias", False)
        self.kv_layer = kv_layer
        self.num_heads, self.num_kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = cfg.get("head_dim") or hidden // self.num_heads
        self.scale = self.head_dim**-0.5
        sliding = layer_type == "sliding_attention"
        self.window = cfg.get("sliding_window") if sliding else None
        self.causal = sliding if cfg.get("is_causal") is None else bool(cfg["is_causal"])
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)

    def _kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        k, v = project(self, ("k_proj", "v_proj"), x)
        return self.k_norm(k.view(t, self.num_kv_heads, self.head_dim)), v.view(t, self.num_kv_heads, self.head_dim)

    def write_context(self, ctx: torch.Tensor, cos, sin, slots: torch.Tensor, cache: ModelCache) -> None:
        k, v = self._kv(ctx)
        k_cache, v_cache, k_scale, v_scale = cache.layer(self.kv_layer)
        # the fused op rotates a query too: k stands in (a small copy) for its sync-free KV write on CUDA
        fused.rope_qk_write_kv(k, k, v, cos, sin, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)

    def forward(self, x: torch.Tensor, cos, sin, block: DraftBlock, cache: ModelCache) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim))
        k, v = self._kv(x)
        k_cache, v_cache, k_scale, v_scale = cache.layer(self.kv_layer)
        q = fused.rope_qk_write_kv(q, k, v, cos, sin, k_cache, v_cache, block.batch.slot_mapping,
                                   k_scale=k_scale, v_scale=v_scale)
        if use_triton(q):  # no window here (module docstring)
            out = paged_attention(q, k_cache, v_cache, block.decode_rows(self.causal), block.page_size, self.scale,
                                  k_scale, v_scale)
        else:
            out = block_attention_ref(q, k_cache, v_cache, block, self.scale, self.causal, self.window,
                                      k_scale, v_scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


# ---------------------------------------------------------------------------------------------
# DFlash2: dynamic convolution and candidate selection


class GroupedDynamicConv(nn.Module):
    """A causal convolution along the block, per channel: tap o of channel c weighs the token o
    positions back by base_kernel[stage, o, c] + a dynamic weight shared by c's group of
    `group_size` channels, projected from the layer's normed input. Stage 0 runs before the
    sublayer (attention or MLP), stage 1 after it; the block starts with zeros (no context)."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * (hidden // group_size), bias=False)

    def dynamic_kernels(self, h: torch.Tensor) -> torch.Tensor:
        """h [B, L, H] -> [B, L, 2 (stage), K (tap), G (group)]."""
        return self.kernel_projection(h).unflatten(-1, (2, self.kernel_size, -1))

    def convolve(self, x: torch.Tensor, dynamic: torch.Tensor, stage: int) -> torch.Tensor:
        """x [B, L, H], dynamic [B, L, 2, K, G] -> [B, L, H]."""
        k = self.kernel_size
        taps = F.pad(x, (0, 0, k - 1, 0)).unfold(1, k, 1).flip(-1)  # [B, L, H, K]: tap o = x[t - o]
        weight = self.base_kernel[stage].to(x.dtype) + dynamic[:, :, stage].repeat_interleave(self.group_size, -1)
        return (taps * weight.transpose(-1, -2)).sum(-1)


def _around(conv: GroupedDynamicConv | None, h: torch.Tensor, sublayer, size: int) -> torch.Tensor:
    """sublayer(h) for [T, H] rows; with a conv, convolved along each block before and after."""
    if conv is None:
        return sublayer(h)
    blocks = h.view(-1, size, h.shape[-1])
    dynamic = conv.dynamic_kernels(blocks)
    out = sublayer(conv.convolve(blocks, dynamic, 0).reshape_as(h))
    return conv.convolve(out.view_as(blocks), dynamic, 1).reshape_as(h)


class CandidateSelector(nn.Module):
    """DFlash2's choice among each position's top-k tokens. Position t's candidate c scores

        logit_t(c) + < predecessor_codebook[p] * hidden_projection(h_t), successor_codebook[c] >

    with p the token chosen at t-1 (the anchor, the last verified token, at t = 0), and the best
    candidate is taken position after position: a greedy path, as z-lab's `select` walks it."""

    def __init__(self, vocab: int, hidden: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab, rank))  # raw tensors in the checkpoint
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def select(self, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """hidden [B, L, H], logits [B, L, V], anchors [B] -> tokens [B, L] int64."""
        unary, cand = logits.float().topk(self.top_k, dim=-1)  # [B, L, K]
        query = self.hidden_projection(hidden).float()  # [B, L, r]
        # predecessors of every position: the anchor (same K rows) at 0, else the candidates at t-1
        prev = torch.cat([anchors[:, None, None].expand(-1, 1, self.top_k), cand[:, :-1]], dim=1)
        left = self.predecessor_codebook[prev].float() * query[:, :, None]  # [B, L, K (prev), r]
        scores = unary[:, :, None] + left @ self.successor_codebook[cand].float().transpose(-1, -2)
        best = scores.argmax(-1)  # [B, L, K]: the best next candidate after each possible predecessor
        # all tables at once; the walk itself is one gather per position (no host sync)
        index = best[:, 0, 0]
        path = [index]
        for t in range(1, cand.shape[1]):
            index = best[:, t].gather(1, index[:, None])[:, 0]
            path.append(index)
        return cand.gather(-1, torch.stack(path, dim=1)[..., None])[..., 0]


# ---------------------------------------------------------------------------------------------
# The drafter


class DFlashLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], layer_type: str, kv_layer: int):
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = DFlashAttention(cfg, layer_type, kv_layer)
        self.mlp = SwiGLU(hidden, cfg["intermediate_size"])
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.attention_conv = self.mlp_conv = None
        if cfg["variant"] == "dflash2":
            self.attention_conv = GroupedDynamicConv(hidden, cfg["conv_kernel_size"], cfg["conv_group_size"])
            self.mlp_conv = GroupedDynamicConv(hidden, cfg["conv_kernel_size"], cfg["conv_group_size"])

    def forward(self, x: torch.Tensor, cos, sin, block: DraftBlock, cache: ModelCache) -> torch.Tensor:
        """x [B * size, H], the block's hidden states -> the layer's output (residual added)."""
        h = _around(self.attention_conv, self.input_layernorm(x),
                    lambda y: self.self_attn(y, cos, sin, block, cache), block.size)
        h, x = self.post_attention_layernorm(h, x)  # norm(x + h), x + h in one pass
        return x + _around(self.mlp_conv, h, self.mlp, block.size)


class DFlashDrafter(nn.Module):
    """Parameter names are the z-lab checkpoint's (fc, hidden_norm, layers.*, norm, and for dflash2
    candidate_selector.*), so a state dict loads as it is.

    kv_layer_base: the attention-layer index of the drafter's first layer in the ModelCache it is
    given: 0 for a cache of its own (`cache_spec()`), or the trunk's layer count to ride in the
    trunk's cache (`cache_spec(trunk_spec)`), sharing its pages, page table and slot mapping.
    """

    def __init__(self, config: dict[str, Any], kv_layer_base: int = 0):
        super().__init__()
        cfg = {"variant": "dflash", **config}  # a component config (dflash_config_from_hf checked it)
        if cfg["variant"] not in VARIANTS:
            raise ValueError(f"drafter variant must be one of {VARIANTS}, not {cfg['variant']!r}")
        self.config = cfg
        self.variant = cfg["variant"]
        hidden, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.target_layer_ids: list[int] = list(cfg["target_layer_ids"])
        self.block_size: int = int(cfg.get("block_size", 16))
        self.mask_token_id: int = int(cfg["mask_token_id"])
        self.input_embedding_scale = float(cfg.get("input_embedding_scale") or 1.0)
        self.output_multiplier = float(cfg.get("output_multiplier") or 1.0)
        self.softcap = float(cfg.get("final_logit_softcapping") or 0.0)
        layer_types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.layers = nn.ModuleList([DFlashLayer(cfg, t, kv_layer_base + i) for i, t in enumerate(layer_types)])
        self.norm = RMSNorm(hidden, eps)
        self.candidate_selector = None
        if self.variant == "dflash2":
            self.candidate_selector = CandidateSelector(cfg["vocab_size"], hidden, cfg["selector_rank"],
                                                        cfg["selector_top_k"])
        head_dim = self.layers[0].self_attn.head_dim
        self.rotary = RotaryEmbedding(head_dim, (cfg.get("rope_parameters") or {}).get("rope_theta", 10_000.0))
        self._trunk: nn.Module | None = None

    # -- wiring -----------------------------------------------------------------------------------

    def attach_(self, trunk: nn.Module) -> "DFlashDrafter":
        """Share the trunk's embedding and lm_head. Kept out of the module tree (object.__setattr__),
        so state_dict, .to() and fusion touch the drafter's own weights only."""
        for key in ("hidden_size", "vocab_size"):
            if key in self.config and trunk.config[key] != self.config[key]:
                raise ValueError(f"drafter {key} {self.config[key]} does not match the trunk's {trunk.config[key]}")
        if not 0 <= self.mask_token_id < trunk.config["vocab_size"]:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the trunk's vocabulary")
        object.__setattr__(self, "_trunk", trunk)
        return self

    @property
    def trunk(self) -> nn.Module:
        if self._trunk is None:
            raise RuntimeError("DFlashDrafter has no trunk: call attach_(trunk) first")
        return self._trunk

    def cache_spec(self, trunk_spec: CacheSpec | None = None) -> CacheSpec:
        """The drafter's own KV (one attention layer per drafter layer, no recurrent state); with
        trunk_spec, the trunk's spec plus these layers (build with kv_layer_base=trunk_spec.num_attn_layers)."""
        attn = self.layers[0].self_attn
        if trunk_spec is None:
            return CacheSpec(num_attn_layers=len(self.layers), num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim)
        if (trunk_spec.num_kv_heads, trunk_spec.head_dim) != (attn.num_kv_heads, attn.head_dim):
            raise ValueError("the drafter's KV shape differs from the trunk's: give it a cache of its own")
        return CacheSpec(**{**trunk_spec.__dict__, "num_attn_layers": trunk_spec.num_attn_layers + len(self.layers)})

    # -- context and block ------------------------------------------------------------------------

    @torch.no_grad()
    def context_kv(self, batch: ForwardBatch, cache: ModelCache, features: torch.Tensor) -> None:
        """Write every layer's context K/V for batch's tokens (slots batch.slot_mapping, RoPE at
        batch.positions). features [T, len(target_layer_ids) * H]: the trunk's hidden states of those
        tokens (module docstring). Only k/v projections run: context rows never query."""
        ctx = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        cos, sin = self.rotary.cos_sin(_text_positions(batch.positions), ctx.dtype)
        for layer in self.layers:
            layer.self_attn.write_context(ctx, cos, sin, batch.slot_mapping, cache)

    @torch.no_grad()
    def block_logits(self, batch: ForwardBatch, cache: ModelCache,
                     first_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's forward: (hidden [B, size-1, H] after `norm`, logits [B, size-1, V] fp32) of
        positions 1..size-1. batch: B sequences of block_size tokens each, at their positions and
        slots after the committed context; its input_ids are not read (first_tokens + masks are)."""
        b, size = first_tokens.shape[0], self.block_size
        if batch.query_lens_cpu != [size] * b:
            raise ValueError(f"a draft batch holds {b} sequences of block_size={size} tokens each")
        ids = torch.full((b, size), self.mask_token_id, dtype=torch.long, device=first_tokens.device)
        ids[:, 0] = first_tokens
        x = self.trunk.embed_tokens(ids.view(-1)).to(self.fc.weight.dtype)
        if self.input_embedding_scale != 1.0:
            x = x * self.input_embedding_scale
        cos, sin = self.rotary.cos_sin(_text_positions(batch.positions), x.dtype)
        block = DraftBlock(batch, size, cache.page_size)
        for layer in self.layers:
            x = layer(x, cos, sin, block, cache)
        hidden = self.norm(x).view(b, size, -1)[:, 1:]
        return hidden, self.compute_logits(hidden.reshape(b * (size - 1), -1)).view(b, size - 1, -1)

    @torch.no_grad()
    def draft(self, batch: ForwardBatch, cache: ModelCache, first_tokens: torch.Tensor) -> torch.Tensor:
        """block_size-1 greedy drafts per sequence, [B, block_size-1] int64 on the device: argmax of
        each position (dflash) or the candidate selector's path from first_tokens (dflash2)."""
        hidden, logits = self.block_logits(batch, cache, first_tokens)
        if self.candidate_selector is None:
            return logits.argmax(-1)
        return self.candidate_selector.select(hidden, logits, first_tokens)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The trunk's lm_head, then the drafter's output_multiplier and final_logit_softcapping."""
        logits = self.trunk.compute_logits(hidden)
        if self.output_multiplier != 1.0:
            logits = logits * self.output_multiplier
        if self.softcap > 0:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    # -- weights ----------------------------------------------------------------------------------

    def fuse_projections_(self) -> int:
        return fuse_projections_(self)

    @torch.no_grad()
    def init_random_(self, seed: int) -> None:
        """Random weights in place: norms 1 (plain RMSNorm), everything else normal(0, 0.02)."""
        gen = torch.Generator(device=self.fc.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)


def check_dflash_weights(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Raise ValueError unless `tensors` are exactly the drafter's parameters at their shapes (the
    converter calls it, so a partial or mis-shaped drafter fails at conversion, not at load)."""
    with torch.device("meta"):
        module = DFlashDrafter(config)
    check_component_weights(module, tensors, f"{config.get('variant', 'dflash')} weights do not match the config")
