"""Speculative decoding: proposers fill a decode row's drafts, one target traversal verifies them.

A decode row carries the last committed token and up to k drafts; the target computes k+1 logit rows
in one forward (ModelRunner.execute) and samples each row as it would without speculation (greedy:
the argmax; seeded rows use their own output positions). `accepted_prefix` keeps the drafts the
target agrees with, and the row commits them plus the target's token after them (the bonus), so
greedy output is the same token for token. The runner then rolls recurrent state back to the last
committed position (ModelRunner.rollback) and the KV written for rejected positions is rewritten by
later steps (those slots lie past the computed frontier, so nothing reads them first).

Sampled rows speculate too. Each verify row is sampled as plain decoding would sample that output
position (the same transformed distribution, the same counter-based noise keyed by seed and output
index), and a draft stands only where it equals that sample. Every drafter here proposes greedily (a
point mass), and for a point-mass proposal q this is exactly lossless rejection sampling: draft d is
accepted with probability p(d), and a rejection leaves the target's sample, distributed as p without
d, renormalised (= max(p - q, 0), normalised). So the committed tokens are the target's own samples:
with exact verification, seeded output is identical with and without drafts.

Penalized rows (presence/frequency) speculate as well: each verify position's penalty counts the
row's committed tokens plus the drafts before that position in its window (ModelRunner._window_counts),
which is what plain decoding counts at that output position whenever the drafts stand. Rows inside a
forced thinking-budget suffix do not speculate (the suffix is known; nothing is sampled).
"""

from __future__ import annotations

import hashlib
from typing import Protocol

from ninfer.engine.plan import RunnerOutput, SeqWork, StepPlan
from ninfer.engine.sequence import Sequence, Status


class Proposer(Protocol):
    """Fills `work.draft_ids` (at most `budget` ids each) for the given decode works."""

    def propose(self, works: list[SeqWork], budgets: list[int]) -> None: ...


def speculates(seq: Sequence) -> bool:
    """Whether this row may carry drafts (the module docstring says why the others do not)."""
    return not seq.forced


def computed_rows(plan: StepPlan, output: RunnerOutput, committed: dict[int, int]) -> list[tuple[Sequence, int, object]]:
    """What a step newly put in the target's cache, for drafters that follow it: (sequence, first position,
    hidden rows [n, ...]) for the prefill chunk (every token) and each decode row (its committed tokens);
    finished requests left out."""
    rows = []
    if plan.prefill is not None and output.prefill_hidden is not None and plan.prefill.seq.status is not Status.FINISHED:
        rows.append((plan.prefill.seq, plan.prefill.start, output.prefill_hidden))
    offset = len(plan.works) - len(plan.decode)
    for i, work in enumerate(plan.decode):
        c = committed.get(id(work.seq), 0)
        if c and work.seq.status is not Status.FINISHED and output.hidden is not None:
            rows.append((work.seq, work.start, output.hidden[offset + i][:c]))
    return rows


def unzip_rows(rows) -> tuple[list[Sequence], list[int], list[int], object]:
    """computed_rows' rows as (sequences, first positions, row counts, every row's hidden state concatenated)."""
    import torch

    hidden = torch.cat([h for _, _, h in rows]) if len(rows) > 1 else rows[0][2]
    return [s for s, _, _ in rows], [p for _, p, _ in rows], [h.shape[0] for _, _, h in rows], hidden


def upload_batch(batch, runner):
    """A host-built ForwardBatch's tensors on the runner's device (pinned, non-blocking)."""
    for name in ("input_ids", "positions", "query_start_loc", "seq_lens", "page_table", "slot_mapping", "state_slots"):
        setattr(batch, name, runner._upload(getattr(batch, name)))
    return batch


