"""Test models. The scripted model emits a fixed token sequence after a trigger, so engine and
protocol tests can drive stops, thinking budgets, tool calls and channels deterministically; the
fixed-logits model (at the end) always emits one token at no cost.

It runs through the real engine path (paged cache, batching, sampling): the cache's K slots hold
the token ids themselves, so the model reads each sequence's context from its pages like any
other model. After the most recent occurrence of a script's trigger, output i of that script
is the next token; past the script's end it emits `eos`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ninfer.forward import CacheSpec, ForwardBatch, ModelCache
from ninfer.kernels.attention import sequence_slots, write_kv

_SCRIPTED_LOGIT = 100.0  # every other token is e^-100 less likely: sampling cannot stray


class ScriptedModel(nn.Module):
    def __init__(self, config: dict[str, Any]):
        super().__init__()
        self.vocab_size = int(config["vocab_size"])
        self.eos = int(config["eos"])
        self.scripts = [(tuple(s["trigger"]), list(s["output"])) for s in config["scripts"]]
        self.register_buffer("_anchor", torch.zeros(1), persistent=False)  # carries device/dtype

    def cache_spec(self) -> CacheSpec:
        return CacheSpec(num_attn_layers=1, num_kv_heads=1, head_dim=1)

    def init_random_(self, seed: int) -> None:
        """Nothing to initialise: the script is the model."""

    def _next_token(self, context: list[int]) -> int:
        """The script whose trigger occurred most recently (longest on ties) decides the next token."""
        best: tuple[int, int, list[int]] | None = None
        for trigger, output in self.scripts:
            n = len(trigger)
            end = next((e for e in range(len(context), n - 1, -1) if tuple(context[e - n : e]) == trigger), None)
            if end is not None and (best is None or (end, n) > best[:2]):
                best = (end, n, output)
        if best is None:
            return self.eos
        end, _, output = best
        produced = len(context) - end
        return output[produced] if produced < len(output) else self.eos

    def forward(self, batch: ForwardBatch, cache: ModelCache) -> torch.Tensor:
        ids = batch.input_ids.to(torch.float32)[:, None, None]
        write_kv(*cache.layer(0)[:2], ids, ids, batch.slot_mapping)  # unquantized KV only: ids are stored exactly
        hidden = torch.full((batch.input_ids.shape[0], 1), float(self.eos), device=batch.input_ids.device)
        start = 0
        for i, qlen in enumerate(batch.query_lens_cpu):
            slots = sequence_slots(batch, i, cache.page_size)
            context = [int(x) for x in cache.k[0][slots, 0, 0].tolist()]
            hidden[start + qlen - 1, 0] = float(self._next_token(context))
            start += qlen
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros((hidden.shape[0], self.vocab_size), device=hidden.device)
        logits.scatter_(1, hidden.long(), _SCRIPTED_LOGIT)
        return logits


class FixedLogitsModel(nn.Module):
    """A model that costs (almost) nothing: every sequence's next token is `token`. Engine scheduling
    tests and the engine host-overhead benchmark run on it, so only the engine's own work remains."""

    def __init__(self, vocab_size: int, token: int = 1000):
        super().__init__()
        self.vocab_size, self.token = vocab_size, token
        self.register_buffer("_anchor", torch.zeros(1), persistent=False)  # carries device/dtype

    def cache_spec(self) -> CacheSpec:
        return CacheSpec(num_attn_layers=1, num_kv_heads=1, head_dim=1)

    def forward(self, batch: ForwardBatch, cache: ModelCache) -> torch.Tensor:
        return torch.zeros(batch.input_ids.shape[0], 1, device=batch.input_ids.device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(hidden.shape[0], self.vocab_size, device=hidden.device)
        logits[:, self.token] = 1.0
        return logits
