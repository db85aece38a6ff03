"""The MTP proposer: drafts for every speculating decode row from the model's MTP head.

The head's KV rides in the trunk's cache as one more attention layer (same pages, page tables and
slots), so pauses, snapshots, prefix reuse and page copies carry it with the trunk's. One entry of a
reused input checkpoint is request-specific (its last position's, paired with the token after it):
`_boundary_rows` rewrites it in the reusing request's own copy of that page.

Per step, two halves (ninfer.models.mtp says what the head computes):
- `observe` (after the step's tokens are committed): the head over every position whose trunk hidden
  state is new this step (a prefill chunk's tokens, a verify row's committed ones), paired with the
  token that follows it (now known). This writes the head's KV at those positions and leaves, per
  sequence that decodes next, the head's output at its last position and the greedy draft it gives
  (both on the device). A prefill chunk's positions are observed at once; a decode step's are kept
  (their hidden rows, on the device) until the sequence next drafts, and `propose` observes them
  first: steps that draft nothing (the adaptive engine's plain steps, DraftController) then run no
  head at all, as a plain decode step, and the next draft catches up in one head forward over the rows
  kept since. Once a sequence keeps CAP rows, every sequence of the step catches up together, in one
  forward: the head's weights are then read once per CAP plain steps, not once per sequence and
  window (at C=8 on the H200, s15, per-sequence windows and their host work cost ~0.5 ms a 15.5 ms step).
  A plain step's observe (bookkeeping, and a catch-up when one is due) runs only once the next step's forward
  is launched (`observe_deferred`), so neither keeps the device waiting.
  A catch-up replays a verify-shaped graph of WINDOW or CAP rows a sequence. Run eagerly, as before s24, a new
  mix of row counts could compile or load Triton kernels mid-serving (on an H100 at C=8, catch-ups of 256-416
  rows took 0.48-0.77 s where others took 2-10 ms, stalling every sequence of the step, mostly in probe steps).
- `propose` (before the next verify forward): k-1 more head steps from there, one token each (the
  previous draft in, the previous output as hidden), the drafts left on the device. On CUDA, with
  the runner's graphs on, the k-1 steps replay one CUDA graph per batch size instead of ~k * 40 eager
  kernel launches. `observe` over a plain decode step (one row per sequence), and over a verify step's
  committed rows (padded to the verify's width, or to WINDOW), replays graphs of their own the same way.
  Every one of these graphs is captured when the proposer is bound, while the cache is still empty
  (placeholder rows write page 0's slots, as the runner's own captures do), all in one memory pool:
  captured on first use instead, each new batch size stalled the first requests to reach it (a warm-up
  forward and the capture), and a shortfall of memory for a graph showed mid-serving, not at start-up.
  A graph not captured then (graphs switched on later, in tests) is captured on first use over its real
  inputs, whose warm-up writes only the head KV slots the graph itself rewrites. The drafts stay on the device
  (speculative.stage_drafts): the verify forward reads them there and brings them back with its sampled
  tokens, so the round's only host sync is the verify's.

- `draft_ahead` (s29; right after a verify forward is launched, when every row carries as many drafts): the
  observe of that step over all its rows and the next chain, queued on the device behind the verify, with the
  accepted count compared there. `observe` then only takes the frontier and `propose` stages the drafts, so no
  head work sits between a round's read back and the next verify (the method says how rows that commit less
  than their accepted run are handled).

Drafts are greedy (the head's argmax). With the target sampling each verified row as it would
without drafts and a draft standing only where it equals the target's token, the committed tokens
are the target's own: a point-mass proposal makes that the lossless rejection rule.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ninfer.engine.context_cache import MAX_CHECKPOINTS
from ninfer.engine.graphs import DecodeInputs, VerifyInputs, capture
from ninfer.engine.plan import RunnerOutput, SeqWork, StepPlan
from ninfer.engine.sequence import Sequence, Status
from ninfer.engine.speculative import accepted_prefix, computed_rows, speculates, stage_drafts, upload_batch
from ninfer.forward import CacheSpec, DeviceOnlyLengths, ForwardBatch, host_inputs, verify_inputs
from ninfer.models.mtp import chain_batch

log = logging.getLogger("ninfer.engine")
DRAFT_AHEAD_ENV = "NINFER_DRAFT_AHEAD"  # =0: no drafting ahead (MTPProposer.draft_ahead), for A/B benchmarks
WINDOW = 8  # kept rows up to this many a sequence are observed through one verify-shaped graph of this width
CAP = 64  # kept rows a sequence may hold: then every sequence of the step catches up, through the graph of CAP rows


@dataclass
class _Frontier:
    """What a sequence's next drafts start from: the head's output at trunk position `position`
    (the one before the sequence's last committed token) and the draft it gave."""

    position: int
    hidden: torch.Tensor  # [H]
    draft: torch.Tensor  # [] int64


@dataclass
class _Pending:
    """A decode step's committed positions of one sequence not observed yet: trunk hidden states [n, H] at
    positions start..start+n-1, computed by a step of `width` tokens a row (1: a plain decode step)."""

    start: int
    hidden: torch.Tensor
    width: int

    @property
    def end(self) -> int:
        return self.start + self.hidden.shape[0]


@dataclass
class _Ahead:
    """What `draft_ahead` queued behind a verify forward, per decode row i of `plan`: the head's output at the row's
    accepted position (last[i]), its draft (first[i]) and the next round's drafts (table[i], [k])."""

    plan: StepPlan
    table: torch.Tensor
    last: torch.Tensor
    first: torch.Tensor


class MTPProposer:
    name = "mtp"
    wants_prefill_hidden = True
    rewrites_boundary = True  # the KV manager copies an input checkpoint's last page for a request reusing it

    def __init__(self, head: torch.nn.Module, draft_head: torch.nn.Module | None = None):
        """head: an MTPHead attached to the trunk, built with kv_layer = trunk.num_attn_layers; draft_head:
        the optimized proposal head (--lm-head-draft), else the trunk's lm_head scores the drafts."""
        self.head = head
        self.draft_head = draft_head
        self.runner = None
        self._frontier: dict[str, _Frontier] = {}
        self._pending: dict[str, list[_Pending]] = {}  # request id -> contiguous unobserved decode rows
        self._deferred: tuple | None = None  # a plain step's (plan, output, committed), observed after the next launch
        self._aheads: list[_Ahead] = []  # drafts ahead of the verify steps in flight (draft_ahead), until observed
        self._ready_ahead: dict[str, tuple[torch.Tensor, int]] = {}  # request id -> (table, row): next round's drafts
        self._ahead_statics: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by verify width: its samples, drafts
        self._ahead_out: tuple[torch.Tensor, torch.Tensor] | None = None  # _ahead_outputs
        self.ahead_rounds = 0  # decode rows whose drafts came from draft_ahead
        self.drafts_ahead = os.environ.get(DRAFT_AHEAD_ENV, "1") != "0"
        # input checkpoints' last trunk hidden rows [H], by the prefix's cache key (see _boundary_rows)
        self._boundaries: OrderedDict[int, torch.Tensor] = OrderedDict()
        # ("chain" | "observe", batch size) or ("observe_verify", batch size, width) -> (graph, its output)
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._static: tuple[DecodeInputs, torch.Tensor, torch.Tensor] | None = None  # base rows, hidden, draft
        self._verify_statics: dict[int, tuple[VerifyInputs, torch.Tensor, torch.Tensor]] = {}  # by verify width
        self._pick: torch.Tensor | None = None  # verify-shaped graphs: each sequence's last row, whose draft they give
        self.graph_replays = 0
        self.observe_replays = 0
        self._graph_failed = False
        self._pool = None  # the head graphs' shared memory pool (each replay's outputs are copied out at once)
        self.capture_seconds = 0.0  # start-up's captures (_capture_all)

    def cache_spec(self, trunk_spec: CacheSpec) -> CacheSpec:
        return self.head.cache_spec(trunk_spec)

    def bind(self, runner) -> None:
        self.runner = runner
        if runner.decode_graph_inputs is not None:
            try:
                self._capture_all()
            except Exception as exc:  # a capture's own failure turns graphs off (_graph); nothing else stops start-up
                log.warning("MTP head: capturing graphs at start-up failed (%s: %s); capturing on first use",
                            type(exc).__name__, exc)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Capture every head graph a run can replay (module docstring), for batch sizes 1..the runner's
        decode graphs': the chain of k-1 steps, the head over one row a sequence, over verify-shaped
        rows of every verify width, of WINDOW and of CAP, and drafting ahead from every verify width."""
        runner, started = self.runner, time.perf_counter()
        like, k = runner.decode_graph_inputs, runner.draft_tokens
        # shaped like the trunk's hidden states, which the graphs' static rows are copied from
        dtype = runner.last_hidden.dtype if runner.last_hidden is not None else self.head.fc.weight.dtype
        hidden = torch.zeros(1, self.head.config["hidden_size"], dtype=dtype, device=runner.device)
        inputs, h0, d0 = self._statics(hidden)
        inputs.placeholder()
        verify = {width: self._verify_static(width, hidden) for width in sorted(set(range(2, k + 2)) | {WINDOW, CAP})}
        for vin, _, _ in verify.values():
            vin.placeholder()
        for b in range(like.max_batch, 0, -1):
            if k > 1 and self._chain_graph(b, k - 1) is None:
                return
            if self._head_graph(("observe", b), inputs, b, h0[:b], d0[:b]) is None:
                return
            for width, (vin, vh, vd) in verify.items():
                if self._head_graph(("observe_verify", b, width), vin, b, vh[: b * width], vd[:b],
                                    self._picks()) is None:
                    return
            for width in range(2, k + 2) if self.drafts_ahead else ():
                if self._ahead_graph(b, width, hidden) is None:
                    return
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        self.capture_seconds = time.perf_counter() - started
        log.info("MTP head: %d CUDA graphs captured in %.2f s", len(self._graphs), self.capture_seconds)

    def forget(self, seq: Sequence, retained: bool = False) -> None:
        """Drop a finished sequence. retained: its context goes to the prefix cache, so the head first observes
        the rows it kept (a following turn that reuses the context drafts from the head's KV there too)."""
        if retained:
            with torch.inference_mode():
                self.observe_deferred()
                self._observe([seq])
        self._frontier.pop(seq.request_id, None)
        self._pending.pop(seq.request_id, None)

    def _argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.draft_head is not None:
            return self.draft_head.propose(hidden)
        width = self.runner.vocab_size
        return self.head.compute_logits(hidden)[:, :width].argmax(-1)

    # ---- after a step: the head over the positions the trunk computed ----------------------------
    def observe(self, plan: StepPlan, output: RunnerOutput, committed: dict[int, int]) -> None:
        """The head over the step's new positions (module docstring): a prefill chunk's and a drafted row's now,
        a row without drafts kept until the sequence drafts again, or until some sequence keeps CAP rows. A plain
        decode step's (no prefill chunk, no drafts) is only deferred: the engine calls `observe_deferred` once the
        next step's forward is launched, so its host work runs while the device computes (s25, H100, C=8: with the
        controller's cheaper sums, a speculative engine's decode-only step went from 11.65 to 11.20 ms, against 10.91
        without speculation)."""
        ahead = next((a for a in self._aheads if a.plan is plan), None)
        self._aheads = [a for a in self._aheads if a.plan is not plan]  # a round queued after it stays
        self._ready_ahead = {}
        if ahead is not None:
            committed = self._take_ahead(ahead, plan, output, committed)
        self.observe_deferred()  # a step deferred before comes first: its rows precede this one's
        if plan.prefill is None and not any(w.draft_ids for w in plan.decode):
            self._deferred = (plan, output, committed)
        else:
            self._observe_step(plan, output, committed)

    def observe_deferred(self) -> None:
        """Observe the plain step deferred by `observe`, if any (the engine calls it after launching the next step's
        forward; `observe` and `propose` call it first). A catch-up it starts leaves out sequences paused since that
        step (their pages may be another's by now): they keep their rows until they draft again."""
        if self._deferred is not None:
            step, self._deferred = self._deferred, None
            self._observe_step(*step)

    @torch.inference_mode()
    def _observe_step(self, plan: StepPlan, output: RunnerOutput, committed: dict[int, int]) -> None:
        # a prefill chunk's last row waits for its next token (the next chunk's first, or the first sample)
        rows = [(s, p, h) for s, p, h in computed_rows(plan, output, committed) if s.total_len > p + h.shape[0]]
        if not rows:
            return
        width = max((len(w.tokens) for w in plan.decode), default=1)
        prefill = plan.prefill.seq if plan.prefill is not None else None
        drafted = {id(w.seq) for w in plan.decode if w.draft_ids}
        now, kept, full = [], [], False
        for seq, start, hidden in rows:
            if seq is prefill:
                self._boundary_rows(seq, start, hidden)
            self._keep(seq, start, hidden, 0 if seq is prefill else width)
            if seq is prefill or id(seq) in drafted:
                now.append(seq)
            elif seq.status is Status.DECODE:  # still resident (a deferred step's sequence may be paused since)
                kept.append(seq)
                chunks = self._pending[seq.request_id]
                full = full or chunks[-1].end - chunks[0].start >= CAP
        self._observe(now + kept if full else now)

    def _boundary_rows(self, seq: Sequence, start: int, hidden: torch.Tensor) -> None:
        """Input checkpoints (prefix reuse): the head's KV at a checkpoint's last position pairs it with the token
        after it, which differs between the request that made the checkpoint and those reusing it. A prefill chunk
        ending at a checkpoint leaves its last hidden row here; a request that reused that checkpoint, with the page
        holding its last position a copy of its own (KVManager, private_boundary), observes that position again,
        with its own next token, before its first chunk. Without the row (evicted, or made before a restart) its
        drafts attend to the maker's entry there: still verified, so output is unchanged."""
        end = start + hidden.shape[0]
        if end in seq.checkpoints:
            key = hash(tuple(seq.cache_key(0, end)))
            self._boundaries[key] = hidden[-1].clone()
            self._boundaries.move_to_end(key)
            while len(self._boundaries) > MAX_CHECKPOINTS:
                self._boundaries.popitem(last=False)
        if seq.private_boundary == start and not self._pending.get(seq.request_id):
            seq.private_boundary = None
            row = self._boundaries.get(hash(tuple(seq.cache_key(0, start))))
            if row is not None:
                self._keep(seq, start - 1, row[None], 0)

    def predictions(self, plan: StepPlan) -> list[tuple[Sequence, torch.Tensor]]:
        """The plan's rows without drafts whose frontier draft predicts the token this step samples (the head has
        observed up to the row's last committed token): (sequence, draft on the device), for free acceptance samples
        (spec_control's `sample`)."""
        out = []
        for work in plan.decode:
            f = None if work.draft_ids else self._frontier.get(work.seq.request_id)
            if f is not None and f.position == work.seq.num_computed - 1:
                out.append((work.seq, f.draft))
        return out

    def _keep(self, seq: Sequence, start: int, hidden: torch.Tensor, width: int) -> None:
        """Append positions start.. to seq's unobserved rows, which stay one contiguous run ending there: rows at
        or past `start` are dropped (a replay computes them again), and so are rows before a gap."""
        chunks = self._pending.setdefault(seq.request_id, [])
        while chunks and chunks[-1].start >= start:
            chunks.pop()
        if chunks and chunks[-1].end > start:
            last = chunks[-1]
            chunks[-1] = _Pending(last.start, last.hidden[: start - last.start], last.width)
        if chunks and chunks[-1].end < start:
            chunks.clear()
        chunks.append(_Pending(start, hidden, width))

    def _observe(self, seqs: list[Sequence]) -> None:
        """The head over the kept rows of these sequences: one step's rows of each replay the graph of a plain
        step or of that verify step, up to WINDOW rows a sequence kept over several steps the verify-shaped
        graph of WINDOW rows, more (a catch-up) or rows no graph fits go through one eager forward. Each
        sequence's frontier then sits at its last row."""
        held = [(s, self._pending.pop(s.request_id)) for s in seqs if self._pending.get(s.request_id)]
        if not held:
            return
        seqs = [s for s, _ in held]
        starts = [chunks[0].start for _, chunks in held]
        lens = [chunks[-1].end - chunks[0].start for _, chunks in held]
        tokens = [s.tokens(p + 1, p + 1 + n) for s, p, n in zip(seqs, starts, lens)]
        positions = [s.positions(p, p + n) for s, p, n in zip(seqs, starts, lens)]
        hidden = [torch.cat([c.hidden for c in chunks]) if len(chunks) > 1 else chunks[0].hidden
                  for _, chunks in held]
        results = None
        if self._graphable(seqs, positions):
            widths = {chunks[0].width for _, chunks in held}
            single = all(len(chunks) == 1 for _, chunks in held)
            if single and all(n == 1 for n in lens):  # one row each (a plain step's, or a verify's that kept one)
                graphed = self._observe_replay(seqs, starts, tokens, torch.cat(hidden) if len(held) > 1 else hidden[0])
            elif single and len(widths) == 1 and min(widths) > 1:  # the committed rows of one verify step
                graphed = self._observe_verify_replay(seqs, starts, tokens, hidden, widths.pop())
            elif max(lens) <= WINDOW:  # rows of a few steps
                graphed = self._observe_verify_replay(seqs, starts, tokens, hidden, WINDOW)
            elif max(lens) <= CAP:  # a catch-up: one forward reads the head's weights once
                graphed = self._observe_verify_replay(seqs, starts, tokens, hidden, CAP)
            else:  # a prefill chunk of more than CAP rows: eager
                graphed = None
            if graphed is not None:
                results = [(graphed[0][j], graphed[1][j]) for j in range(len(seqs))]
        if results is None:
            results = self._observe_eager(seqs, starts, tokens, positions, hidden)
        for (seq, p, n), (last, draft) in zip(zip(seqs, starts, lens), results):
            if seq.status is Status.DECODE or seq.total_len == p + n + 1:
                self._frontier[seq.request_id] = _Frontier(p + n - 1, last, draft)

    def _observe_eager(self, seqs, starts, tokens, positions, hidden) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The head over every row in one eager forward: each sequence's output at its last row, and its draft."""
        runner = self.runner
        batch = upload_batch(ForwardBatch.build(tokens, starts, [s.pages for s in seqs], runner.page_size,
                                                device="cpu", positions=positions), runner)
        out = self.head(batch, runner.cache, batch.input_ids, torch.cat(hidden) if len(hidden) > 1 else hidden[0])
        last = out[batch.last_token_indices()]
        drafts = self._argmax(last)
        return [(last[j], drafts[j]) for j in range(len(seqs))]

    def _observe_verify_replay(self, seqs: list[Sequence], starts: list[int], tokens: list[list[int]],
                               hidden: list[torch.Tensor], width: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """observe over a verify step's committed rows (tokens[i]: c_i of them at starts[i]..) from one CUDA
        graph per (batch size, verify width): the rows padded to the step's width as a verify batch (padding
        writes no KV), the head over all of them, then each sequence's row c_i - 1 picked (the graph drafts from
        those rows alone). None when the head cannot be captured or the rows do not fit (the caller observes
        eagerly)."""
        runner, b = self.runner, len(seqs)
        like = runner.decode_graph_inputs
        if width < 2 or any(len(t) > width for t in tokens) or b > like.max_batch:
            return None
        inputs, h0, d0 = self._verify_static(width, hidden[0])
        inputs.load(verify_inputs(tokens, starts, [s.pages for s in seqs], runner.page_size, [0] * b,
                                  [[0] * width] * b, width))
        grid = h0[: b * width].view(b, width, -1)
        for i, h in enumerate(hidden):
            grid[i, : h.shape[0]].copy_(h)
        last = runner._tensor([i * width + len(t) - 1 for i, t in enumerate(tokens)], torch.long)
        pick = self._picks()
        pick[:b].copy_(last)
        replayed = self._head_replay(("observe_verify", b, width), inputs, b, h0[: b * width], d0[:b], pick)
        if replayed is None:
            return None
        return replayed[0][last], replayed[1].clone()  # its next replay rewrites the static drafts

    def _verify_static(self, width: int, like: torch.Tensor) -> tuple[VerifyInputs, torch.Tensor, torch.Tensor]:
        """The verify-shaped graphs' static inputs of this width: rows, hidden rows (like `like`'s), draft ids."""
        static = self._verify_statics.get(width)
        if static is None:
            runner = self.runner
            graphs = runner.decode_graph_inputs
            rows, device = graphs.max_batch * width, runner.device
            static = self._verify_statics[width] = (
                VerifyInputs(graphs.max_batch, width, graphs.width, device),
                torch.zeros(rows, like.shape[-1], dtype=like.dtype, device=device),
                torch.zeros(rows, dtype=torch.long, device=device))
        return static

    def _picks(self) -> torch.Tensor:
        """The static row indices of the verify-shaped graphs (one a sequence, filled before each replay)."""
        if self._pick is None:
            self._pick = torch.zeros(self.runner.decode_graph_inputs.max_batch, dtype=torch.long,
                                     device=self.runner.device)
        return self._pick

    def _head_graph(self, key: tuple, inputs, b: int, hidden: torch.Tensor, drafts: torch.Tensor,
                    pick: torch.Tensor | None = None) -> tuple | None:
        """The graph of `key` (captured now if it is not yet): the head over static `inputs.batch(b)` and static
        `hidden` rows, its argmax into static `drafts`: of every row, or with `pick` (static indices) of rows
        pick[:b] only. None when the head cannot be captured."""
        def run() -> torch.Tensor:
            batch = inputs.batch(b)
            out = self.head(batch, self.runner.cache, batch.input_ids, hidden)
            drafts.copy_(self._argmax(out if pick is None else out[pick[:b]]))
            return out

        return self._graph(key, run)

    def _head_replay(self, key: tuple, inputs, b: int, hidden: torch.Tensor, drafts: torch.Tensor,
                     pick: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`_head_graph`'s graph replayed: its outputs and drafts (rewritten by its next replay), or None when
        the head cannot be captured."""
        entry = self._head_graph(key, inputs, b, hidden, drafts, pick)
        if entry is None:
            return None
        entry[0].replay()
        self.observe_replays += 1
        return entry[1], drafts

    # ---- drafting ahead: the next round's drafts queued behind a verify forward ---------------------
    def ahead_drafts(self, plan: StepPlan) -> torch.Tensor | None:
        """The next round's drafts [b, k] that draft_ahead queued behind `plan`'s verify (on the device), if it did."""
        return next((a.table for a in self._aheads if a.plan is plan), None)

    @torch.inference_mode()
    def draft_ahead(self, plan: StepPlan, samples: torch.Tensor, rows: VerifyInputs | None = None) -> None:
        """Right after a verify forward is launched (every decode row drafted, all of one width w, text rows with
        pages for the chain): queue on the device, behind it, what `observe` and the next `propose` would run once
        its tokens are back: the head over all w rows of each sequence (row j paired with the target's token there,
        samples[i, j]), the accepted count (the drafts' agreeing prefix with those tokens, computed on the device),
        the frontier picked at the accepted row and the chain of k-1 steps from it. The host then finds the next
        round's drafts ready (`_take_ahead`, `propose`) instead of launching the head between the verify's read
        back and the next verify (s28, H100, C=1 MTP3: ~1.1 ms of host a round the device waited through).
        Rows where the accepted count is not the commit (a stop, max_tokens, a thinking budget) are observed as
        before. Head rows past the accepted one write KV at positions the next round rewrites before any head
        step reads them, as the chain's rejected drafts always did.
        rows: the verify's static rows on the device, for a round the engine queued before the last one was read back
        (its positions are known there only; the engine reserved the pages its chain writes)."""
        works, runner = plan.decode, self.runner
        if not self.drafts_ahead or plan.prefill is not None or not works or not all(w.draft_ids for w in works):
            return
        width, k, b = len(works[0].tokens), runner.draft_tokens, len(works)
        seqs = [w.seq for w in works]
        if rows is None:
            starts = [w.start for w in works]
            positions = [s.positions(p, p + 1) for s, p in zip(seqs, starts)]
            if (any(len(w.tokens) != width for w in works) or any(p is not None for p in positions)
                    or any(len(s.pages) * runner.page_size < p + width + k - 1 for s, p in zip(seqs, starts))):
                return  # ragged widths, MRoPE rows, or the chain would write past a row's pages
            # the verify's rows (positions, pages); the head reads its tokens from the samples, not these ids
            rows = verify_inputs([[0] * width] * b, starts, [s.pages for s in seqs], runner.page_size, [0] * b,
                                 [[0] * width] * b, width)
        else:
            positions = [None] * b
        drafts = runner.last_verify_ids[:, 1:]
        if self._graphable(seqs, positions) and b <= runner.decode_graph_inputs.max_batch:
            result = self._ahead_replay(rows, b, samples, drafts, width)
        elif runner.device.type == "cpu":  # the same computation, eagerly (CPU tests and the embedded model)
            batch = rows.host_batch(b) if isinstance(rows, VerifyInputs) else ForwardBatch.for_verify(rows)
            result = self._ahead_forward(batch, b, width, samples.reshape(-1).long(), runner.last_hidden[: b * width],
                                         drafts)
        else:
            return
        if result is not None:
            self._aheads = [a for a in self._aheads[-1:] if a.plan is not plan] + [_Ahead(plan, *result)]

    def _ahead_forward(self, batch: ForwardBatch, b: int, width: int, ids: torch.Tensor, hidden: torch.Tensor,
                       drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """draft_ahead's device work over a verify-shaped batch (rows at the verify's positions) with the target's
        tokens `ids` [b * width] and hidden rows, and the verified drafts [b, width-1]: (next drafts [b, k], the
        head's output at each accepted row [b, H], its draft [b]). Device ops only: a CUDA graph captures it."""
        k = self.runner.draft_tokens
        out = self.head(batch, self.runner.cache, ids, hidden)
        accepted = (drafts == ids.view(b, width)[:, : width - 1]).long().cumprod(1).sum(1)
        rows = torch.arange(b, device=ids.device) * width + accepted
        last = out[rows]
        first = self._argmax(last)
        if k == 1:
            return first[:, None], last, first
        seq_lens = (batch.seq_lens - (width - 1) + accepted).to(torch.int32)  # through the accepted position
        host = batch.seq_lens_cpu  # a graph's are on the device only; the CPU reference kernels read host lengths
        base = ForwardBatch(
            input_ids=ids[rows], positions=batch.positions[rows],
            query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=ids.device), seq_lens=seq_lens,
            page_table=batch.page_table, slot_mapping=batch.slot_mapping[rows], state_slots=batch.state_slots,
            query_lens_cpu=[1] * b, seq_lens_cpu=host if isinstance(host, DeviceOnlyLengths) else seq_lens.tolist())
        return torch.cat([first[:, None], self._chain(base, first, last, k - 1)], dim=1), last, first

    def _ahead_static(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ahead graphs' static inputs of this verify width: the target's tokens [max_batch * width] and the
        verified drafts [max_batch, width-1] (their hidden rows and positions: _verify_static's)."""
        static = self._ahead_statics.get(width)
        if static is None:
            mb, device = self.runner.decode_graph_inputs.max_batch, self.runner.device
            static = self._ahead_statics[width] = (torch.zeros(mb * width, dtype=torch.long, device=device),
                                                   torch.zeros(mb, width - 1, dtype=torch.long, device=device))
        return static

    def _ahead_outputs(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ahead graphs' static outputs besides the drafts, shared by every width: each sequence's head output
        at its accepted row [max_batch, H] (like `like`'s rows) and the draft it gives [max_batch]."""
        if self._ahead_out is None:
            mb, device = self.runner.decode_graph_inputs.max_batch, self.runner.device
            self._ahead_out = (torch.zeros(mb, like.shape[-1], dtype=like.dtype, device=device),
                               torch.zeros(mb, dtype=torch.long, device=device))
        return self._ahead_out

    def _ahead_graph(self, b: int, width: int, like: torch.Tensor) -> tuple | None:
        """The graph of _ahead_forward for b sequences of this verify width over the static inputs (captured now
        if it is not yet); its output the next drafts [b, k], the last rows and drafts in `_ahead_outputs`."""
        vin, vh, _ = self._verify_static(width, like)
        ids, drafts = self._ahead_static(width)
        last, first = self._ahead_outputs(like)

        def run() -> torch.Tensor:
            table, rows, draft = self._ahead_forward(vin.batch(b), b, width, ids[: b * width], vh[: b * width],
                                                     drafts[:b])
            last[:b].copy_(rows)
            first[:b].copy_(draft)
            return table

        return self._graph(("ahead", b, width), run)

    def _ahead_replay(self, rows, b: int, samples: torch.Tensor, drafts: torch.Tensor,
                      width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """draft_ahead through its graph: the verify's rows (host inputs: positions, pages; their tokens are the
        samples), hidden states and drafts copied into the static inputs, on the device. Copies of the outputs: the
        next verify step replays the graph again before this one's drafts are read back."""
        runner = self.runner
        vin, vh, _ = self._verify_static(width, runner.last_hidden)
        ids, static_drafts = self._ahead_static(width)
        if isinstance(rows, VerifyInputs):  # the runner's rows on the device, laid out alike (same batch and pages)
            vin.i64.copy_(rows.i64)
            vin.i32.copy_(rows.i32)
        else:
            vin.load(rows)
        vh[: b * width].copy_(runner.last_hidden[: b * width])
        ids[: b * width].copy_(samples.reshape(-1))
        static_drafts[:b].copy_(drafts)
        entry = self._ahead_graph(b, width, runner.last_hidden)
        if entry is None:
            return None
        entry[0].replay()
        self.observe_replays += 1
        last, first = self._ahead_outputs(runner.last_hidden)
        return entry[1].clone(), last[:b].clone(), first[:b].clone()

    def _take_ahead(self, ahead: _Ahead, plan: StepPlan, output: RunnerOutput,
                    committed: dict[int, int]) -> dict[int, int]:
        """After the verify step that drafted ahead is committed: a row whose committed tokens are the target's
        own takes its frontier (at the accepted row) and next drafts from `ahead`, its head KV already written;
        when the commit stopped short of the accepted run (the request finished, or a thinking budget ended it)
        the row has no frontier (later rows are kept and observed as usual). A row whose committed tokens are not
        the samples (a forced suffix) is left to `_observe_step`. Returns `committed` without the rows taken."""
        rest = dict(committed)
        offset = len(plan.works) - len(plan.decode)
        for i, work in enumerate(plan.decode):
            seq, c = work.seq, committed.get(id(work.seq), 0)
            sampled = output.sampled[offset + i]
            if not c or seq.output_ids[len(seq.output_ids) - c:] != sampled[:c]:
                continue
            rest[id(seq)] = 0
            self._pending.pop(seq.request_id, None)
            accepted = accepted_prefix(work.draft_ids, sampled)
            if c == accepted + 1:
                self._frontier[seq.request_id] = _Frontier(work.start + accepted, ahead.last[i], ahead.first[i])
                self._ready_ahead[seq.request_id] = (ahead.table, i)
            else:
                self._frontier.pop(seq.request_id, None)
        return rest

    # ---- before a step: the chain of drafts ---------------------------------------------------------
    @torch.inference_mode()
    def propose(self, works: list[SeqWork], budgets: list[int]) -> None:
        self.observe_deferred()
        self._observe([w.seq for w, b in zip(works, budgets) if b > 0 and speculates(w.seq)])  # the rows kept
        ready = [(w, b, self._frontier.get(w.seq.request_id)) for w, b in zip(works, budgets)]
        ready = [(w, b, f) for w, b, f in ready if f is not None and f.position == w.seq.num_computed - 1
                 and speculates(w.seq)]
        ahead, self._ready_ahead = self._ready_ahead, {}
        if not ready:
            return
        budgets_by_row = [b for _, b, _ in ready]
        k = max(budgets_by_row)
        early = [ahead.get(w.seq.request_id) for w, _, _ in ready]
        if all(e is not None for e in early) and all(e[0] is early[0][0] for e in early):  # no head work at all
            self.ahead_rounds += len(ready)
            stage_drafts([w for w, _, _ in ready], budgets_by_row, early[0][0], [e[1] for e in early])
            return
        # otherwise every row chains from its frontier (drafting ahead left those, and the head's KV, as observe would)
        # one chain per budget: a chain of k - 1 steps writes the head's KV at k - 1 positions past each row's
        # frontier, and a row with a smaller budget has pages reserved for fewer (s27: a row near its
        # max_tokens beside full-budget rows indexed past its page table and failed the step)
        table = None
        for b in sorted(set(budgets_by_row), reverse=True):
            rows = [i for i, rb in enumerate(budgets_by_row) if rb == b]
            part = self._drafts([ready[i] for i in rows], b)
            if len(rows) == len(ready):
                table = part
                break
            if table is None:
                table = torch.zeros(len(ready), k, dtype=part.dtype, device=part.device)
            table[self.runner._tensor(rows, torch.long), :b] = part
        stage_drafts([w for w, _, _ in ready], budgets_by_row, table)  # read back with the verify's

    def _drafts(self, ready: list, b: int) -> torch.Tensor:
        """Drafts [rows, b] of (work, budget b, frontier) rows: the frontier's draft, then a chain of b - 1 steps
        (one CUDA graph when b is the whole window, else eager)."""
        runner = self.runner
        seqs = [w.seq for w, _, _ in ready]
        starts = [f.position for _, _, f in ready]
        first = torch.stack([f.draft for _, _, f in ready])
        hidden = torch.stack([f.hidden for _, _, f in ready])
        positions = [s.positions(p, p + 1) for s, p in zip(seqs, starts)]
        if b == 1:
            return first[:, None]
        if b == runner.draft_tokens and self._graphable(seqs, positions):
            return self._replay(seqs, starts, first, hidden, b - 1)
        base = upload_batch(ForwardBatch.build([[0]] * len(seqs), starts, [s.pages for s in seqs],
                                               runner.page_size, device="cpu", positions=positions), runner)
        return torch.cat([first[:, None], self._chain(base, first, hidden, b - 1)], dim=1)

    def _chain(self, base: ForwardBatch, draft: torch.Tensor, hidden: torch.Tensor, steps: int) -> torch.Tensor:
        """Drafts 2..steps+1 [B, steps]: each step one token per sequence, one position past `base`'s."""
        step, out = base, []
        for _ in range(steps):
            step = chain_batch(step, self.runner.page_size)
            hidden = self.head(step, self.runner.cache, draft, hidden)
            draft = self._argmax(hidden)
            out.append(draft)
        return torch.stack(out, dim=1)

    # ---- the chain as CUDA graphs ------------------------------------------------------------------
    def _graphable(self, seqs: list[Sequence], positions: list) -> bool:
        """Text rows on CUDA with the runner's decode graphs on, within their page-table width."""
        inputs = self.runner.decode_graph_inputs
        return (inputs is not None and not self._graph_failed and all(p is None for p in positions)
                and all(len(s.pages) <= inputs.width for s in seqs))

    def _statics(self, hidden: torch.Tensor) -> tuple[DecodeInputs, torch.Tensor, torch.Tensor]:
        """The graphs' static inputs, sized like the runner's decode graphs: rows, hidden rows, token ids."""
        if self._static is None:
            like, device = self.runner.decode_graph_inputs, self.runner.device
            self._static = (DecodeInputs(like.max_batch, like.width, device),
                            torch.zeros(like.max_batch, hidden.shape[1], dtype=hidden.dtype, device=device),
                            torch.zeros(like.max_batch, dtype=torch.long, device=device))
        return self._static

    def _graph(self, key: tuple, run) -> tuple | None:
        """The graph captured for `key` (captured now over `run`, in the head graphs' pool, when it is not yet);
        None, and eager from now on, when the head cannot be captured."""
        if self._graph_failed:
            return None
        entry = self._graphs.get(key)
        if entry is None:
            try:
                entry = self._graphs[key] = capture(run, self.runner.device, warmups=1, pool=self._pool)
                if self._pool is None and hasattr(entry[0], "pool"):
                    self._pool = entry[0].pool()
            except Exception as exc:
                log.warning("MTP head: CUDA graph capture failed (%s: %s); drafting eagerly", type(exc).__name__, exc)
                self._graph_failed = True
                return None
        return entry

    def _replay(self, seqs: list[Sequence], starts: list[int], first: torch.Tensor, hidden: torch.Tensor,
                steps: int) -> torch.Tensor:
        runner, b = self.runner, len(seqs)
        inputs, h0, d0 = self._statics(hidden)
        inputs.load(host_inputs([[0]] * b, starts, [s.pages for s in seqs], runner.page_size, [0] * b))
        h0[:b].copy_(hidden)
        d0[:b].copy_(first)
        entry = self._chain_graph(b, steps)
        if entry is None:
            base = upload_batch(ForwardBatch.build([[0]] * b, starts, [s.pages for s in seqs], runner.page_size,
                                                   device="cpu"), runner)
            return torch.cat([first[:, None], self._chain(base, first, hidden, steps)], dim=1)
        entry[0].replay()
        self.graph_replays += 1
        return torch.cat([d0[:b, None], entry[1]], dim=1)

    def _chain_graph(self, b: int, steps: int) -> tuple | None:
        """The graph of the chain's `steps` head steps for b sequences (captured now if it is not yet), over the
        static rows, hidden rows and first drafts (_statics); None when the head cannot be captured."""
        inputs, h0, d0 = self._static
        return self._graph(("chain", b), lambda: self._chain(inputs.batch(b), d0[:b], h0[:b], steps))

    def _observe_replay(self, seqs: list[Sequence], starts: list[int], tokens: list[list[int]],
                        hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """observe over one row per sequence (a plain decode step's): the head at trunk position starts[i] with
        the token after it, from one CUDA graph per batch size (~40 eager launches otherwise, paid on every
        step the adaptive engine decodes plainly). Returns the head's outputs and their drafts (copies: the
        next replay rewrites the graph's); None when the head cannot be captured."""
        runner, b = self.runner, len(seqs)
        inputs, h0, d0 = self._statics(hidden)
        inputs.load(host_inputs(tokens, starts, [s.pages for s in seqs], runner.page_size, [0] * b))
        h0[:b].copy_(hidden)
        replayed = self._head_replay(("observe", b), inputs, b, h0[:b], d0[:b])
        return None if replayed is None else (replayed[0].clone(), replayed[1].clone())
