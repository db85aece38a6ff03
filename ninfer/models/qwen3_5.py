"""Qwen3.5 / Qwen3.6 text model (dense `qwen3_5` and MoE `qwen3_5_moe`) over a ragged batch.

Hybrid stack: three Gated DeltaNet layers (recurrent state in ModelCache slots) then one gated
full-attention layer (paged KV), repeated. Parameter names are the HF checkpoint's minus the
`model.` / `model.language_model.` prefix, so a checkpoint loads by renaming alone
(`hf_to_artifact_name`). Numerics follow transformers' Qwen3_5* classes
(qwen35-architecture.md sections 1 and 9); the GDN math lives in ninfer.kernels.gdn.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ninfer.forward import CacheSpec, ForwardBatch, ModelCache
from ninfer.kernels import fused
from ninfer.kernels.attention import paged_attention
from ninfer.kernels.gdn import GDNGates, GDNMetadata, gated_delta_rule, short_conv, takes_raw_gates
from ninfer.kernels.linear import linear
from ninfer.models.layers import RMSNorm, RotaryEmbedding, SwiGLU, fuse_projections_, project
from ninfer.models.moe import SparseMoeBlock
from ninfer.quant.nvfp4 import NVFP4Linear, nvfp4_head_logits

_ROPE_QWEN3_6 = {
    "rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
    "mrope_section": [11, 11, 10], "mrope_interleaved": True,
}
_COMMON_QWEN3_6 = {
    "vocab_size": 248320, "head_dim": 256, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "attention_bias": False, "max_position_embeddings": 262144,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "full_attention_interval": 4, "eos_token_id": 248044, "rope_parameters": _ROPE_QWEN3_6,
}


def _layer_types(num_layers: int, interval: int = 4) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


def _shape(**fields: Any) -> dict[str, Any]:
    cfg = copy.deepcopy(_COMMON_QWEN3_6) | fields
    cfg["layer_types"] = _layer_types(cfg["num_hidden_layers"], cfg["full_attention_interval"])
    return cfg


_TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
    linear_value_head_dim=32, max_position_embeddings=4096,
    rope_parameters=_ROPE_QWEN3_6 | {"mrope_section": [3, 3, 2]},  # rotary dim 16 = 8 frequencies
)
_TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)

# HF-style text configs (Qwen3_5TextConfig / Qwen3_5MoeTextConfig field names).
QWEN3_6_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3.6-27b": _shape(
        model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
        num_attention_heads=24, num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=48,
    ),
    "qwen3.6-35b-a3b": _shape(
        model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
        num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=32, num_experts=256,
        num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    ),
    "tiny-qwen3.6": _shape(model_type="qwen3_5_text", **_TINY),
    "tiny-qwen3.6-moe": _shape(model_type="qwen3_5_moe_text", **(_TINY | _TINY_MOE)),
}


# ---------------------------------------------------------------------------------------------
# Checkpoint / config mapping


def hf_to_artifact_name(name: str) -> tuple[str, str] | None:
    """HF checkpoint tensor name -> (component, name in component); None for names we do not keep.

    Accepts the VLM layout (`model.language_model.*`, `lm_head.weight`, `mtp.*`, `model.visual.*`)
    and the text-only layout (`model.*`).
    """
    for prefix, component in (
        ("model.language_model.", "text"), ("model.visual.", "vision"), ("mtp.", "mtp"), ("model.", "text"),
    ):
        if name.startswith(prefix):
            rest = name[len(prefix):]
            return None if rest.startswith("rotary_emb.") else (component, rest)
    if name.startswith("lm_head."):
        return "text", name
    return None


def text_config_from_hf(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The text config (HF field names) from a VLM config with `text_config` nested, or a text config.

    Fills what older or partial configs leave implicit: layer_types from full_attention_interval,
    and rope fields given at top level folded into rope_parameters.
    """
    cfg = copy.deepcopy(hf_config.get("text_config") or hf_config)
    if "tie_word_embeddings" not in cfg and "tie_word_embeddings" in hf_config:
        cfg["tie_word_embeddings"] = hf_config["tie_word_embeddings"]  # VLM configs carry it at top level
    if not cfg.get("layer_types"):
        cfg["layer_types"] = _layer_types(cfg["num_hidden_layers"], cfg.get("full_attention_interval", 4))
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    for key in ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"):
        if key not in rope and key in cfg:
            rope[key] = cfg[key]
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope.setdefault("rope_theta", 10_000.0)
    rope.setdefault("partial_rotary_factor", 0.25)
    cfg["rope_parameters"] = rope
    return cfg


# ---------------------------------------------------------------------------------------------
# Layers


