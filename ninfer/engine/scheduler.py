"""Decides what runs next; never touches tensors.

`schedule()` returns a StepPlan and `update(plan, output, committed)` reads the step's result back; the
scheduler is the only writer of a request's status and computed frontier.

Policy (contract, "Execution behavior"):
- up to `max_concurrency` resident requests; FIFO admission with a bounded bypass when the head
  cannot fit; paused requests are restored in arrival order before fresh ones, but fresh requests
  that fit still run while a paused one waits for room;
- one request prefills at a time, in chunks; every decode-ready request joins one decode batch;
- before a unit runs its pages are reserved; if the pool is short, retained checkpoints go first,
  then the youngest resident request pauses (a host snapshot when the budget allows, else it is
  rebuilt later by replay), never the oldest.
"""

from __future__ import annotations

from collections import deque

from ninfer.engine.kv_manager import KVManager
from ninfer.engine.plan import Admission, RunnerOutput, SeqWork, StepPlan
from ninfer.engine.sequence import Sequence, Status
from ninfer.engine.speculative import speculates

BYPASS_LIMIT = 4  # fresh requests that may overtake a head that does not fit


class Scheduler:
    def __init__(self, *, max_concurrency: int, prefill_chunk: int, kv: KVManager, draft_tokens: int = 0,
                 max_context: int | None = None, draft_reach: int = 0):
        """draft_tokens: the most drafts a decode row may carry (speculative decoding; 0: none). draft_reach:
        positions past a drafting row's verify that its drafter writes before the next round is planned (the MTP
        head drafting ahead: MTPProposer.draft_ahead); pages for them are reserved where free."""
        self.max_concurrency = max_concurrency
        self.draft_tokens = draft_tokens
        self.draft_reach = draft_reach
        self.max_context = max_context
        self.prefill_chunk = prefill_chunk
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.paused: list[Sequence] = []
        self.resident: list[Sequence] = []  # admitted: prefilling or decoding, in arrival order
        self._free_lanes = deque(range(max_concurrency))
        self._bypassed = 0
        self.preemptions = 0
        self._plan: StepPlan | None = None  # the plan being decided (pauses record into it)

    @property
    def pages(self):
        return self.kv.pages

    @property
    def slots(self):
        return self.kv.slots

    @property
    def cache(self):
        return self.kv.cache

    @property
    def running(self) -> int:
        return len(self.resident)

    # ---- the step -----------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Admit what fits, then the decode batch and the next prefill chunk, reserving their pages."""
        plan = self._plan = StepPlan()
        try:
            self.admit(plan)
            self._plan_decode(plan)
            self._plan_prefill(plan)
        finally:
            self._plan = None
        return plan

    def update(self, plan: StepPlan, output: RunnerOutput, committed: dict[int, int] | None = None) -> None:
        """Advance every planned sequence past the tokens the step computed. committed[id(seq)]: the tokens a
        decode row committed (absent: one); its input and the drafts before its last committed token hold
        valid KV and state. A finished request is released separately (`finish`)."""
        committed = committed or {}
        prefill = plan.prefill
        if prefill is not None and prefill.seq.status is Status.PREFILL:
            seq = prefill.seq
            seq.num_computed = prefill.end
            seq.computed_high = max(seq.computed_high, seq.num_computed)
            if prefill.end >= seq.prefill_target:
                seq.status = Status.DECODE
        for work in plan.decode:
            seq = work.seq
            if seq.status is Status.DECODE:
                # rejected drafts' positions lie past the frontier: later steps rewrite them
                seq.num_computed = work.start + committed.get(id(seq), 1)
                seq.computed_high = max(seq.computed_high, seq.num_computed)

    def finish(self, seq: Sequence, retain: bool) -> None:
        """Release a request that ended (retain: hand its context to the cache as an endpoint)."""
        if retain and seq.status is not Status.WAITING:
            self.kv.retain_endpoint(seq)
        self.kv.free_snapshot(seq)
        self._unbind(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.paused:
            self.paused.remove(seq)
        seq.status = Status.FINISHED

    def enqueue(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    # ---- admission ----------------------------------------------------------------------------
    def _need(self, seq: Sequence, reused: int) -> int:
        """Pages a binding needs (contract, "Execution behavior": room to rebuild the saved frontier and complete
        one new execution unit): the saved frontier (a snapshot restore) or the reusable prefix, then its next
        unit (a prefill chunk, for a request paused before its prompt was computed too), plus one more token."""
        start = seq.num_computed if seq.snapshot is not None else reused
        end = min(seq.prefill_target, start + self.prefill_chunk) if start < seq.prefill_target else start
        shared = 0 if seq.snapshot is not None else reused // self.kv.page_size
        return self._with_next_token(end) - shared

    def _residents_need(self) -> int:
        """Pages the residents' own units of this step still need: each decode row's next token and the
        prefilling request's next chunk. A binding leaves them free, or the older residents' reservations would
        pause it again in the very step that bound it (a restore's copy in, then straight back out)."""
        need, prefilling = 0, False
        for s in self.resident:
            if s.status is Status.DECODE:
                upto = s.num_computed + 1
            elif not prefilling:
                prefilling, upto = True, min(s.prefill_target, s.num_computed + self.prefill_chunk)
            else:
                continue  # one request prefills a step
            need += max(0, self.kv.pages_for(upto) - len(s.pages))
        return need

    def _fits(self, seq: Sequence) -> tuple[bool, object]:
        """Whether seq can bind now, counting what evicting retained checkpoints would free (a query:
        nothing is evicted here); and the prefix it would reuse. When
        nothing is resident, a prefix that holds the room it needs is given up (else a pool held by the
        very prefix a request wants would keep it out for good)."""
        if not self._free_lanes:
            return False, None
        match = (None if seq.snapshot is not None
                 else self.kv.cache.lookup(seq.cache_key(0, seq.total_len), record=False))
        keep = match.checkpoint if match else None
        residents = self._residents_need()
        if self.kv.can_fit(self._need(seq, match.length if match else 0) + residents, True, keep):
            return True, match
        if match is not None and not self.resident and self.kv.can_fit(self._need(seq, 0), True, None):
            return True, None
        return False, None

    def _with_next_token(self, tokens: int) -> int:
        """Pages for `tokens` plus the next token's KV, unless that one would not fit in the whole pool
        (a context that fills the pool produces no token past it; it must still be admitted)."""
        with_next = self.kv.pages_for(tokens + 1)
        return with_next if with_next <= self.kv.pages.num_pages else self.kv.pages_for(tokens)

    def _bind(self, plan: StepPlan, seq: Sequence, match, restored: bool) -> None:
        """Make room, bind a lane and a slot, and plan the restore or the prefix copy. A restore takes its
        pages now; a fresh request reserves its pages as it runs, pausing younger ones when short."""
        keep = match.checkpoint if match else None
        self.kv.make_room(self._need(seq, match.length if match else 0), True, keep)
        seq.lane = self._free_lanes.popleft()
        self.kv.bind_slot(seq)
        seq.status = Status.PREFILL
        self.resident.append(seq)
        self.resident.sort(key=lambda s: s.order)
        admission = Admission(seq, route=("snapshot" if seq.snapshot is not None else "replay") if restored else None)
        if seq.snapshot is not None:
            plan.before.append(self.kv.plan_restore(seq))
        else:
            reused, op = self.kv.adopt_prefix(seq, match)
            seq.num_computed = reused
            admission.reused = reused
            if op is not None:
                plan.before.append(op)
        if seq.output_ids and seq.num_computed >= seq.prefill_target:
            seq.status = Status.DECODE  # a snapshot or a retained prefix covered the whole replay
        plan.admitted.append(admission)

    def admit(self, plan: StepPlan) -> None:
        """Bind paused and waiting requests that fit (the first part of `schedule`)."""
        for seq in list(self.paused):
            ok, match = self._fits(seq)
            if not ok:
                break  # restore strictly in arrival order
            self.paused.remove(seq)
            self._bind(plan, seq, match, restored=True)
        while self.waiting and self._free_lanes:
            head = self.waiting[0]
            ok, match = self._fits(head)
            if ok:
                self.waiting.popleft()
                self._bind(plan, head, match, restored=False)
                self._bypassed = 0
                continue
            if self._bypassed >= BYPASS_LIMIT:
                break
            taker = None
            for s in list(self.waiting)[1:]:
                ok, match = self._fits(s)
                if ok:
                    taker = s
                    break
            if taker is None:
                break
            self.waiting.remove(taker)
            self._bind(plan, taker, match, restored=False)
            self._bypassed += 1

    # ---- pressure -----------------------------------------------------------------------------
    def _unbind(self, seq: Sequence) -> None:
        self.kv.release(seq)
        if seq.lane is not None:
            self._free_lanes.append(seq.lane)
            seq.lane = None
        if seq in self.resident:
            self.resident.remove(seq)

    def pause(self, seq: Sequence, plan: StepPlan | None = None, snapshot: bool = True) -> None:
        """Evict a resident request (a decision of the plan being made: its snapshot copy, if the host
        budget allows one, is planned); with a snapshot it keeps its computed frontier, else it will be
        rebuilt by replay from token 0. snapshot=False: rebuilt by replay whatever the budget."""
        plan = plan or self._plan
        assert plan is not None, "pauses are decided while a step is planned"
        restore = next((op for op in plan.before if op.kind == "restore" and op.seq is seq), None)
        if restore is not None:  # restored earlier in this very step: its host snapshot is still whole
            plan.before.remove(restore)
        else:
            if seq.snapshot is None and snapshot:
                op = self.kv.plan_snapshot(seq)
                if op is not None:
                    plan.before.append(op)
            if seq.snapshot is None:
                plan.before = [op for op in plan.before if op.seq is not seq]  # its copies: moot
        plan.drop(seq)
        self._unbind(seq)
        seq.status = Status.PAUSED
        seq.paused_frontier = seq.num_computed
        if seq.snapshot is None:
            seq.num_computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.paused.append(seq)
        self.paused.sort(key=lambda s: s.order)
        plan.preempted.append(seq)

    def _reserve(self, seq: Sequence, upto: int) -> bool:
        """Give `seq` pages covering `upto` tokens, pausing younger residents when short."""
        while not self.kv.grow(seq, upto):
            victim = max((s for s in self.resident if s is not seq), key=lambda s: s.order, default=None)
            if victim is None or victim.order < seq.order:
                return False
            self.pause(victim)
        return True

    def _starve(self, plan: StepPlan, seq: Sequence) -> None:
        """No room for seq even with every younger request paused: the oldest ends at its context,
        anyone else pauses."""
        if seq is min(self.resident, key=lambda s: s.order):
            plan.drop(seq)
            plan.starved.append(seq)
        else:
            self.pause(seq, plan)

    # ---- units --------------------------------------------------------------------------------
    def _plan_decode(self, plan: StepPlan) -> None:
        for seq in list(self.resident):
            if seq.status is not Status.DECODE or seq not in self.resident:
                continue
            if self._reserve(seq, seq.num_computed + 1):
                plan.decode.append(SeqWork(seq, seq.num_computed, [seq.output_ids[-1]], decode=True,
                                           draft_budget=self._draft_budget(seq)))
            else:
                self._starve(plan, seq)
        plan.decode = [w for w in plan.decode if w.seq in self.resident]

    def _draft_budget(self, seq: Sequence) -> int:
        """Drafts a decode row may carry: within its output and context limits, and only where the pages
        for them are free (speculation never pauses or evicts anyone)."""
        if not self.draft_tokens or not speculates(seq):
            return 0
        k = min(self.draft_tokens, seq.max_tokens - len(seq.output_ids) - 1)
        if self.max_context is not None:
            k = min(k, self.max_context - seq.total_len - 1)
        while k > 0 and self.kv.pages_for(seq.num_computed + 1 + k) - len(seq.pages) > self.kv.pages.free_pages:
            k -= 1
        if k > 0:
            self.kv.grow(seq, seq.num_computed + 1 + k)
            reach = seq.num_computed + 1 + k + self.draft_reach
            if self.max_context is not None:
                reach = min(reach, self.max_context)
            # free pages only, leaving one for each resident's next token (taking the last would pause someone)
            if self.kv.pages_for(reach) - len(seq.pages) + len(self.resident) <= self.kv.pages.free_pages:
                self.kv.grow(seq, reach)
        return max(k, 0)

    def _plan_prefill(self, plan: StepPlan) -> None:
        """The oldest prefilling request's next chunk, stopped at a checkpoint position so its state can
        be captured exactly there."""
        seq = next((s for s in self.resident if s.status is Status.PREFILL and s not in plan.starved), None)
        if seq is None:
            return
        start = seq.num_computed
        end = min(start + self.prefill_chunk, seq.prefill_target)
        end = min([end] + [p for p in seq.checkpoints if start < p < end])
        if not self._reserve(seq, end):
            self._starve(plan, seq)
            return
        sample = end >= seq.prefill_target and seq.samples_after_prefill and seq.max_tokens > 0
        plan.prefill = SeqWork(seq, start, seq.tokens(start, end), sample=sample)
        if end in seq.checkpoints:
            op = self.kv.capture(seq, end, "input")
            if op is not None:
                plan.after.append(op)
