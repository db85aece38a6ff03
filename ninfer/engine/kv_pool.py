"""The only owner of KV pages and recurrent-state slots.

Pages carry reference counts so that retained prefixes (context cache) can share them with
running requests; a page returns to the free list when its last holder lets go.
"""

from __future__ import annotations

from collections import deque


class PoolExhausted(Exception):
    pass


class PagePool:
    """Pages are handed out first-freed-first (a deque), except that a fresh sequence starts at the longest run
    of free pages and a growing sequence gets the pages right after its last one while they are free: a
    sequence's pages then tend to be consecutive, which lets the CPU reference attention read its context as
    one view instead of run by run (kernels.attention)."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError("the KV pool needs at least one page of at least one token")
        self.num_pages = num_pages
        self.page_size = page_size
        self._order: deque[int] = deque(range(num_pages))  # may hold pages taken since (skipped when met)
        self._free: set[int] = set(range(num_pages))
        self._refs = [0] * num_pages

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, tokens: int) -> int:
        return (tokens + self.page_size - 1) // self.page_size

    def allocate(self, count: int, after: int | None = None) -> list[int]:
        """All-or-nothing: a unit either gets every page it needs or none. after: the sequence's last page,
        whose free successors come first."""
        if count > len(self._free):
            raise PoolExhausted(f"need {count} pages, {len(self._free)} free")
        pages = []
        nxt = self._longest_free_run() if after is None and count > 1 else -1 if after is None else after + 1
        while len(pages) < count and nxt in self._free:
            pages.append(nxt)
            self._free.discard(nxt)
            nxt += 1
        while len(pages) < count:
            p = self._order.popleft()
            if p in self._free:
                pages.append(p)
                self._free.discard(p)
        for p in pages:
            self._refs[p] = 1
        return pages

    def _longest_free_run(self) -> int:
        """The first page of the longest run of consecutive free pages (where a fresh sequence starts, so that
        it and its growth stay one run: the CPU attention then reads its context as one view)."""
        best, best_len, start, prev = -1, 0, -1, -2
        for p in sorted(self._free):
            if p != prev + 1:
                start = p
            prev = p
            if p - start + 1 > best_len:
                best, best_len = start, p - start + 1
        return best

    def share(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"page {p} is not allocated")
            self._refs[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"page {p} released twice")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.add(p)
                self._order.append(p)
        if len(self._order) > 2 * self.num_pages:  # drop the entries of pages taken out of order
            self._order = deque(p for p in self._order if p in self._free)
            self._order = deque(dict.fromkeys(self._order))

    def refcount(self, page: int) -> int:
        return self._refs[page]


class SlotPool:
    """Recurrent-state slots (hybrid models): max_concurrency + device_state_slots of them.

    A speculative rollback may trade a held slot for one of the runner's verify slots (`exchange`): the
    pool's slots are then a different set of the cache's rows, always as many."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._slots = set(range(num_slots))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def members(self) -> frozenset[int]:
        """The cache rows that are the pool's slots now."""
        return frozenset(self._slots)

    def allocate(self) -> int:
        if not self._free:
            raise PoolExhausted("no free state slot")
        return self._free.popleft()

    def release(self, slot: int) -> None:
        if slot in self._free or slot not in self._slots:
            raise ValueError(f"state slot {slot} released twice or unknown")
        self._free.append(slot)

    def exchange(self, held: int, replacement: int) -> None:
        """The holder of `held` now holds `replacement`, a cache row outside the pool, which takes its
        place; `held` leaves the pool (the runner keeps it as a verify slot)."""
        if held not in self._slots or held in self._free or replacement in self._slots:
            raise ValueError(f"state slot {held} is not held, or {replacement} is already the pool's")
        self._slots.remove(held)
        self._slots.add(replacement)
