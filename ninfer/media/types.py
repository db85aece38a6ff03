"""The values media/ takes and gives: items to prepare, limits, prepared payloads, per-request stats.

Everything here pickles, so a router can call MediaPreprocessor.prepare through a Ray handle.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

from ninfer.media.errors import InvalidMediaError

Modality = Literal["image", "video"]
# Qwen3.5 vision geometry (reference section 7): 16x16 patches, 2 frames per temporal patch,
# 2x2 spatial merge into one vision token
PATCH = 16
TEMPORAL_PATCH = 2
MERGE = 2
FACTOR = PATCH * MERGE  # resized sides are multiples of this
MERGE_TOKENS = MERGE * MERGE
PATCH_DIM = 3 * TEMPORAL_PATCH * PATCH * PATCH  # 1536 values: (channel, t, y, x)

MIB = 1 << 20


@dataclass(frozen=True)
class MediaItem:
    """One image or video to prepare; `source` is an http(s) URL or a data URI."""

    modality: Modality
    source: str

    @classmethod
    def of(cls, item: Any, index: int) -> MediaItem:
        """Accept a MediaItem, an IR ImagePart/VideoPart (`type`, `source`) or a dict of those keys."""
        if isinstance(item, MediaItem):
            return item
        get = item.get if isinstance(item, dict) else lambda key: getattr(item, key, None)
        modality, source = get("modality") or get("type"), get("source")
        if modality not in ("image", "video") or not isinstance(source, str):
            raise InvalidMediaError(f"media item {index} is not an image or video with a source", item=index)
        return cls(modality, source)


@dataclass(frozen=True)
class MediaLimits:
    """Per-item and per-request resource bounds; a breach is media_budget_exceeded."""

    max_item_source_bytes: int = 256 * MIB
    max_request_source_bytes: int = 1024 * MIB
    max_image_pixels: int = 1 << 27  # decoded pixels of one image, checked from the header
    max_frame_pixels: int = 1 << 25  # one video frame (8K fits)
    max_request_decoded_pixels: int = 1 << 35  # every decoded pixel, all video frames included
    max_request_patches: int = 131072  # the Vision runtime envelope (raw patches)
    max_request_tokens: int = 32768  # the same envelope in merged tokens
    fetch_timeout_s: float = 30.0
    fetch_connect_timeout_s: float = 10.0

    @property
    def max_request_payload_bytes(self) -> int:
        return self.max_request_patches * PATCH_DIM * 2  # bf16


@dataclass(frozen=True, eq=False)
class PreparedMedia:
    """An immutable prepared vision input: what the vision tower consumes for one item.

    pixel_values is bf16 [grid_t * grid_h * grid_w, 1536] in the Hugging Face Qwen2-VL/Qwen3-VL
    patch layout; timestamps holds one time in seconds per temporal group (video only), used for
    the `<t seconds>` text before each group's placeholders.
    """

    modality: Modality
    digest: str  # SHA-256 hex of modality + acquired bytes: the cache key and the prefix identity
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    timestamps: tuple[float, ...] = ()
    decoded_pixels: int = 0

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    @property
    def num_tokens(self) -> int:
        """Merged vision tokens, i.e. placeholder pads in the prompt (t * h * w / 4)."""
        return self.num_patches // MERGE_TOKENS

    @property
    def tokens_per_group(self) -> int:
        """Pads per temporal group: a video frame pair's placeholder run."""
        _, h, w = self.grid_thw
        return h * w // MERGE_TOKENS

    @property
    def nbytes(self) -> int:
        return self.pixel_values.numel() * self.pixel_values.element_size()


def payload_bytes(grid_thw: tuple[int, int, int]) -> int:
    """Bytes of the bf16 patch tensor for a grid, known before any pixel is decoded."""
    t, h, w = grid_thw
    return t * h * w * PATCH_DIM * 2


@dataclass
class MediaStats:
    """Request-scoped figures for the request log (never process-global deltas)."""

    items: int = 0
    wall_seconds: float = 0.0  # prepare() from entry to return, gate wait included
    gate_wait_seconds: float = 0.0
    acquire_seconds: float = 0.0  # summed over items: fetch / data-URI decode
    work_seconds: float = 0.0  # summed over items: decode, resize, pack (cache builds only)
    cache_hits: int = 0
    cache_misses: int = 0
    single_flight_joins: int = 0
    source_bytes: int = 0
    decoded_pixels: int = 0
    payload_bytes: int = 0
    raw_patches: int = 0
    vision_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PreparedBatch:
    """The result of one prepare() call, items in request order.

    While `lease` is not None the payloads count against the live budget; the holder calls
    release(lease) when the engine no longer needs them.
    """

    lease: int | None
    items: list[PreparedMedia] = field(default_factory=list)
    stats: MediaStats = field(default_factory=MediaStats)
