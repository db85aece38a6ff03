"""Retained prefixes ("checkpoints") that later requests may reuse; bookkeeping only, no tensors.

A checkpoint is the exact token prefix it was computed from, the KV pages holding it (shared
through page reference counts) and, for hybrid models, a state slot holding the recurrent state
captured exactly at its end. Reuse rules:
- attention-only models: any page-aligned prefix of a checkpoint that matches the prompt;
- hybrid models: only the checkpoint's own length (recurrent state exists only where captured).
Reuse never covers the whole prompt: the last prompt token is always computed, for its logits.

Checkpoints hold pool resources, which the KV manager (ninfer.engine.kv_manager) owns: this index
only says which pages and slot each checkpoint holds, and hands a dropped checkpoint to `on_drop`
(the manager releases its resources). Checkpoints are reclaimed least-recently-used first, before
any running request is paused.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

MAX_CHECKPOINTS = 64


@dataclass
class Checkpoint:
    tokens: tuple[int, ...]
    pages: list[int]
    state_slot: int | None
    kind: str  # "endpoint", "input", "candidate"
    session: str | None = None
    last_used: int = 0


@dataclass
class Match:
    checkpoint: Checkpoint
    length: int  # tokens reused


def common_prefix(a: tuple[int, ...], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class ContextCache:
    def __init__(self, page_size: int, *, hybrid: bool, enabled: bool = True,
                 max_checkpoints: int = MAX_CHECKPOINTS, on_drop: Callable[["Checkpoint"], None] | None = None):
        self.page_size = page_size
        self.on_drop = on_drop or (lambda entry: None)
        self.hybrid = hybrid
        self.enabled = enabled
        self.max_checkpoints = max_checkpoints
        self.entries: list[Checkpoint] = []
        self._clock = itertools.count(1)
        self.hits = self.misses = self.captures = self.evictions = 0
        self.pressure_evictions = 0  # of those, to make room for a request (the rest: replaced or over the cap)
        # the latest recorded selection, a gauge for the request log: hit or miss, tokens reused, checkpoint kind
        self.last_selection: dict[str, object] | None = None

    # ---- lookup ----------------------------------------------------------------------------
    def lookup(self, prompt: list[int], record: bool = True) -> Match | None:
        """The longest reusable prefix of `prompt` (at most len(prompt) - 1 tokens).

        record=False only peeks (admission sizing); the committed choice is recorded."""
        if not self.enabled:
            return None
        limit = len(prompt) - 1
        best: Match | None = None
        for entry in self.entries:
            if self.hybrid:
                n = len(entry.tokens)
                if n == 0 or n > limit or common_prefix(entry.tokens, prompt, n) != n:
                    continue
            else:
                n = common_prefix(entry.tokens, prompt, limit)
                n -= n % self.page_size  # whole pages only: no copy needed for attention models
                if n == 0:
                    continue
            if best is None or n > best.length:
                best = Match(entry, n)
        if record:
            self.record(best)
        return best

    def record(self, match: Match | None) -> None:
        if match is None:
            self.misses += 1
        else:
            self.hits += 1
            match.checkpoint.last_used = next(self._clock)
        self.last_selection = {"outcome": "miss" if match is None else "hit",
                               "reused_tokens": match.length if match else 0,
                               "checkpoint_kind": match.checkpoint.kind if match else None}

    def has_prefix(self, tokens: tuple[int, ...]) -> bool:
        return any(e.tokens == tokens for e in self.entries)

    # ---- capture -----------------------------------------------------------------------------
    def add(self, tokens: tuple[int, ...], pages: list[int], state_slot: int | None, kind: str,
            session: str | None = None) -> Checkpoint | None:
        """Adopt already-referenced pages (and slot) as a checkpoint; the caller passes ownership."""
        if not self.enabled or not tokens:
            self.on_drop(Checkpoint(tokens, pages, state_slot, kind, session))
            return None
        if session is not None:  # a session keeps only its latest endpoint
            for old in [e for e in self.entries if e.session == session]:
                self._evict(old)
        for dup in [e for e in self.entries if e.tokens == tokens]:
            self._evict(dup)  # the newer copy replaces an identical one
        entry = Checkpoint(tokens, pages, state_slot, kind, session, next(self._clock))
        self.entries.append(entry)
        self.captures += 1
        while len(self.entries) > self.max_checkpoints:
            self._evict(min(self.entries, key=lambda e: e.last_used))
        return entry

    # ---- reclaim -----------------------------------------------------------------------------
    def evict_one(self, keep: Checkpoint | None = None) -> bool:
        """Drop the least recently used checkpoint (other than `keep`); False when none is left."""
        candidates = [e for e in self.entries if e is not keep]
        if not candidates:
            return False
        self._evict(min(candidates, key=lambda e: e.last_used))
        self.pressure_evictions += 1
        return True

    def evict_for_slot(self, keep: Checkpoint | None = None) -> bool:
        """Drop the least recently used checkpoint that holds a state slot (other than `keep`)."""
        holders = [e for e in self.entries if e.state_slot is not None and e is not keep]
        if not holders:
            return False
        self._evict(min(holders, key=lambda e: e.last_used))
        self.pressure_evictions += 1
        return True

    def clear(self) -> None:
        while self.entries:
            self._evict(self.entries[0])

    def _evict(self, entry: Checkpoint) -> None:
        self.entries.remove(entry)
        self.evictions += 1
        self.on_drop(entry)

    def evictable(self, keep: Checkpoint | None = None) -> list[Checkpoint]:
        return [e for e in self.entries if e is not keep]

    @property
    def held_pages(self) -> int:
        return len({p for e in self.entries for p in e.pages})
