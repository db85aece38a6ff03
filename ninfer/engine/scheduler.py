"""Decides what runs next; never touches tensors.

Policy (contract, "Execution behavior"):
- up to `max_concurrency` resident requests; FIFO admission with a bounded bypass when the head
  cannot fit; paused requests are restored in arrival order before fresh ones, but fresh requests
  that fit still run while a paused one waits for room;
- one request prefills at a time, in chunks; every decode-ready request joins one decode batch;
- before a unit runs its pages are reserved; if the pool is short, the youngest resident request
  is paused (its pages and state slot returned, rebuilt later by replay), never the oldest.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from ninfer.engine.context_cache import ContextCache
from ninfer.engine.kv_pool import PagePool, PoolExhausted, SlotPool
from ninfer.engine.sequence import Sequence, Status

BYPASS_LIMIT = 4  # fresh requests that may overtake a head that does not fit


@dataclass
class PrefillUnit:
    seq: Sequence
    start: int
    end: int

    @property
    def is_last(self) -> bool:
        return self.end >= self.seq.prefill_target


class Scheduler:
    def __init__(self, *, max_concurrency: int, prefill_chunk: int, pages: PagePool, slots: SlotPool | None,
                 cache: ContextCache | None = None):
        self.max_concurrency = max_concurrency
        self.cache = cache or ContextCache(pages, slots, hybrid=slots is not None, enabled=False)
        self.before_pause: Callable[[Sequence], None] | None = None  # host snapshot hook (engine)
        self.prefill_chunk = prefill_chunk
        self.pages = pages
        self.slots = slots
        self.waiting: deque[Sequence] = deque()
        self.paused: list[Sequence] = []
        self.resident: list[Sequence] = []  # admitted: prefilling or decoding, in arrival order
        self._free_lanes = deque(range(max_concurrency))
        self._bypassed = 0
        self.preemptions = 0

    # ---- admission -------------------------------------------------------------------------
    def _fits(self, seq: Sequence, promised: int = 0) -> int | None:
        """A free lane, a state slot and pages for the saved frontier (a snapshot restore) or the
        first unit after the reusable prefix, plus one more token, beyond the `promised` pages that
        this round's earlier snapshot restores will take (a restore allocates its pages outright once
        admitted; fresh requests reserve theirs as they run, pausing younger ones when short).
        Retained checkpoints other than the one this request will reuse are reclaimed to make room;
        when nothing is resident, that one too (else a pool held by the very prefix a request wants
        would keep it out for good). Returns the pages it needs, or None."""
        if not self._free_lanes:
            return None
        match = None
        if seq.snapshot is None:
            match = self.cache.lookup(seq.tokens(0, seq.total_len), record=False)
        need = self._make_room(seq, match, promised)
        if need is None and match is not None and not self.resident:
            match = None  # nothing running will free pages: give up the reuse rather than wait forever
            need = self._make_room(seq, None, promised)
        if need is not None:
            seq.match = match
        return need

    def _make_room(self, seq: Sequence, match, promised: int) -> int | None:
        """Evict retained checkpoints other than `match`'s until seq's slot and pages fit; the pages
        it needs, or None when they cannot."""
        keep = match.checkpoint if match else None
        while self.slots is not None and self.slots.free_slots == 0:
            if not self.cache.evict_for_slot(keep=keep):
                return None
        if seq.snapshot is not None:
            need = self._with_next_token(seq.num_computed)
        else:
            reused = match.length if match else 0
            end = min(seq.prefill_target, reused + self.prefill_chunk)
            need = self._with_next_token(end) - reused // self.pages.page_size
        while promised + need > self.pages.free_pages:
            if not self.cache.evict_one(keep=keep):
                return None
        return need

    def _with_next_token(self, tokens: int) -> int:
        """Pages for `tokens` plus the next token's KV, unless that one would not fit in the whole pool
        (a context that fills the pool produces no token past it; it must still be admitted)."""
        with_next = self.pages.pages_for(tokens + 1)
        return with_next if with_next <= self.pages.num_pages else self.pages.pages_for(tokens)

    def _bind(self, seq: Sequence) -> None:
        seq.lane = self._free_lanes.popleft()
        seq.state_slot = self.slots.allocate() if self.slots is not None else None
        seq.status = Status.PREFILL
        self.resident.append(seq)
        self.resident.sort(key=lambda s: s.order)

    def admit(self) -> list[Sequence]:
        """Bind paused and waiting requests that fit; returns the newly resident ones."""
        admitted = []
        promised = 0  # pages this round's snapshot restores will allocate
        for seq in list(self.paused):
            need = self._fits(seq, promised)
            if need is None:
                break  # restore strictly in arrival order
            self.paused.remove(seq)
            self._bind(seq)
            admitted.append(seq)
            if seq.snapshot is not None:
                promised += need
            elif seq.match is not None and seq.match.length % self.pages.page_size:
                promised += 1  # a replay that reuses a partly filled page copies it into a new one
        while self.waiting and self._free_lanes:
            head = self.waiting[0]
            if self._fits(head, promised) is not None:
                self.waiting.popleft()
                self._bind(head)
                admitted.append(head)
                self._bypassed = 0
                continue
            if self._bypassed >= BYPASS_LIMIT:
                break
            taker = next((s for s in list(self.waiting)[1:] if self._fits(s, promised) is not None), None)
            if taker is None:
                break
            self.waiting.remove(taker)
            self._bind(taker)
            admitted.append(taker)
            self._bypassed += 1
        return admitted

    # ---- resource release ------------------------------------------------------------------
    def release(self, seq: Sequence) -> None:
        """Return everything a resident request holds (finish, cancel or pause)."""
        if seq.pages:
            self.pages.release(seq.pages)
            seq.pages = []
        if seq.state_slot is not None and self.slots is not None:
            self.slots.release(seq.state_slot)
        seq.state_slot = None
        if seq.lane is not None:
            self._free_lanes.append(seq.lane)
            seq.lane = None
        if seq in self.resident:
            self.resident.remove(seq)

    def remove(self, seq: Sequence) -> None:
        self.release(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.paused:
            self.paused.remove(seq)

    def pause(self, seq: Sequence) -> None:
        """Evict a resident request; with a host snapshot it keeps its computed frontier, else it
        will be rebuilt by replay from token 0."""
        if self.before_pause is not None:
            self.before_pause(seq)
        self.release(seq)
        seq.status = Status.PAUSED
        if seq.snapshot is None:
            seq.num_computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.paused.append(seq)
        self.paused.sort(key=lambda s: s.order)

    def _reserve(self, seq: Sequence, upto: int) -> bool:
        """Give `seq` pages covering `upto` tokens, pausing younger residents when short."""
        need = self.pages.pages_for(upto) - len(seq.pages)
        while need > self.pages.free_pages and self.cache.evict_one():
            pass  # retained prefixes go before any running request pauses
        while need > self.pages.free_pages:
            victim = max((s for s in self.resident if s is not seq), key=lambda s: s.order, default=None)
            if victim is None or victim.order < seq.order:
                return False
            self.pause(victim)
        if need > 0:
            try:
                seq.pages += self.pages.allocate(need)
            except PoolExhausted:
                return False
        return True

    # ---- units -----------------------------------------------------------------------------
    def next_prefill(self) -> PrefillUnit | Sequence | None:
        """The oldest prefilling request's next chunk; returns the Sequence itself if it cannot get pages
        even after pausing every younger request (the caller pauses or finishes it)."""
        for seq in self.resident:
            if seq.status is Status.PREFILL:
                end = min(seq.num_computed + self.prefill_chunk, seq.prefill_target)
                # stop a chunk at a checkpoint position so its state can be captured exactly there
                end = min([end] + [p for p in seq.checkpoints if seq.num_computed < p < end])
                if not self._reserve(seq, end):
                    return seq
                return PrefillUnit(seq, seq.num_computed, end)
        return None

    def decode_batch(self) -> tuple[list[Sequence], list[Sequence]]:
        """(decode-ready requests that got room for one more token, requests that could not)."""
        ready, starved = [], []
        for seq in list(self.resident):
            if seq.status is not Status.DECODE or seq not in self.resident:
                continue
            if self._reserve(seq, seq.num_computed + 1):
                ready.append(seq)
            else:
                starved.append(seq)
        return [s for s in ready if s in self.resident], starved

    @property
    def running(self) -> int:
        return len(self.resident)
