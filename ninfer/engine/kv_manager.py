"""The one owner of KV pages, recurrent-state slots and the host snapshot budget.

Requests (Sequence.pages / state_slot) and retained checkpoints (ContextCache entries) only hold
what this manager hands them; every allocation, share and release goes through here. Decisions are
bookkeeping: where a decision needs bytes moved (a reused prefix's tail page and StateImage, a
checkpoint capture, a pause snapshot, a restore), the manager returns a ContextOp for the plan and
the context executor (ninfer.engine.context_ops) performs it.
"""

from __future__ import annotations

from collections import Counter

from ninfer.engine.context_cache import Checkpoint, ContextCache, Match
from ninfer.engine.context_cost import ContextCosts
from ninfer.engine.kv_pool import PagePool, PoolExhausted, SlotPool
from ninfer.engine.plan import ContextOp
from ninfer.engine.sequence import Sequence


class KVManager:
    def __init__(self, pages: PagePool, slots: SlotPool | None, *, prefix_reuse: bool = False,
                 host_budget: int = 0, snapshot_bytes=None, private_boundary: bool = False,
                 costs: ContextCosts | None = None):
        """snapshot_bytes(num_pages, has_state): host bytes of a pause snapshot (None: no snapshots).
        costs: what each pause route costs (None: a snapshot whenever the host has room).
        private_boundary: a request reusing an input checkpoint gets its own copy of the page holding the
        checkpoint's last position, also when that page is full (the MTP head's KV there pairs the position
        with the next token, which is the request's own: MTPProposer rewrites it)."""
        self.private_boundary = private_boundary
        self.pages = pages
        self.slots = slots
        self.hybrid = slots is not None
        self.cache = ContextCache(pages.page_size, hybrid=self.hybrid, enabled=prefix_reuse, on_drop=self._drop)
        self.host_budget = host_budget
        self.host_used = 0
        self._snapshot_bytes = snapshot_bytes
        self.costs = costs
        self.replay_by_cost = 0  # pauses with host room that replay because recomputing costs less

    @property
    def page_size(self) -> int:
        return self.pages.page_size

    def pages_for(self, tokens: int) -> int:
        return self.pages.pages_for(tokens)

    # ---- what could be freed (queries: nothing changes) -------------------------------------
    def reclaimable_pages(self, keep: Checkpoint | None = None) -> int:
        """Pages that evicting every checkpoint but `keep` would return to the free list."""
        refs = Counter(p for e in self.cache.evictable(keep) for p in e.pages)
        return sum(1 for p, n in refs.items() if self.pages.refcount(p) == n)

    def can_fit(self, pages: int, slot: bool, keep: Checkpoint | None = None) -> bool:
        """Whether `pages` pages and, if asked, a state slot can be had, counting
        what evicting retained checkpoints other than `keep` would free."""
        if slot and self.slots is not None and self.slots.free_slots == 0:
            if not any(e.state_slot is not None for e in self.cache.evictable(keep)):
                return False
        if pages <= self.pages.free_pages:
            return True  # the common case: no need to walk the checkpoints' pages
        return pages <= self.pages.free_pages + self.reclaimable_pages(keep)

    # ---- making room (decisions that evict) -------------------------------------------------
    def make_room(self, pages: int, slot: bool, keep: Checkpoint | None = None) -> bool:
        """Evict checkpoints other than `keep`, least recently used first, until a slot (if asked) and
        `pages` pages are free."""
        while slot and self.slots is not None and self.slots.free_slots == 0:
            if not self.cache.evict_for_slot(keep=keep):
                return False
        while pages > self.pages.free_pages:
            if not self.cache.evict_one(keep=keep):
                return False
        return True

    def grow(self, seq: Sequence, upto: int) -> bool:
        """Give seq pages covering `upto` tokens from the free list (checkpoints evicted first); False
        when even that leaves too few (the scheduler then pauses a younger request)."""
        need = self.pages_for(upto) - len(seq.pages)
        if need <= 0:
            return True
        self.make_room(need, slot=False)
        if need > self.pages.free_pages:
            return False
        seq.pages += self.pages.allocate(need, after=seq.pages[-1] if seq.pages else None)
        return True

    # ---- binding and release ------------------------------------------------------------------
    def bind_slot(self, seq: Sequence) -> None:
        seq.state_slot = self.slots.allocate() if self.slots is not None else None

    def release(self, seq: Sequence) -> None:
        """Return everything a request holds (finish, cancel or pause)."""
        if seq.pages:
            self.pages.release(seq.pages)
            seq.pages = []
        if seq.state_slot is not None and self.slots is not None:
            self.slots.release(seq.state_slot)
        seq.state_slot = None

    def _drop(self, entry: Checkpoint) -> None:
        """A checkpoint left the index: free what it held."""
        if entry.pages:
            self.pages.release(entry.pages)
        if entry.state_slot is not None and self.slots is not None:
            self.slots.release(entry.state_slot)

    # ---- prefix reuse and checkpoints ---------------------------------------------------------
    def adopt_prefix(self, seq: Sequence, match: Match | None) -> tuple[int, ContextOp | None]:
        """Start seq (bound, no pages yet) from a retained prefix: share its whole pages, give it a copy of
        a partly filled tail page and of the StateImage. Returns (tokens reused, the copy to run)."""
        self.cache.record(match)
        if match is None or match.checkpoint not in self.cache.entries:
            return 0, None
        entry, page_size = match.checkpoint, self.page_size
        full = match.length // page_size
        boundary = self.private_boundary and entry.kind == "input"
        if boundary and not match.length % page_size and self.pages.free_pages > 0:
            full -= 1  # the full page ending at the checkpoint: copied below like a partly filled one
        shared = entry.pages[:full]
        self.pages.share(shared)
        op = ContextOp("copy", seq)
        tail: list[int] = []
        if full * page_size < match.length:  # a partly filled page (this request writes into it) or the boundary's
            try:
                tail = self.pages.allocate(1)
            except PoolExhausted:
                self.pages.release(shared)
                return 0, None
            op.src_pages, op.dst_pages = [entry.pages[full]], tail
            if boundary:
                seq.private_boundary = match.length
        if entry.state_slot is not None:
            op.src_slot, op.dst_slot = entry.state_slot, seq.state_slot
        seq.pages = shared + tail
        return match.length, op if (op.src_pages or op.src_slot is not None) else None

    def capture(self, seq: Sequence, end: int, kind: str) -> ContextOp | None:
        """Retain seq's first `end` tokens as a checkpoint: share their pages; for a hybrid model a new
        slot receives a copy of the state (the returned op, run once the state is at `end`)."""
        tokens = tuple(seq.cache_key(0, end))
        if self.cache.has_prefix(tokens):
            return None
        slot = None
        if self.hybrid:
            if self.slots.free_slots == 0 and not self.cache.evict_for_slot():
                return None  # best effort: no slot to hold the state
            slot = self.slots.allocate()
        pages = seq.pages[: self.pages_for(end)]
        self.pages.share(pages)
        self.cache.add(tokens, pages, slot, kind)
        return ContextOp("capture", seq, src_slot=seq.state_slot, dst_slot=slot) if slot is not None else None

    def retains_endpoint(self, seq: Sequence) -> bool:
        """Whether `retain_endpoint` would hand this request's context to the cache."""
        return bool(self.cache.enabled and seq.request.retain_endpoint and seq.num_computed > 0 and seq.pages)

    def retain_endpoint(self, seq: Sequence) -> None:
        """Hand a finished request's pages and state slot to the cache (no copy)."""
        if not self.retains_endpoint(seq):
            return
        n = seq.num_computed
        keep = self.pages_for(n)
        self.pages.release(seq.pages[keep:])
        pages, slot = seq.pages[:keep], seq.state_slot
        seq.pages, seq.state_slot = [], None
        self.cache.add(tuple(seq.cache_key(0, n)), pages, slot, "endpoint", session=seq.request.session_key)

    # ---- host snapshots -----------------------------------------------------------------------
    def plan_snapshot(self, seq: Sequence) -> ContextOp | None:
        """Reserve host bytes for a pausing request's pages and state; the op copies them. None when the
        budget is short or recomputing the request costs less than the copies (it will be rebuilt by replay)."""
        n = seq.num_computed
        if self._snapshot_bytes is None or n == 0 or not seq.pages:
            return None
        pages = seq.pages[: self.pages_for(n)]
        need = self._snapshot_bytes(len(pages), self.hybrid)
        if self.host_used + need > self.host_budget:
            return None
        if self.costs is not None and self.costs.replay_seconds(n) < self.costs.snapshot_seconds(need):
            self.replay_by_cost += 1
            return None
        self.host_used += need
        seq.snapshot = PendingSnapshot(need)
        return ContextOp("snapshot", seq, src_pages=list(pages), src_slot=seq.state_slot)

    def plan_restore(self, seq: Sequence) -> ContextOp:
        """Pages for a paused request's snapshot frontier (its slot is bound); the op copies the bytes in."""
        seq.pages = self.pages.allocate(self.pages_for(seq.num_computed))
        return ContextOp("restore", seq, dst_pages=list(seq.pages), dst_slot=seq.state_slot)

    def free_snapshot(self, seq: Sequence) -> None:
        if seq.snapshot is not None:
            self.host_used -= seq.snapshot.nbytes
            seq.snapshot = None


class PendingSnapshot:
    """Host bytes reserved for a snapshot the plan has not copied yet (the executor swaps in the
    HostSnapshot of the same size)."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
