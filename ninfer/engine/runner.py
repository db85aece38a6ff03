"""Turns scheduled sequences into tensors, runs one model traversal and samples on the device."""

from __future__ import annotations

import torch

from ninfer.engine.sampler import TOP_K_CAP, SamplingBatch, sample
from ninfer.engine.sequence import Sequence
from ninfer.models.batch import ForwardBatch, ModelCache


class ModelRunner:
    def __init__(self, model: torch.nn.Module, *, num_pages: int, page_size: int, num_state_slots: int,
                 num_lanes: int, vocab_size: int, device: torch.device, dtype: torch.dtype):
        self.model = model
        self.device = device
        self.page_size = page_size
        self.cache = ModelCache(model.cache_spec(), num_pages, page_size, num_state_slots, dtype, device)
        # generated-token counts per lane, for presence/frequency penalties
        self.counts = torch.zeros((num_lanes, vocab_size), dtype=torch.float32, device=device)
        self.vocab_size = vocab_size

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence], inputs: list[list[int]]) -> torch.Tensor:
        """Append inputs[i] to seqs[i]'s cache; returns float32 logits of each sequence's last new token."""
        batch = ForwardBatch.build(
            tokens=inputs,
            cached_lens=[s.num_computed for s in seqs],
            page_tables=[s.pages for s in seqs],
            page_size=self.page_size,
            state_slots=[s.state_slot if s.state_slot is not None else 0 for s in seqs],
            device=self.device,
        )
        hidden = self.model(batch, self.cache)
        return self.model.compute_logits(hidden[batch.last_token_indices()])

    def reset_lane(self, lane: int, output_ids: list[int]) -> None:
        """Start a lane's penalty counts over (from a restored request's committed output, if any)."""
        self.counts[lane].zero_()
        if output_ids:
            ids = torch.tensor(output_ids, dtype=torch.long, device=self.device)
            self.counts[lane].index_add_(0, ids, torch.ones(len(output_ids), device=self.device))

    def count_tokens(self, lanes: list[int], token_ids: torch.Tensor) -> None:
        lane_index = torch.tensor(lanes, dtype=torch.long, device=self.device)
        self.counts.index_put_((lane_index, token_ids), torch.ones_like(token_ids, dtype=torch.float32),
                               accumulate=True)

    @torch.inference_mode()
    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        def col(values, dtype):
            return torch.tensor(values, dtype=dtype, device=self.device)

        params = [s.sampling for s in seqs]
        batch = SamplingBatch(
            temperature=col([p.temperature for p in params], torch.float32),
            top_p=col([p.top_p for p in params], torch.float32),
            top_k=col([p.top_k if 0 < p.top_k <= TOP_K_CAP else TOP_K_CAP for p in params], torch.long),
            min_p=col([p.min_p for p in params], torch.float32),
            presence_penalty=col([p.presence_penalty for p in params], torch.float32),
            frequency_penalty=col([p.frequency_penalty for p in params], torch.float32),
            seed=col([p.seed for p in params], torch.long),
            step=col([len(s.output_ids) for s in seqs], torch.long),
        )
        lanes = [s.lane for s in seqs]
        width = min(self.vocab_size, logits.shape[1])  # drop padded embedding rows past the tokenizer
        counts = self.counts[torch.tensor(lanes, dtype=torch.long, device=self.device), :width]
        return sample(logits[:, :width], batch, counts)
