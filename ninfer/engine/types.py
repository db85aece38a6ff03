"""What goes into the engine and what comes out of it. No HTTP here: the server maps errors to statuses."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SamplingParams:
    """Per-request sampler settings; None means 'not given' so presets and process flags apply."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0..20; 0 selects the cap of 20
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None


@dataclass(frozen=True)
class ResolvedSampling:
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    seed: int

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        """Whether the sampler reads this request's generated-token counts (presence/frequency)."""
        return bool(self.presence_penalty or self.frequency_penalty)


@dataclass
class MediaInput:
    """One prepared image or video of a prompt: its pads' place and the vision tower's input.

    `group_starts` holds the token index of each pad run (one for an image, one per temporal group
    for a video, whose groups are separated by timestamp text); `start` is the first of them and
    `num_tokens` counts every pad of the item. `pixel_values` is the bf16 patch tensor
    [t*h*w, 1536] (ninfer.media); `digest` identifies the media in the prefix cache.
    """

    start: int
    num_tokens: int
    grid_thw: tuple[int, int, int]
    kind: str  # "image" | "video"
    digest: str
    pixel_values: Any  # torch.Tensor; typed loosely so this module needs no torch import
    group_starts: list[int] = field(default_factory=list)


@dataclass
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None  # None: the server default; 0: prompt processing only
    stop: list[str] = field(default_factory=list)  # up to 4 non-empty strings
    thinking: bool = False  # the prompt ends inside an open reasoning block
    thinking_budget: int | None = None  # cap on reasoning-channel tokens; None: process default
    return_progress: bool = False
    checkpoints: list[int] = field(default_factory=list)  # prompt positions worth retaining (input boundary, cache hints)
    session_key: str | None = None  # a conversation chain: its latest endpoint is retained
    retain_endpoint: bool = True  # capture the endpoint after the response (store:false children: False)
    media: list[MediaInput] = field(default_factory=list)  # prompt images/videos in prompt order (vision)


@dataclass
class ThinkingControl:
    """Token ids the engine needs to follow and close a reasoning block."""

    think_end_id: int | None  # </think>; None: the model has no reasoning channel
    think_start_id: int | None = None
    close_suffix: list[int] = field(default_factory=list)  # guidance + </think>, committed at the budget


class Channel(str, enum.Enum):
    REASONING = "reasoning"
    ANSWER = "answer"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end-of-turn / EOS token
    STOP_STRING = "stop_string"
    LENGTH = "length"  # max output tokens reached
    CONTEXT = "context"  # the sequence reached max_context
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass
class TokenEvent:
    """Newly committed tokens of one channel and the text that is now safe to show."""

    token_ids: list[int]
    channel: Channel
    text: str
    forced: bool = False  # committed without sampling (thinking-budget control suffix)
    # when its tokens were committed, in ms since admission on the engine's clock: the terminal timings' clock,
    # so a live snapshot (timings_per_token) reads what the finish will (None: no tokens committed with it)
    elapsed_ms: float | None = None


@dataclass
class ProgressEvent:
    total: int
    cache: int
    processed: int
    time_ms: float


@dataclass
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int


@dataclass
class Timings:
    cache_n: int
    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    draft_n: int | None = None  # speculative requests that drafted: drafts proposed, and those accepted
    draft_n_accepted: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """The llama.cpp timings object; zero-count or zero-duration cases give finite zero rates."""

        def rate(n: float, ms: float) -> float:
            return n * 1000.0 / ms if n > 0 and ms > 0 else 0.0

        def per(ms: float, n: float) -> float:
            return ms / n if n > 0 and ms > 0 else 0.0

        intervals = max(self.predicted_n - 1, 0)
        drafts = {} if self.draft_n is None else {"draft_n": self.draft_n, "draft_n_accepted": self.draft_n_accepted}
        return {
            "cache_n": self.cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": per(self.prompt_ms, self.prompt_n),
            "prompt_per_second": rate(self.prompt_n, self.prompt_ms),
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": per(self.predicted_ms, intervals),
            "predicted_per_second": rate(intervals, self.predicted_ms),
            **drafts,
        }


@dataclass
class FinishEvent:
    reason: FinishReason
    usage: Usage
    timings: Timings
    stop_string: str | None = None  # the matched stop string, withheld from the text
    thinking_budget_applied: bool = False
    preemptions: int = 0
    prefix_reuse_path: str = "root"  # "checkpoint" when a retained prefix was reused
    error: str | None = None
    # a speculative engine's counts for this request (rounds, drafted_tokens, accepted_tokens,
    # fallback_steps, accepted_per_position); None without speculative decoding
    speculative: dict[str, Any] | None = None
    vision_seconds: float = 0.0  # time the vision tower spent encoding this request's media
    # with the request log on (exposure.RequestExposure): the request's share of the engine's time, the
    # observations at its first output, and its own pause/restore work; None otherwise
    engine_timing: dict[str, Any] | None = None
    first_output_timing: dict[str, Any] | None = None
    scheduling: dict[str, Any] | None = None
    work: dict[str, Any] | None = None  # gpu_seconds: the device time of its prefill intervals
    context_transfers: dict[str, Any] | None = None  # its own context copies, by direction


@dataclass
class SchedulingEvent:
    """A pause-cycle boundary of one request, for the request log (only with EngineSettings.scheduling_events).

    kind: pause_started (the plan pauses it), paused (its snapshot copy is under way, or nothing to copy),
    restore_started, restored (likewise), replay_complete, recovery_complete, or terminal (a preempted request
    ended). A snapshot is never revoked here (a pause without host room takes the replay route), so there is no
    snapshot_revoked.
    route: snapshot or replay; None where no route applies. steady_ns is the engine's monotonic clock and
    elapsed_ns counts from submission. Token counters are cumulative: global ones for the whole engine.
    """

    kind: str
    preemption_index: int
    route: str | None
    steady_ns: int
    elapsed_ns: int
    global_tokens: dict[str, int]
    request_tokens: dict[str, int]


class EngineError(Exception):
    """A request the engine cannot take; `code` is the contract's error code."""

    code = "engine_error"


class ServerOverloadedError(EngineError):
    code = "server_overloaded"


class QueueTimeoutError(EngineError):
    code = "request_queue_timeout"


class ContextLengthExceededError(EngineError):
    code = "context_length_exceeded"

    def __init__(self, prompt_tokens: int, max_context: int):
        super().__init__(
            f"the prompt has {prompt_tokens} tokens, more than the context limit of {max_context} tokens"
        )
        self.prompt_tokens = prompt_tokens
        self.max_context = max_context


class ThinkingBudgetCapacityError(EngineError):
    code = "thinking_budget_capacity_insufficient"


class InvalidRequestError(EngineError):
    code = "invalid_request"


class VisionDisabledError(InvalidRequestError):
    """Media in a request to an engine without a vision tower (started without --vision)."""

    code = "vision_disabled"


class EngineUnavailableError(EngineError):
    code = "engine_unavailable"
