"""The DFlash / DFlash2 proposer: drafts for every speculating decode row from a block drafter.

The drafter (ninfer.models.dflash) reads the target's hidden states after its chosen layers: the
runner hands those over instead of the final ones (ModelRunner feature_layers), for every prefill
token and every committed verify row. Per step, two halves:
- `observe` (after the step's tokens are committed): the drafter's context K/V of every position the
  target newly computed, written at the sequence's own KV slots in the drafter's cache;
- `propose` (before the next verify forward): one block forward per batch, [last committed token,
  mask, ...] at the positions after the frontier, whose argmax (DFlash) or selected path (DFlash2)
  gives block_size - 1 drafts, cut to each row's budget, left on the device (speculative.stage_drafts).

The drafter's cache has the target cache's page geometry (a position's context entry lives at the
same slot as its target KV) plus a few scratch pages per lane: a block reaches block_size - 1
positions past the frontier, further than the pages the scheduler reserves for the verify window,
so the block's page table continues into its lane's scratch pages. Its pages travel with the target's
(`companion_caches`: the engine's page copies, pause snapshots and restores move them too), and a
reused prefix's shared pages hold the entries of the request that computed them, at the same positions.
Drafts are greedy, so acceptance is the lossless rule (ninfer.engine.speculative).
"""

from __future__ import annotations

import torch

from ninfer.engine.plan import RunnerOutput, SeqWork, StepPlan
from ninfer.engine.sequence import Sequence
from ninfer.engine.speculative import computed_rows, speculates, stage_drafts, unzip_rows, upload_batch
from ninfer.forward import CacheSpec, ForwardBatch, ModelCache


class DFlashProposer:
    wants_prefill_hidden = True

    def __init__(self, drafter: torch.nn.Module):
        """drafter: a DFlashDrafter attached to the trunk (its own KV: cache_spec() without the trunk's)."""
        self.drafter = drafter
        self.name = drafter.variant
        self.feature_layers = tuple(drafter.target_layer_ids)
        self.max_drafts = drafter.block_size - 1
        self.runner = None
        self.cache: ModelCache | None = None
        self._frontier: dict[str, int] = {}  # request id -> positions whose context entries are written

    def bind(self, runner) -> None:
        """Allocate the drafter's cache beside the runner's: its pages, then each lane's scratch pages."""
        self.runner = runner
        trunk = runner.cache
        self.scratch_pages = -(-self.drafter.block_size // trunk.page_size) + 1
        self.scratch_base = trunk.num_pages
        lanes = runner.counts.shape[0]
        self.cache = ModelCache(self.drafter.cache_spec(), trunk.num_pages + lanes * self.scratch_pages,
                                trunk.page_size, 0, self.drafter.fc.weight.dtype, runner.device)

    def companion_caches(self) -> list[ModelCache]:
        """Caches numbered like the target's pages, whose pages move with them (ninfer.engine.context_ops)."""
        return [self.cache]

    def forget(self, seq: Sequence, retained: bool = False) -> None:
        """Drop a finished sequence (its context entries are written as its steps commit, retained or not)."""
        self._frontier.pop(seq.request_id, None)

    @torch.inference_mode()
    def observe(self, plan: StepPlan, output: RunnerOutput, committed: dict[int, int]) -> None:
        rows = computed_rows(plan, output, committed)
        if not rows:
            return
        runner = self.runner
        seqs, starts, lens, features = unzip_rows(rows)
        batch = upload_batch(ForwardBatch.build([s.tokens(p, p + n) for s, p, n in zip(seqs, starts, lens)], starts,
                                                [s.pages for s in seqs], runner.page_size, device="cpu",
                                                positions=[s.positions(p, p + n) for s, p, n in zip(seqs, starts, lens)]),
                             runner)
        self.drafter.context_kv(batch, self.cache, features)
        for seq, p, n in zip(seqs, starts, lens):  # below p: written before, or stale (reused prefix)
            self._frontier[seq.request_id] = p + n

    @torch.inference_mode()
    def propose(self, works: list[SeqWork], budgets: list[int]) -> None:
        ready = [(w, b) for w, b in zip(works, budgets)
                 if speculates(w.seq) and self._frontier.get(w.seq.request_id) == w.seq.num_computed]
        if not ready:
            return
        runner, size = self.runner, self.drafter.block_size
        seqs = [w.seq for w, _ in ready]
        tables = [self._block_pages(s) for s in seqs]
        starts = [s.num_computed for s in seqs]
        batch = upload_batch(ForwardBatch.build([[0] * size] * len(seqs), starts, tables, runner.page_size,
                                                device="cpu",
                                                positions=[s.positions(p, p + size) for s, p in zip(seqs, starts)]),
                             runner)
        first = runner._tensor([s.output_ids[-1] for s in seqs], torch.long)
        table = self.drafter.draft(batch, self.cache, first)  # read back with the verify's sampled tokens
        stage_drafts([w for w, _ in ready], [b for _, b in ready], table)

    def _block_pages(self, seq: Sequence) -> list[int]:
        """The sequence's pages, then its lane's scratch pages, as far as the block reaches."""
        page = self.runner.page_size
        needed = -(-(seq.num_computed + self.drafter.block_size) // page)
        lane = seq.lane or 0
        scratch = list(range(self.scratch_base + lane * self.scratch_pages,
                             self.scratch_base + (lane + 1) * self.scratch_pages))
        return (list(seq.pages) + scratch)[:max(needed, len(seq.pages))]

    def cache_spec(self, trunk_spec: CacheSpec) -> CacheSpec:
        """The target's cache as it is: the drafter keeps its own."""
        return trunk_spec
