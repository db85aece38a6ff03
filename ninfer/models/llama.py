"""Llama-family causal LM (Llama 2/3, Mistral-style dense models, SmolLM2) on the paged KV cache.

Config keys are HF LlamaConfig field names; module names mirror HF without the `model.` prefix,
so an HF checkpoint maps onto this module by `hf_to_artifact_name`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ninfer.forward import CacheSpec, ForwardBatch, ModelCache
from ninfer.kernels import fused
from ninfer.kernels.attention import cpu_decode_batch, paged_attention
from ninfer.kernels.linear import linear
from ninfer.models.layers import RMSNorm, RotaryEmbedding, SwiGLU, fuse_projections_, project
from ninfer.models.llama_cpu import DecodePlan
from ninfer.quant.nvfp4 import NVFP4Linear, nvfp4_head_logits

# HF LlamaConfig defaults, for configs that leave a field out.
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "max_position_embeddings": 2048,
}
_CONFIG_KEYS = (*_DEFAULTS, "num_key_value_heads", "head_dim", "rope_parameters")


def _full_config(config: dict[str, Any]) -> dict[str, Any]:
    """Fill defaults and normalise RoPE into one `rope_parameters` dict (HF's newer form)."""
    cfg = {**_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    rope = dict(cfg.get("rope_parameters") or config.get("rope_scaling") or {})
    rope["rope_type"] = rope.get("rope_type", rope.pop("type", "default"))
    rope.setdefault("rope_theta", cfg["rope_theta"])
    if rope["rope_type"] == "llama3":
        rope.setdefault("original_max_position_embeddings", cfg["max_position_embeddings"])
    cfg["rope_parameters"] = rope
    cfg["rope_theta"] = rope["rope_theta"]
    if cfg.get("mlp_bias") or cfg.get("hidden_act", "silu") != "silu":
        raise ValueError("llama: only bias-free SiLU MLPs are supported (mlp_bias=False, hidden_act=silu)")
    return cfg


def rope_inv_freq(head_dim: int, rope: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies for rope_type default or llama3, computed as transformers does (fp32)."""
    base = float(rope["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    kind = rope["rope_type"]
    if kind == "default":
        return inv_freq
    if kind != "llama3":
        raise ValueError(f"llama: rope_type {kind!r} is not supported (default, llama3)")
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between blended.
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class LlamaAttention(nn.Module):
    FUSE = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, cfg: dict[str, Any], layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg["num_key_value_heads"]
        self.head_dim = cfg["head_dim"]
        self.scale = self.head_dim**-0.5
        hidden, bias = cfg["hidden_size"], cfg["attention_bias"]
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, cache: ModelCache,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = project(self, ("q_proj", "k_proj", "v_proj"), x)
        k_cache, v_cache, k_scale, v_scale = cache.layer(self.layer_idx)
        # RoPE on q and k, k and v into the cache: one kernel (views of the merged projection)
        q = fused.rope_qk_write_kv(
            q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim),
            v.view(t, self.num_kv_heads, self.head_dim), cos, sin, k_cache, v_cache, batch.slot_mapping,
            k_scale=k_scale, v_scale=v_scale)
        out = paged_attention(q, k_cache, v_cache, batch, cache.page_size, self.scale, k_scale, v_scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.mlp = SwiGLU(cfg["hidden_size"], cfg["intermediate_size"])
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
        batch: ForwardBatch, cache: ModelCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (or the embeddings, residual None); the hidden state is
        residual + x. Returns (this layer's MLP output, residual): each residual add runs fused with
        the norm after it. Same order of additions as transformers, so float32 results agree to rounding."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, batch, cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: dict[str, Any]):
        super().__init__()
        cfg = _full_config(config)
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.tie_word_embeddings = bool(cfg["tie_word_embeddings"])
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        inv_freq = rope_inv_freq(cfg["head_dim"], cfg["rope_parameters"])
        self.rotary = RotaryEmbedding(cfg["head_dim"], cfg["rope_theta"], inv_freq=inv_freq)

    def _apply(self, fn, recurse=True):
        # RoPE frequencies stay fp32 when the model is cast (bf16 would garble long positions):
        # recompute them (tiny) on wherever the buffer went; also right after meta -> to_empty.
        super()._apply(fn, recurse)
        self.__dict__.pop("_decode_plan", None)  # it holds the old tensors
        device = self.rotary.inv_freq.device
        self.rotary.inv_freq = rope_inv_freq(self.config["head_dim"], self.config["rope_parameters"]).to(device)
        return self

    @property
    def output_weight(self) -> torch.Tensor:
        """The bf16 head weight; an NVFP4 lm_head has none (compute_logits calls the module)."""
        if isinstance(getattr(self, "lm_head", None), NVFP4Linear):
            raise TypeError("lm_head is NVFP4: it has no bf16 weight, call compute_logits")
        return self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def cache_spec(self) -> CacheSpec:
        cfg = self.config
        return CacheSpec(
            num_attn_layers=cfg["num_hidden_layers"], num_kv_heads=cfg["num_key_value_heads"],
            head_dim=cfg["head_dim"],
        )

    def forward(self, batch: ForwardBatch, cache: ModelCache) -> torch.Tensor:
        """Run the batch's new tokens through the model; returns final-normed hidden states [T, H]."""
        dtype = self.embed_tokens.weight.dtype
        if batch.inputs_embeds is not None:
            x = batch.inputs_embeds.to(dtype)
        else:
            x = self.embed_tokens(batch.input_ids)
        positions = batch.positions if batch.positions.dim() == 1 else batch.positions[0]
        if cpu_decode_batch(batch, x):
            plan = self.decode_plan()
            if plan is not None and plan.takes(cache):
                return plan.run(x, positions, self.rotary, batch, cache)
        cos, sin = self.rotary.cos_sin(positions, dtype)  # once per step, shared by all layers
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, batch, cache)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

    def fuse_projections_(self) -> int:
        """Merge q/k/v and gate/up into one matmul each (call after loading weights; idempotent).
        The state dict keeps the checkpoint's separate names."""
        self.__dict__.pop("_decode_plan", None)
        return fuse_projections_(self)

    def decode_plan(self) -> DecodePlan | None:
        """The CPU decode loop over the current modules (ninfer.models.llama_cpu), built on first use; None
        where it does not apply. Whatever replaces modules or tensors afterwards drops it (`_apply`,
        `fuse_projections_`, `quant.int8_cpu.quantize_model_int8_`)."""
        plan = self.__dict__.get("_decode_plan")
        if plan is None:
            plan = self.__dict__["_decode_plan"] = DecodePlan.build(self) or False
        return plan or None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if getattr(self, "int8_logits", None) is not None:  # --dtype int8 on the CPU (quant.int8_cpu)
            return self.int8_logits.logits(hidden)
        if isinstance(getattr(self, "lm_head", None), NVFP4Linear):  # opt-in quantized head: its own GEMV
            return nvfp4_head_logits(self.lm_head, hidden)
        return linear(hidden, self.output_weight).float()  # the decode GEMV kernel on CUDA for small batches

    @torch.no_grad()
    def init_random_(self, seed: int) -> None:
        """Deterministic random weights in place (on whatever device the parameters live)."""
        generators: dict[torch.device, torch.Generator] = {}
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.weight.fill_(0.0 if module.zero_centered else 1.0)
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                w = module.weight
                if w.device not in generators:
                    generators[w.device] = torch.Generator(device=w.device).manual_seed(seed)
                w.normal_(0.0, 0.02, generator=generators[w.device])
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()


def hf_to_artifact_name(name: str) -> str | None:
    """HF checkpoint tensor name -> name in our `text` component; None for tensors we do not keep.

    `lm_head.weight` maps through unchanged: callers drop it when the config ties embeddings.
    """
    if "rotary_emb" in name:  # inv_freq buffers some checkpoints still carry
        return None
    if name.startswith("model."):
        return name[len("model."):]
    if name.startswith("lm_head."):
        return name
    return None


def text_config_from_hf(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Our text-component config from an HF config.json dict (fields we use, defaults filled)."""
    hf = hf_config.get("text_config") or hf_config
    cfg = _full_config({k: hf[k] for k in (*_CONFIG_KEYS, "rope_scaling", "mlp_bias", "hidden_act") if k in hf})
    return {k: cfg[k] for k in _CONFIG_KEYS}