def stage_drafts(works: list[SeqWork], budgets: list[int], table, rows: list[int] | None = None) -> None:
    """Give works[i] the first budgets[i] drafts of table[rows[i]] (a [R, k] int64 tensor, on the device;
    rows default 0..) without reading them back: the verify forward copies them into its input ids on the
    device, and its one read back brings them to the host with the sampled tokens (ModelRunner.collect).
    So a round synchronizes once, and the host prepares and launches the verify while the drafter still runs."""
    for i, (work, budget) in enumerate(zip(works, budgets)):
        work.staged = (table, i if rows is None else rows[i])
        work.draft_ids = [0] * budget  # placeholders: collect() writes the real ids
        work.tokens = work.tokens[:1] + work.draft_ids


class StagedDrafts:
    """A verify batch's drafts still on the device: table [R, k] (one proposer call's), and for each of its
    rows the decode work (index in the batch) that carries it."""

    def __init__(self, works: list[SeqWork], table, batch_rows: list[int], table_rows: list[int]):
        self.works, self.table, self.batch_rows, self.table_rows = works, table, batch_rows, table_rows

    def place(self, ids, upload) -> None:
        """Copy the drafts into a verify batch's device input ids [B, width] (after its last token; a row
        with fewer drafts than the width holds gets the rest in its padding, which nothing keeps). The table
        may be wider than the batch's widest budget (a drafter drafts its whole block; budgets shrink near
        max_tokens or under KV pressure): only its first width - 1 columns can be kept."""
        k = min(self.table.shape[1], ids.shape[1] - 1)
        if self.batch_rows == self.table_rows == list(range(ids.shape[0])):
            ids[:, 1:1 + k].copy_(self.table[:, :k])
        else:
            import torch

            ids[upload(self.batch_rows, torch.long), 1:1 + k] = \
                self.table[upload(self.table_rows, torch.long)][:, :k]

    def fill(self, flat: list[int]) -> list[int]:
        """Given the step's read back with the table's values at its end, write each work's draft ids (and
        tokens) and return the read back without them."""
        k = self.table.shape[1]
        values, flat = flat[len(flat) - self.table.numel():], flat[:len(flat) - self.table.numel()]
        for work, row in zip(self.works, self.table_rows):
            work.draft_ids = values[row * k: row * k + len(work.draft_ids)]
            work.tokens = work.tokens[:1] + work.draft_ids
            work.staged = None
        return flat


def staged_drafts(works: list[SeqWork]) -> StagedDrafts | None:
    """The decode works' staged drafts as one StagedDrafts (None when none is staged)."""
    rows = [(j, w) for j, w in enumerate(works) if w.staged is not None]
    if not rows:
        return None
    table = rows[0][1].staged[0]
    if any(w.staged[0] is not table for _, w in rows):
        raise ValueError("a verify batch's staged drafts come from one proposer call")
    return StagedDrafts([w for _, w in rows], table, [j for j, _ in rows], [w.staged[1] for _, w in rows])


class _At:
    """A request id and an output count: what OracleProposer.drafts reads of a sequence."""

    def __init__(self, request_id: str, done: int):
        self.request_id, self.output_ids = request_id, [0] * done


