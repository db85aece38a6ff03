"""One request's state inside the engine."""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ninfer.engine.exposure import RequestExposure
from ninfer.engine.output_control import OutputController
from ninfer.engine.types import EngineRequest, ResolvedSampling


class Status(enum.Enum):
    WAITING = "waiting"  # not yet admitted
    PREFILL = "prefill"  # resident, computing prompt (or replaying) chunks
    DECODE = "decode"  # resident, one token per decode boundary
    PAUSED = "paused"  # evicted under pressure; rebuilt by replay
    FINISHED = "finished"


@dataclass(eq=False)  # identity: the scheduler's membership tests must not compare every field
class Sequence:
    request: EngineRequest
    order: int  # arrival order: older requests keep progressing under pressure
    sampling: ResolvedSampling
    max_tokens: int  # effective output budget
    controller: OutputController
    emit: Callable[[object], None]  # publishes events to the request's consumer
    deadline: float  # absolute admission deadline (time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose KV / recurrent state are in the cache
    cached_tokens: int = 0  # prefix reused from the context cache at admission
    pages: list[int] = field(default_factory=list)
    state_slot: int | None = None
    lane: int | None = None  # row of the penalty-count buffer
    forced: deque[int] = field(default_factory=deque)  # control tokens to commit without sampling
    checkpoints: list[int] = field(default_factory=list)  # prompt positions to capture (hybrid models)
    snapshot: object | None = None  # HostSnapshot while paused with host backing
    match: object | None = None  # context-cache Match chosen at admission, applied by the engine
    prefix_path: str = "root"  # "checkpoint" when admission reused a retained prefix
    # an input checkpoint's length reused with the page holding its last position this request's own copy:
    # the MTP head may rewrite its KV there, paired with this request's next token (MTPProposer)
    private_boundary: int | None = None
    preemptions: int = 0
    drafted: int = 0  # speculative drafts proposed for this request, and those the target accepted
    draft_accepted: int = 0
    spec_rounds: int = 0  # its decode rows that carried drafts, and those that carried none
    spec_fallback_steps: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: rounds whose draft j stood
    paused_frontier: int = 0  # tokens computed when it last paused (the request log's paused event)
    # the furthest frontier ever computed: tokens below it computed again (after a replay-route pause, even one
    # before the first output) are recovery work (replayed tokens), not prefill
    computed_high: int = 0
    # [3, prompt_len] MRoPE (t, h, w) positions of a prompt with media, and the offset text positions past
    # them take (next position = index + mrope_delta); None: text positions (the three axes agree)
    mrope: object | None = None
    mrope_delta: int = 0
    # the prompt's context-cache identity when it has media: pads replaced by (digest, grid, index in the
    # item), so prefixes with different media never match (ninfer.engine.media_inputs); None: the token ids
    prompt_key: list | None = None
    media_embeds: dict = field(default_factory=dict)  # encoded media items (by index) until prefill passes them
    vision_seconds: float = 0.0  # vision encode time (CPU), and the CUDA events of its encodes (media_inputs)
    vision_events: list = field(default_factory=list)
    cancelled: bool = False
    exposure: RequestExposure | None = None  # its share of the engine's time, while the request log is on
    t_submit: float = field(default_factory=time.monotonic)
    t_admit: float | None = None
    t_first: float | None = None
    t_last: float | None = None
    t_paused: float | None = None

    def count_round(self, drafted: int, accepted: int) -> None:
        """One verification round: `drafted` drafts, the first `accepted` of them confirmed."""
        self.spec_rounds += 1
        self.drafted += drafted
        self.draft_accepted += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position += [0] * (drafted - len(self.accepted_per_position))
        for j in range(accepted):
            self.accepted_per_position[j] += 1

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def total_len(self) -> int:
        return self.prompt_len + len(self.output_ids)

    def token_at(self, index: int) -> int:
        p = self.prompt_len
        return self.request.prompt_ids[index] if index < p else self.output_ids[index - p]

    def tokens(self, start: int, end: int) -> list[int]:
        p = self.prompt_len
        ids = self.request.prompt_ids[start:min(end, p)]
        if end > p:
            ids = ids + self.output_ids[max(start - p, 0) : end - p]
        return ids

    def cache_key(self, start: int, end: int) -> list:
        """What the context cache compares for tokens start..end: the token ids, media pads keyed by
        their media (prompt_key)."""
        if self.prompt_key is None:
            return self.tokens(start, end)
        p = self.prompt_len
        key = self.prompt_key[start:min(end, p)]
        if end > p:
            key = key + self.output_ids[max(start - p, 0) : end - p]
        return key

    def positions(self, start: int, end: int):
        """MRoPE positions [3, end - start] of tokens start..end, or None for a text-only request."""
        if self.mrope is None:
            return None
        prompt = np.asarray(self.mrope)[:, start:min(end, self.prompt_len)]
        later = np.arange(max(start, self.prompt_len), end, dtype=np.int64) + self.mrope_delta
        return np.concatenate([prompt, np.broadcast_to(later, (3, len(later)))], axis=1)

    def recomputed(self, start: int, end: int) -> int:
        """Of the tokens [start, end), how many were computed before (recovery after a pause)."""
        return max(0, min(end, self.computed_high) - start)

    @property
    def prefill_target(self) -> int:
        """How far prefill must compute: the whole prompt, or for a replay all but the last token
        (which becomes the next decode input, so nothing is resampled)."""
        return self.total_len if not self.output_ids else self.total_len - 1

    @property
    def samples_after_prefill(self) -> bool:
        return not self.output_ids
