"""Video: decode with PyAV, sample frames as Qwen's video processor, resize, pack, timestamp.

Sampling: fps 2 over the clip (uniform indices by linspace), at least 4 and at most 768 frames,
never more than the clip has; an odd count repeats its last frame when packed. Each temporal group
(a frame pair) gets the mean time of its two frames, for the `<t seconds>` text.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass

import av
import numpy as np
from PIL import Image

from ninfer.media import patches
from ninfer.media.errors import InvalidMediaError, MediaBudgetExceededError
from ninfer.media.types import TEMPORAL_PATCH, MediaLimits, PreparedMedia, payload_bytes

SAMPLE_FPS = 2.0
MIN_FRAMES = 4
MAX_FRAMES = 768
DEFAULT_FPS = 24.0  # the reference's assumption when the container has no frame rate


@dataclass(frozen=True)
class VideoConfig:
    sample_fps: float = SAMPLE_FPS
    min_frames: int = MIN_FRAMES
    max_frames: int = MAX_FRAMES
    min_pixels: int = patches.VIDEO_MIN_PIXELS
    max_pixels: int = patches.VIDEO_MAX_PIXELS
    cap_pixels_per_frame: bool = True  # qwen-vl-utils' behaviour, the transformers default to come


def sample_indices(total_frames: int, video_fps: float, cfg: VideoConfig = VideoConfig()) -> np.ndarray:
    """Indices of the frames to keep, in order."""
    wanted = int(total_frames / video_fps * cfg.sample_fps)
    count = min(max(wanted, cfg.min_frames), cfg.max_frames, total_frames)
    return np.linspace(0, total_frames - 1, count).round().astype(int)


def group_timestamps(indices: np.ndarray, video_fps: float) -> tuple[float, ...]:
    """Seconds per temporal group: the mean of its first and last frame's time."""
    idx = list(indices.tolist())
    idx += [idx[-1]] * (-len(idx) % TEMPORAL_PATCH)  # padded frames repeat the last
    times = [i / video_fps for i in idx]
    return tuple((times[i] + times[i + TEMPORAL_PATCH - 1]) / 2 for i in range(0, len(times), TEMPORAL_PATCH))


@dataclass(frozen=True)
class _Probe:
    width: int
    height: int
    fps: float
    frames: int


def _open(data: bytes):
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, ValueError, OSError, EOFError):
        raise InvalidMediaError("the video bytes are not a readable video container") from None
    if not container.streams.video:
        container.close()
        raise InvalidMediaError("the video has no video stream")
    return container


def probe(data: bytes) -> _Probe:
    """Frame size, rate and count from the container, counting packets when it does not say."""
    with _open(data) as container:
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate else DEFAULT_FPS
        frames = stream.frames
        if frames <= 0:
            try:
                frames = sum(1 for packet in container.demux(stream) if packet.size)
            except (av.FFmpegError, ValueError, OSError, EOFError):
                raise InvalidMediaError("the video stream could not be read") from None
    if width < 1 or height < 1 or frames < 1:
        raise InvalidMediaError("the video has no frames")
    return _Probe(width, height, fps, frames)


def _decode(data: bytes, indices: np.ndarray, size: tuple[int, int]) -> tuple[list[np.ndarray], int]:
    """The wanted frames resized to (h, w) as uint8 RGB, and how many frames the stream really had.
    Frames are resized as they decode, so memory holds only the kept, resized frames."""
    want: dict[int, list[int]] = {}
    for pos, index in enumerate(indices.tolist()):
        want.setdefault(index, []).append(pos)
    kept: list[np.ndarray | None] = [None] * len(indices)
    last = max(want)
    seen = 0
    with _open(data) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        try:
            for seen, frame in enumerate(container.decode(stream), start=1):
                positions = want.get(seen - 1)
                if positions:
                    rgb = frame.to_image()  # rgb24
                    resized = np.asarray(rgb.resize((size[1], size[0]), resample=Image.Resampling.BICUBIC))
                    for pos in positions:
                        kept[pos] = resized
                if seen - 1 >= last:
                    break
        except (av.FFmpegError, ValueError, OSError, EOFError):
            raise InvalidMediaError("the video frames could not be decoded") from None
    if any(frame is None for frame in kept):
        return [], seen
    return kept, seen  # type: ignore[return-value]


def prepare_video(data: bytes, digest: str, limits: MediaLimits, reserve: Callable[[int], None],
                  cfg: VideoConfig = VideoConfig()) -> PreparedMedia:
    """Bytes -> prepared payload; `reserve(nbytes)` sets this build's live-memory claim before the
    frames are decoded."""
    info = probe(data)
    if info.width * info.height > limits.max_frame_pixels:
        raise MediaBudgetExceededError(
            f"a video frame has {info.width * info.height} pixels, "
            f"more than the {limits.max_frame_pixels}-pixel limit")
    total = info.frames
    for _attempt in range(2):  # a container may overstate its frame count: sample again on the real one
        if total * info.width * info.height > limits.max_request_decoded_pixels:
            raise MediaBudgetExceededError("the video has more decoded pixels than the request limit")
        indices = sample_indices(total, info.fps, cfg)
        budget = patches.video_frame_budget(len(indices), cfg.min_pixels, cfg.max_pixels, cfg.cap_pixels_per_frame)
        size = patches.video_size(len(indices), info.height, info.width, cfg.min_pixels, budget)
        grid = patches.grid_thw(len(indices), *size)
        reserve(payload_bytes(grid))
        frames, seen = _decode(data, indices, size)
        if frames:
            break
        if seen < 1:
            raise InvalidMediaError("the video has no decodable frames")
        total = seen
    else:
        raise InvalidMediaError("the video frames could not be decoded consistently")
    pixel_values = patches.pack(np.stack(frames))
    return PreparedMedia("video", digest, pixel_values, grid, timestamps=group_timestamps(indices, info.fps),
                         decoded_pixels=total * info.width * info.height)
