"""The engine's context moves: reuse a retained prefix, capture a checkpoint, hand a finished
request's context to the cache, and snapshot / restore a paused request through the host budget.

Each move keeps the page and slot reference counts balanced and counts the bytes it copies
(`Counters.context_transfer_bytes`, by direction: d2d, d2h, h2d).
"""

from __future__ import annotations

import time

from ninfer.engine import transfers
from ninfer.engine.context_cache import ContextCache
from ninfer.engine.counters import Counters
from ninfer.engine.kv_pool import PagePool, PoolExhausted, SlotPool
from ninfer.engine.sequence import Sequence, Status
from ninfer.forward import ModelCache


class ContextOps:
    def __init__(self, cache: ContextCache, pages: PagePool, slots: SlotPool | None, model_cache: ModelCache,
                 counters: Counters, *, page_size: int, host_budget: int | None):
        self.cache, self.pages, self.slots = cache, pages, slots
        self.model_cache, self.counters, self.page_size = model_cache, counters, page_size
        self.hybrid = slots is not None
        self.state_image_bytes = transfers.state_bytes(model_cache)
        # host bytes for pause snapshots: --host-context-mib, else 8 GiB plus 8 state images
        self.host_budget = host_budget if host_budget is not None else 8 * 2**30 + 8 * self.state_image_bytes
        self.host_used = 0

    def reuse_prefix(self, seq: Sequence) -> int:
        """Start `seq` from the longest retained prefix of its tokens; returns the reused length."""
        match, seq.match = seq.match, None
        self.cache.record(match)
        if match is None or match.checkpoint not in self.cache.entries:
            return 0
        entry, page_size = match.checkpoint, self.page_size
        full = match.length // page_size
        shared = entry.pages[:full]
        self.pages.share(shared)
        tail: list[int] = []
        if match.length % page_size:  # a partly filled page: this request writes into it, so copy it
            try:
                tail = self.pages.allocate(1)
            except PoolExhausted:
                self.pages.release(shared)
                return 0
            transfers.copy_pages(self.model_cache, [entry.pages[full]], tail)
            self._count("d2d", kv=transfers.page_bytes(self.model_cache))
        if entry.state_slot is not None:
            transfers.copy_state(self.model_cache, entry.state_slot, seq.state_slot)
            self._count("d2d", state=self.state_image_bytes)
        seq.pages = shared + tail
        seq.num_computed = match.length
        return match.length

    def capture(self, seq: Sequence, end: int, kind: str) -> None:
        """Retain seq's first `end` tokens: share their pages and copy the recurrent state."""
        tokens = tuple(seq.tokens(0, end))
        if self.cache.has_prefix(tokens):
            return
        slot = None
        if self.hybrid:
            if self.slots.free_slots == 0 and not self.cache.evict_for_slot():
                return  # best effort: no slot to hold the state
            slot = self.slots.allocate()
            transfers.copy_state(self.model_cache, seq.state_slot, slot)
            self._count("d2d", state=self.state_image_bytes)
        pages = seq.pages[: self.pages.pages_for(end)]
        self.pages.share(pages)
        self.cache.add(tokens, pages, slot, kind)

    def retain_endpoint(self, seq: Sequence) -> None:
        """Hand a finished request's pages and state slot to the cache (no copy)."""
        n = seq.num_computed
        if not (self.cache.enabled and seq.request.retain_endpoint and n > 0 and seq.pages):
            return
        keep = self.pages.pages_for(n)
        self.pages.release(seq.pages[keep:])
        pages, slot = seq.pages[:keep], seq.state_slot
        seq.pages, seq.state_slot = [], None
        self.cache.add(tuple(seq.tokens(0, n)), pages, slot, "endpoint", session=seq.request.session_key)

    def snapshot_on_pause(self, seq: Sequence) -> None:
        """Copy a pausing request's pages and state to the host when the budget allows; otherwise it
        is rebuilt later by replay."""
        seq.t_paused = time.monotonic()
        n = seq.num_computed
        if n == 0 or not seq.pages:
            return
        pages = seq.pages[: self.pages.pages_for(n)]
        need = transfers.snapshot_bytes(self.model_cache, len(pages), self.hybrid)
        if self.host_used + need > self.host_budget:
            return
        seq.snapshot = transfers.to_host(self.model_cache, pages, seq.state_slot)
        self.host_used += seq.snapshot.nbytes
        self.counters.transfer_bytes_d2h += seq.snapshot.nbytes
        self.counters.host_context_peak_bytes = max(self.counters.host_context_peak_bytes, self.host_used)
        self._count_snapshot("d2h", seq.snapshot)

    def restore_snapshot(self, seq: Sequence) -> None:
        snap = seq.snapshot
        seq.pages = self.pages.allocate(snap.num_pages)
        transfers.from_host(self.model_cache, snap, seq.pages, seq.state_slot)
        self.free_snapshot(seq)
        self.counters.transfer_bytes_h2d += snap.nbytes
        self._count_snapshot("h2d", snap)
        self.counters.snapshot_restores += 1
        if seq.output_ids and seq.num_computed >= seq.prefill_target:
            seq.status = Status.DECODE

    def free_snapshot(self, seq: Sequence) -> None:
        if seq.snapshot is not None:
            self.host_used -= seq.snapshot.nbytes
            seq.snapshot = None

    def _count(self, direction: str, kv: int = 0, state: int = 0) -> None:
        moved = self.counters.context_transfer_bytes
        moved[f"main_kv_{direction}"] += kv
        moved[f"state_{direction}"] += state

    def _count_snapshot(self, direction: str, snap: transfers.HostSnapshot) -> None:
        def size(*tensors):
            return sum(t.numel() * t.element_size() for t in tensors if t is not None)

        self._count(direction, kv=size(snap.k, snap.v, snap.k_scale, snap.v_scale), state=size(snap.conv, snap.ssm))
