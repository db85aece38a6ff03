"""Qwen smart resize and the BF16 patch packing shared by images and video.

Written from the documented algorithm (reference section 7) so that the output equals what the
Hugging Face Qwen2-VL/Qwen3-VL processors produce: same resized size, same values, same order.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ninfer.media.errors import InvalidMediaError
from ninfer.media.types import FACTOR, MERGE, PATCH, PATCH_DIM, TEMPORAL_PATCH

# Qwen3.5 preprocessor configs: "edges" are total-pixel budgets
IMAGE_MIN_PIXELS = 65536
IMAGE_MAX_PIXELS = 16777216
VIDEO_MIN_PIXELS = 4096
VIDEO_MAX_PIXELS = 25165824  # over all sampled frames
VIDEO_MAX_TOKENS_PER_FRAME = 768  # qwen-vl-utils' per-frame cap
MAX_ASPECT = 200


def _check_aspect(height: int, width: int) -> None:
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise InvalidMediaError(f"the image aspect ratio {width}x{height} is beyond {MAX_ASPECT}:1")


def image_size(height: int, width: int, min_pixels: int = IMAGE_MIN_PIXELS,
               max_pixels: int = IMAGE_MAX_PIXELS) -> tuple[int, int]:
    """Resized (height, width): multiples of 32 near the original, pixel count within budget."""
    _check_aspect(height, width)
    # Python round is half-to-even, as the reference processor's
    h, w = round(height / FACTOR) * FACTOR, round(width / FACTOR) * FACTOR
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(FACTOR, math.floor(height / beta / FACTOR) * FACTOR)
        w = max(FACTOR, math.floor(width / beta / FACTOR) * FACTOR)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / FACTOR) * FACTOR
        w = math.ceil(width * beta / FACTOR) * FACTOR
    return h, w


def video_frame_budget(num_frames: int, min_pixels: int = VIDEO_MIN_PIXELS,
                       max_pixels: int = VIDEO_MAX_PIXELS, cap_per_frame: bool = True) -> int:
    """The total-pixel ceiling for a clip: with the per-frame cap, token cost grows with duration
    instead of a short clip spending the whole budget on a few near-native frames."""
    if not cap_per_frame:
        return max_pixels
    per_frame = min(VIDEO_MAX_TOKENS_PER_FRAME * FACTOR * FACTOR, max_pixels // num_frames)
    return max(per_frame, int(min_pixels * 1.05)) * num_frames


def video_size(num_frames: int, height: int, width: int, min_pixels: int = VIDEO_MIN_PIXELS,
               max_pixels: int = VIDEO_MAX_PIXELS) -> tuple[int, int]:
    """Resized frame (height, width) for `num_frames` sampled frames (before temporal padding)."""
    if height < FACTOR or width < FACTOR:  # tiny frames are scaled up to one merge block first
        scale = max(FACTOR / height, FACTOR / width)
        height, width = int(height * scale), int(width * scale)
    _check_aspect(height, width)
    h, w = round(height / FACTOR) * FACTOR, round(width / FACTOR) * FACTOR
    t = round(num_frames / TEMPORAL_PATCH) * TEMPORAL_PATCH
    if t * h * w > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h = max(FACTOR, math.floor(height / beta / FACTOR) * FACTOR)
        w = max(FACTOR, math.floor(width / beta / FACTOR) * FACTOR)
    elif t * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h = math.ceil(height * beta / FACTOR) * FACTOR
        w = math.ceil(width * beta / FACTOR) * FACTOR
    return h, w


def grid_thw(num_frames: int, height: int, width: int) -> tuple[int, int, int]:
    """(t, h, w) in patches for frames already resized; frames pad up to a multiple of 2."""
    return -(-num_frames // TEMPORAL_PATCH), height // PATCH, width // PATCH


def _normalized_bf16_lut() -> np.ndarray:
    """bf16 bit patterns of every uint8 value after rescale (1/255, in float64 then float32, as the
    reference) and normalize ((x - 0.5) / 0.5 in float32); a table keeps packing exact and cheap."""
    scaled = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)
    normed = (scaled - np.float32(0.5)) / np.float32(0.5)
    return torch.from_numpy(normed).to(torch.bfloat16).view(torch.int16).numpy()


_LUT = _normalized_bf16_lut()


def pack(frames: np.ndarray) -> torch.Tensor:
    """uint8 RGB frames [T, H, W, 3] (H, W multiples of 32) -> bf16 patches [N, 1536].

    Rows run over (temporal group, merge-block row, merge-block column, row in block, column in
    block), so each 2x2 merge block is four consecutive rows; each row holds (channel, frame in
    group, y, x). A single image (T = 1) is repeated in time; an odd frame count repeats its last.
    """
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3:
        raise ValueError(f"expected uint8 [T, H, W, 3] frames, got {frames.dtype} {frames.shape}")
    t, height, width, _ = frames.shape
    if height % FACTOR or width % FACTOR:
        raise ValueError(f"frame size {height}x{width} is not a multiple of {FACTOR}")
    if t % TEMPORAL_PATCH:
        pad = np.broadcast_to(frames[-1:], (TEMPORAL_PATCH - t % TEMPORAL_PATCH, height, width, 3))
        frames = np.concatenate([frames, pad])
    gt, gh, gw = grid_thw(frames.shape[0], height, width)
    blocks = frames.reshape(gt, TEMPORAL_PATCH, gh // MERGE, MERGE, PATCH, gw // MERGE, MERGE, PATCH, 3)
    # -> (gt, block row, block col, in-block row, in-block col, channel, frame, y, x)
    ordered = np.ascontiguousarray(blocks.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)).reshape(-1, PATCH_DIM)
    return torch.from_numpy(_LUT[ordered]).view(torch.bfloat16)


def pack_image(pixels: np.ndarray) -> torch.Tensor:
    """One resized uint8 RGB image [H, W, 3] -> its patches (repeated along time, grid_t 1)."""
    return pack(np.broadcast_to(pixels[None], (TEMPORAL_PATCH, *pixels.shape)))
