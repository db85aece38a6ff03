"""The Qwen3.5/3.6 multi-token-prediction (MTP) head: a one-layer drafter for speculative decoding.

Per qwen35-architecture.md section 4: for target position p, with h_p the trunk's hidden state
there (after the trunk's final norm, as the trunk's forward returns it and vLLM feeds it) and
t_{p+1} the token that follows,

    x   = fc([pre_fc_norm_embedding(embed(t_{p+1})) ; pre_fc_norm_hidden(h_p)])   (embedding first)
    out = norm(full-attention decoder layer(x))        at position p, in the head's own KV cache
    logits(t_{p+2}) = trunk lm_head(out)

The layer is the trunk's own full-attention `DecoderLayer` (gated attention + dense SwiGLU or the
MoE block), so the paged KV, the fused kernels and CUDA graphs work as in the trunk. The embedding,
lm_head and rotary tables are the trunk's (`mtp_use_dedicated_embeddings` is false in every
Qwen3.5/3.6 checkpoint): the head holds a reference to the trunk, not its weights, so its state
dict is exactly the checkpoint's `mtp.*` tensors.

Drafting k tokens (`propose`) reuses the same layer k times: step 0 reads the trunk's hidden
states, each later step the previous draft token and the head's own output (post `norm`), one
position further on.

What the head's KV holds, for whoever schedules it: the entry at KV index i is computed from the
trunk's hidden state at i AND token i+1. So it can be written only once token i+1 is known (a
prompt chunk's last row waits for the next chunk's first token, the prompt's last row for the
first sampled token), a reused prefix of L tokens brings valid head entries for 0..L-2 only (L-1
is rewritten with the new request's token L), and entries the chain wrote past the accepted
position are stale until the next step 0 rewrites them (nothing reads them before).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ninfer.forward import CacheSpec, DeviceOnlyLengths, ForwardBatch, ModelCache
from ninfer.models.layers import RMSNorm, check_component_weights, fuse_projections_
from ninfer.models.qwen3_5 import DecoderLayer

# Fields of the trunk's text config that shape the MTP layer (stored in the artifact's `mtp` component).
_LAYER_FIELDS = (
    "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "attention_bias",
    "intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size",
)


def mtp_config_from_text(text_config: dict[str, Any]) -> dict[str, Any]:
    """The `mtp` component config from the trunk's text config (HF field names): the layer's shape
    plus the MTP's own fields (HF's mtp_num_hidden_layers / mtp_use_dedicated_embeddings)."""
    cfg = {k: text_config[k] for k in _LAYER_FIELDS if text_config.get(k) is not None}
    cfg["num_hidden_layers"] = int(text_config.get("mtp_num_hidden_layers", 1))
    cfg["use_dedicated_embeddings"] = bool(text_config.get("mtp_use_dedicated_embeddings", False))
    return cfg


class MTPHead(nn.Module):
    """Parameter names are the checkpoint's minus `mtp.` (fc, pre_fc_norm_*, layers.0.*, norm).

    kv_layer: the attention-layer index of the head's KV in the ModelCache it is given: 0 for a
    cache of its own (`cache_spec()`), or trunk.num_attn_layers to ride as one more layer of the
    trunk's cache (`cache_spec(trunk_spec)`), sharing its pages, page table and slot mapping.
    """

    def __init__(self, config: dict[str, Any], kv_layer: int = 0):
        super().__init__()
        if config.get("num_hidden_layers", 1) != 1:  # every Qwen3.5/3.6 checkpoint has one
            raise ValueError(f"MTP heads of {config['num_hidden_layers']} layers are not supported (1 only)")
        if config.get("use_dedicated_embeddings"):
            raise ValueError("MTP heads with their own embeddings are not supported")
        self.config = dict(config)
        hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
        self.kv_layer = kv_layer
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps, zero_centered=True)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps, zero_centered=True)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(config, "full_attention", kv_layer)])
        self.norm = RMSNorm(hidden, eps, zero_centered=True)
        self._trunk: nn.Module | None = None

    # -- wiring -----------------------------------------------------------------------------------

    def attach_(self, trunk: nn.Module) -> "MTPHead":
        """Share the trunk's embedding, lm_head and rotary tables. Kept out of the module tree
        (object.__setattr__), so state_dict, .to() and fusion touch the head's own weights only."""
        if trunk.config["hidden_size"] != self.config["hidden_size"]:
            raise ValueError(f"MTP hidden size {self.config['hidden_size']} does not match the trunk's "
                             f"{trunk.config['hidden_size']}")
        object.__setattr__(self, "_trunk", trunk)
        return self

    @property
    def trunk(self) -> nn.Module:
        if self._trunk is None:
            raise RuntimeError("MTPHead has no trunk: call attach_(trunk) first")
        return self._trunk

    def cache_spec(self, trunk_spec: CacheSpec | None = None) -> CacheSpec:
        """The head's own KV (one attention layer, no recurrent state); with trunk_spec, the trunk's
        spec plus this layer (build the head with kv_layer=trunk_spec.num_attn_layers)."""
        c = self.config
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        if trunk_spec is None:
            return CacheSpec(num_attn_layers=1, num_kv_heads=c["num_key_value_heads"], head_dim=head_dim)
        if (trunk_spec.num_kv_heads, trunk_spec.head_dim) != (c["num_key_value_heads"], head_dim):
            raise ValueError("the MTP layer's KV shape differs from the trunk's: give it a cache of its own")
        return CacheSpec(**{**trunk_spec.__dict__, "num_attn_layers": trunk_spec.num_attn_layers + 1})

    # -- one step ---------------------------------------------------------------------------------

    def forward(self, batch: ForwardBatch, cache: ModelCache, input_ids: torch.Tensor, hidden: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """One MTP step over a ragged batch. Row i pairs input_ids[i] (the token AFTER the trunk
        position of row i) with hidden[i] (the trunk's post-final-norm hidden state at that position,
        or the head's own previous output when chaining). batch gives that position's rope position,
        KV slot and attention context (its input_ids are not read: they are the trunk's, one behind).
        inputs_embeds [T, H] replaces the embedding lookup (media spans). Returns [T, H] after `norm`:
        feed to compute_logits, or back in as the next step's hidden."""
        trunk = self.trunk
        e = inputs_embeds if inputs_embeds is not None else trunk.embed_tokens(input_ids)
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(hidden.to(e.dtype))], dim=-1))
        cos, sin = trunk.rotary.cos_sin(batch.positions, x.dtype)
        x, residual = self.layers[0](x, None, cos, sin, batch, cache, None)  # attention: no GDN metadata
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.trunk.compute_logits(hidden)

    # -- k drafts ---------------------------------------------------------------------------------

    @torch.no_grad()
    def propose(self, batch: ForwardBatch, cache: ModelCache, input_ids: torch.Tensor, hidden: torch.Tensor,
                k: int, logits_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """k greedy drafts per sequence, [B, k] int64 on the device.

        Step 0 runs `forward` over `batch` (ragged: the positions whose trunk hidden states are new
        since the last round - the whole prompt after prefill, the accepted tokens plus the bonus
        after a verification; this rewrites the head's KV at those positions, where the last round's
        chain had written entries from its own hidden states). Its last row per sequence gives
        draft 1. Steps 1..k-1 are decode-shaped: one token per sequence (the previous draft, with the
        previous step's output as hidden), one position further on (`chain_batch`). Everything stays
        on the device (argmax, positions, slots): no host sync, and steps 1..k-1 are capturable as
        one CUDA graph per batch size. The page table must cover positions up to seq_len + k - 2
        (the next verification's window does). logits_fn: the proposal head (default the trunk's
        lm_head; --lm-head-draft supplies a cheaper one).
        """
        logits_fn = logits_fn or self.compute_logits
        out = self(batch, cache, input_ids, hidden, inputs_embeds)
        h = out[batch.last_token_indices()]
        drafts = [logits_fn(h).argmax(-1)]
        step = batch
        for _ in range(k - 1):
            step = chain_batch(step, cache.page_size)
            h = self(step, cache, drafts[-1], h)
            drafts.append(logits_fn(h).argmax(-1))
        return torch.stack(drafts, dim=1)

    # -- weights ----------------------------------------------------------------------------------

    def fuse_projections_(self) -> int:
        return fuse_projections_(self)

    @torch.no_grad()
    def init_random_(self, seed: int) -> None:
        """Random weights at the trunk's scales (Qwen3_5ForCausalLM.init_random_): zero-centred norms 0,
        everything else normal(0, 0.02); in place on the parameters' device."""
        gen = torch.Generator(device=self.fc.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)


def chain_batch(batch: ForwardBatch, page_size: int) -> ForwardBatch:
    """The decode step right after `batch`'s last token of each sequence: one token per sequence at
    the next position and KV index, same pages. Device ops only (the host lengths are known: +1)."""
    if batch.num_valid is not None:  # its real length is on the device only
        raise ValueError("chain_batch needs an unpadded batch")
    lens = batch.seq_lens_cpu  # a CUDA graph's batch knows them on the device only
    host_lens = lens if isinstance(lens, DeviceOnlyLengths) else [n + 1 for n in lens]
    last = batch.last_token_indices()
    num_seqs = batch.num_seqs
    device = batch.seq_lens.device
    seq_lens = batch.seq_lens + 1
    index = seq_lens.long() - 1  # KV index of the new token (not its rope position: media compress those)
    seqs = torch.arange(num_seqs, device=device)
    slots = batch.page_table[seqs, index // page_size].long() * page_size + index % page_size
    return ForwardBatch(
        input_ids=batch.input_ids[last],  # not read by the head; kept the right shape
        positions=batch.positions[..., last] + 1,  # every mRoPE axis advances by one for text
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=device),
        seq_lens=seq_lens,
        page_table=batch.page_table,
        slot_mapping=slots,
        state_slots=batch.state_slots,
        query_lens_cpu=[1] * num_seqs,
        seq_lens_cpu=host_lens,
    )


def check_mtp_weights(config: dict[str, Any], tensors: dict[str, torch.Tensor], nvfp4_modules=()) -> None:
    """Raise ValueError unless `tensors` are exactly the head's parameters at their shapes, the linears
    named in `nvfp4_modules` as NVFP4 tensors (the converter calls it, so a partial or mis-shaped head
    fails at conversion, not at load)."""
    with torch.device("meta"):
        module = MTPHead(config)
    if nvfp4_modules:
        from ninfer.quant.nvfp4 import replace_with_nvfp4_

        replace_with_nvfp4_(module, nvfp4_modules)
    check_component_weights(module, tensors, "MTP weights do not match the text config")