def accepted_prefix(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts the target's own tokens confirm: sampled[j] is the target's token after the input
    and drafts[:j], so draft j stands while it equals sampled[j]."""
    n = 0
    while n < len(drafts) and drafts[n] == sampled[n]:
        n += 1
    return n


class OracleProposer:
    """Benchmark and test drafter: proposes a known continuation of each request (the target's own greedy
    output, recorded by a run without speculation), each draft replaced by a random token with
    probability `corrupt`, so acceptance lengths can be set without a trained drafter. Whether the draft
    at a request's output position is replaced, and by what, depends only on (seed, request, position),
    not on the order of proposals: a run is then a function of the continuations, so a benchmark can
    feed a run's output back as the next run's continuations until they agree (bench/spec_e2e.py
    --settle)."""

    def __init__(self, continuations: dict[str, list[int]], *, corrupt: float = 0.0, vocab: int = 1000,
                 seed: int = 0):
        self.continuations = continuations  # request id -> continuation; ids without one get no drafts
        self.corrupt = corrupt
        self.vocab = vocab
        self.seed = seed
        self._device_rows: dict[tuple, object] = {}  # _device_drafts' tensors

    def _replacement(self, request_id: str, position: int, token: int) -> int:
        """The draft at `position` of this request's output: `token`, or with probability `corrupt` another. The
        draws come from a cryptographic hash of (seed, request, position), independent from position to position:
        CRC-32 (before s32) is linear, and its draws for consecutive positions clustered, so rounds met fewer
        corruptions than the rate says (a set acceptance length of 3.0 measured 3.5-3.65)."""
        digest = hashlib.blake2b(f"{self.seed}:{request_id}:{position}".encode(), digest_size=16).digest()
        if int.from_bytes(digest[:8], "little") / 2**64 >= self.corrupt:
            return token
        other = int.from_bytes(digest[8:], "little") % (self.vocab - 1)
        return (token + 1 + other) % self.vocab

    def drafts(self, seq, budget: int) -> list[int]:
        """Up to `budget` drafts for the sequence's next output positions (fewer where its continuation ends)."""
        known = self.continuations.get(seq.request_id, [])
        done = len(seq.output_ids)
        return [self._replacement(seq.request_id, done + j, t) for j, t in enumerate(known[done: done + budget])]

    def propose(self, works: list[SeqWork], budgets: list[int]) -> None:
        for work, budget in zip(works, budgets):
            drafts = self.drafts(work.seq, budget)
            work.draft_ids, work.staged = drafts, None  # replaces any drafts staged before (bench wrappers)
            work.tokens = work.tokens[:1] + drafts

    def patch_ahead(self, drafter) -> None:
        """Bench and tests: rounds the engine queues before the last read back (Engine._queue_next_round) verify this
        oracle's drafts in place of those `drafter` (the MTP proposer) queued ahead, which stay its own for its
        `propose` (rounds the host plans, where `propose` gives the oracle's drafts). A row's next round starts at
        output position p + c: p its verified row's first (the host's count for a round the host launched; the
        device's, kept from the round before, for a queued one) and c the tokens it commits, counted on the device.
        Positions past a continuation draft token 0."""
        ahead, own = drafter.draft_ahead, drafter.ahead_drafts
        tables: list = []  # (plan, oracle drafts): the last two rounds'
        state = {}

        def draft_ahead(plan, samples, rows=None):
            ahead(plan, samples, rows)
            table = own(plan)
            if table is not None:
                drafts = self._ahead_table(drafter.runner, plan, samples, table.shape[1], rows, state)
                tables[:] = tables[-1:] + [(plan, drafts)]

        drafter.draft_ahead = draft_ahead
        drafter.ahead_drafts = lambda plan: next((t for p, t in tables if p is plan), None)

    def _ahead_table(self, runner, plan: StepPlan, samples, k: int, rows, state: dict):
        import torch

        from ninfer.engine.next_round import committed_counts

        with torch.inference_mode():
            seqs = [w.seq for w in plan.decode]
            start = runner._tensor([len(s.output_ids) for s in seqs], torch.long) if rows is None else state["next"]
            ids = runner.last_verify_ids
            empty = torch.zeros(len(seqs), 0, dtype=torch.long, device=ids.device)
            state["next"] = start + committed_counts(ids, samples.view(ids.shape).to(ids.dtype), empty)
            longest = max(len(self.continuations.get(s.request_id, [])) for s in seqs) + k
            grid = torch.stack([self._device_drafts(s.request_id, longest, runner) for s in seqs])
            at = (state["next"][:, None] + torch.arange(k, device=ids.device)).clamp(max=longest - 1)
            return grid.gather(1, at)

    def _device_drafts(self, request_id: str, length: int, runner):
        """The request's drafts at output positions 0..length-1 on the runner's device (0 past its continuation),
        kept while the continuation and the corruption stay the same."""
        import torch

        known = self.continuations.get(request_id, [])
        key = (request_id, id(known), len(known), self.corrupt, self.seed, length)
        if key not in self._device_rows:
            drafts = self.drafts(_At(request_id, 0), length)
            self._device_rows[key] = runner._tensor(drafts + [0] * (length - len(drafts)), torch.long)
        return self._device_rows[key]