class GatedRMSNorm(nn.Module):
    """GDN output norm, in HF's order: normalise in fp32, back to the input dtype, * w, * silu(z fp32).

    Not zero-centred (weights initialised at 1).
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return fused.gated_rms_norm(x, z, self.weight, self.eps)


_GDN_PROJ = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


class GatedDeltaNet(nn.Module):
    FUSE = {"in_proj_qkvzba": _GDN_PROJ}  # after fuse_projections_: one matmul, columns [qkv | z | b | a]

    def __init__(self, cfg: dict[str, Any], state_index: int):
        super().__init__()
        hidden = cfg["hidden_size"]
        self.state_index = state_index
        self.nk, self.nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        self.dk, self.dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        kernel = cfg.get("linear_conv_kernel_dim", 4)
        # qkv rows are all q heads, then all k heads, then all v heads (not Qwen3-Next's per-group interleave)
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.nv, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.nv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel, groups=self.conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.norm = GatedRMSNorm(self.dv, cfg.get("rms_norm_eps", 1e-6))
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cache: ModelCache, meta: GDNMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        # column views of one matmul once fused: each consumer reads its slice in place (no copies)
        # b, a: possibly the skinny GEMM's partial sums, which the recurrent kernel reduces itself (one launch fewer)
        split = ("in_proj_b", "in_proj_a") if takes_raw_gates(x, meta) else ()
        qkv, z, b, a = project(self, _GDN_PROJ, x, split_sums=split)
        qkv = short_conv(qkv, self.conv1d.weight, cache.conv[self.state_index], meta)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        out = gated_delta_rule(
            q.reshape(tokens, self.nk, self.dk), k.reshape(tokens, self.nk, self.dk),
            v.reshape(tokens, self.nv, self.dv), GDNGates(b, a, self.A_log, self.dt_bias), cache.ssm[self.state_index],
            meta,
        )
        out = self.norm(out, z.reshape(tokens, self.nv, self.dv))
        return self.out_proj(out.reshape(tokens, self.value_dim))


class GatedAttention(nn.Module):
    """Full attention with an output gate: q_proj yields [query | gate] per head."""

    FUSE = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, cfg: dict[str, Any], attn_index: int):
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.attn_index = attn_index
        self.num_heads, self.num_kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = cfg.get("head_dim") or hidden // self.num_heads
        self.scale = self.head_dim**-0.5
        bias = cfg.get("attention_bias", False)
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps, zero_centered=True)
        self.k_norm = RMSNorm(self.head_dim, eps, zero_centered=True)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, cache: ModelCache,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        qg, k, v = project(self, ("q_proj", "k_proj", "v_proj"), x)
        q, gate = qg.view(tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k_cache, v_cache, k_scale, v_scale = cache.layer(self.attn_index)
        # q/k norms, partial RoPE, and k, v into the cache: one kernel reading the projection in place
        q = fused.rope_qk_write_kv(
            q, k.view(tokens, self.num_kv_heads, self.head_dim), v.view(tokens, self.num_kv_heads, self.head_dim),
            cos, sin, k_cache, v_cache, batch.slot_mapping, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
            k_scale, v_scale,
        )
        out = paged_attention(q, k_cache, v_cache, batch, cache.page_size, self.scale, k_scale, v_scale)
        return self.o_proj(fused.sigmoid_gate_mul(out.reshape(tokens, self.num_heads, self.head_dim), gate))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], layer_type: str, cache_index: int):
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.is_attention = layer_type == "full_attention"
        if self.is_attention:
            self.self_attn = GatedAttention(cfg, cache_index)
        else:
            self.linear_attn = GatedDeltaNet(cfg, cache_index)
        if cfg.get("num_experts"):
            self.mlp = SparseMoeBlock(cfg)
        else:
            self.mlp = SwiGLU(cfg["hidden_size"], cfg["intermediate_size"])
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps, zero_centered=True)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps, zero_centered=True)

    def forward(self, x, residual, cos, sin, batch: ForwardBatch, cache: ModelCache, meta: GDNMetadata):
        """x: the previous layer's MLP output (or the embeddings, residual None); the hidden state is
        residual + x. Returns (this layer's MLP output, residual): each residual add runs fused with
        the norm after it (same additions, same order as before)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        if self.is_attention:
            h = self.self_attn(h, cos, sin, batch, cache)
        else:
            h = self.linear_attn(h, cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


# ---------------------------------------------------------------------------------------------
# Model


class Qwen3_5ForCausalLM(nn.Module):
    def __init__(self, config: dict[str, Any]):
        super().__init__()
        cfg = text_config_from_hf(config)
        self.config = cfg
        hidden = cfg["hidden_size"]
        self.layer_types = list(cfg["layer_types"])
        attn_idx, state_idx = 0, 0
        layers = []
        for layer_type in self.layer_types:
            if layer_type == "full_attention":
                layers.append(DecoderLayer(cfg, layer_type, attn_idx))
                attn_idx += 1
            else:
                layers.append(DecoderLayer(cfg, layer_type, state_idx))
                state_idx += 1
        self.num_attn_layers, self.num_state_layers = attn_idx, state_idx
        self.capture_layers: tuple[int, ...] = ()  # forward keeps these layers' outputs in `captured`
        self.captured: torch.Tensor | None = None
        # a piecewise CUDA-graph capture (ninfer.engine.graphs.capture's split): forward calls graph_cut()
        # after each of these layers
        self.graph_cuts: frozenset[int] = frozenset()
        self.graph_cut = None
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], hidden)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden, cfg.get("rms_norm_eps", 1e-6), zero_centered=True)
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(hidden, cfg["vocab_size"], bias=False)

        rope = cfg["rope_parameters"]
        head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
        self.rotary = RotaryEmbedding(
            int(head_dim * rope.get("partial_rotary_factor", 0.25)), rope["rope_theta"],
            mrope_section=rope.get("mrope_section", [11, 11, 10]),
            # transformers interleaves for this family whatever the config's flag says
            mrope_interleaved=True,
        )

    def cache_spec(self) -> CacheSpec:
        c = self.config
        return CacheSpec(
            num_attn_layers=self.num_attn_layers,
            num_kv_heads=c["num_key_value_heads"],
            head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
            num_state_layers=self.num_state_layers,
            conv_dim=2 * c["linear_num_key_heads"] * c["linear_key_head_dim"]
            + c["linear_num_value_heads"] * c["linear_value_head_dim"],
            conv_width=c.get("linear_conv_kernel_dim", 4) - 1,
            ssm_heads=c["linear_num_value_heads"],
            ssm_key_dim=c["linear_key_head_dim"],
            ssm_value_dim=c["linear_value_head_dim"],
        )

    def forward(self, batch: ForwardBatch, cache: ModelCache) -> torch.Tensor:
        """Hidden states [T, H] of every new token, after the final norm. With `capture_layers` set (a block
        drafter's target layers), `captured` then holds [T, len * H]: the output of each of those decoder
        layers (HF output_hidden_states index id + 1, before the final norm), concatenated in order."""
        x = batch.inputs_embeds if batch.inputs_embeds is not None else self.embed_tokens(batch.input_ids)
        cos, sin = self.rotary.cos_sin(batch.positions, x.dtype)
        meta = GDNMetadata.from_batch(batch)
        residual, captured = None, []
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, batch, cache, meta)
            if i in self.capture_layers:
                captured.append(residual + x)  # the hidden state the next layer's norm reads
            if i in self.graph_cuts:
                self.graph_cut()
        self.captured = torch.cat(captured, dim=-1) if captured else None
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

    def fuse_projections_(self) -> int:
        """Merge the projections that read one input into one matmul each (call after loading weights;
        idempotent): attention q/k/v; GDN qkv/z/b/a; MLP gate/up; MoE router, shared-expert gate and
        shared gate/up. The state dict keeps the checkpoint's separate names."""
        return fuse_projections_(self)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if getattr(self, "int8_logits", None) is not None:  # --dtype int8 on the CPU (quant.int8_cpu)
            return self.int8_logits.logits(hidden)
        if isinstance(self.lm_head, NVFP4Linear):  # opt-in quantized head: no bf16 weight, its own GEMV
            return nvfp4_head_logits(self.lm_head, hidden)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight).float()  # the decode GEMV kernel on CUDA for small batches

    @torch.no_grad()
    def init_random_(self, seed: int) -> None:
        """Deterministic random weights at realistic scales, in place on the parameters' device and dtype.

        Linears, embeddings, experts, router, conv: normal(0, 0.02); zero-centred norms 0; gated
        norm 1; A_log = log(uniform(1, 16)); dt_bias 1 (as transformers initialises it). In-place
        generator calls only: no CPU round trip, no full-size temporaries.
        """
        generators: dict[torch.device, torch.Generator] = {}

        def gen(p: torch.Tensor) -> torch.Generator:
            if p.device not in generators:
                generators[p.device] = torch.Generator(device=p.device).manual_seed(seed)
            return generators[p.device]

        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("linear_attn.norm.weight"):
                p.fill_(1.0)
            elif name.endswith("norm.weight"):  # input/post/q/k/final norms: zero-centred
                p.zero_()
            elif leaf == "A_log":
                p.uniform_(1.0, 16.0, generator=gen(p)).log_()
            elif leaf == "dt_bias":
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen(p))
