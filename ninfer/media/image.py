"""Images: decode with pillow, convert to RGB, smart-resize, pack into BF16 patches.

The steps are those of the Hugging Face Qwen2-VL image processor (pillow backend): alpha
composited onto white, bicubic resize of the uint8 RGB image, rescale, normalize, patchify.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable

import numpy as np
from PIL import Image, ImageOps

from ninfer.media import patches
from ninfer.media.errors import InvalidMediaError, MediaBudgetExceededError
from ninfer.media.types import TEMPORAL_PATCH, MediaLimits, PreparedMedia, payload_bytes


def open_image(data: bytes, limits: MediaLimits) -> Image.Image:
    """A lazily decoded image whose header passed the pixel limit."""
    try:
        with warnings.catch_warnings():
            # our own pixel limit below replaces pillow's decompression-bomb warning
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise MediaBudgetExceededError("the image has more pixels than the decoded-pixel limit") from None
    except Exception:  # pillow raises many types for unreadable bytes
        raise InvalidMediaError("the image bytes are not a readable image") from None
    width, height = image.size
    if width < 1 or height < 1:
        raise InvalidMediaError("the image is empty")
    if width * height > limits.max_image_pixels:
        raise MediaBudgetExceededError(
            f"the image has {width * height} pixels, more than the {limits.max_image_pixels}-pixel limit")
    return image


def to_rgb(image: Image.Image) -> Image.Image:
    """Decoded RGB, upright as viewers show it, transparency composited onto white."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image.load()
            image = ImageOps.exif_transpose(image)
            if "A" in image.getbands() or image.info.get("transparency") is not None:
                rgba = image.convert("RGBA")
                white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
                return Image.alpha_composite(white, rgba).convert("RGB")
            return image.convert("RGB")
    except Exception:  # truncated or corrupt pixel data shows up only when decoding
        raise InvalidMediaError("the image bytes could not be decoded") from None


def prepare_image(data: bytes, digest: str, limits: MediaLimits,
                  reserve: Callable[[int], None]) -> PreparedMedia:
    """Bytes -> prepared payload.

    `reserve(nbytes)` sets this build's claim on live memory; it is called from the header's size
    before any pixel is decoded, so an over-budget item costs no decoding.
    """
    image = open_image(data, limits)
    width, height = image.size
    if _orientation(image) in (5, 6, 7, 8):
        width, height = height, width  # exif orientation turns the image a quarter
    reserve(payload_bytes(_grid(height, width)))
    rgb = to_rgb(image)
    if rgb.size != (width, height):  # the header predicted the upright size wrongly: claim again
        width, height = rgb.size
        reserve(payload_bytes(_grid(height, width)))
    new_h, new_w = patches.image_size(height, width)
    resized = rgb.resize((new_w, new_h), resample=Image.Resampling.BICUBIC)
    pixel_values = patches.pack_image(np.asarray(resized))
    return PreparedMedia("image", digest, pixel_values, _grid(height, width), decoded_pixels=width * height)


def _grid(height: int, width: int) -> tuple[int, int, int]:
    new_h, new_w = patches.image_size(height, width)
    return patches.grid_thw(TEMPORAL_PATCH, new_h, new_w)


def _orientation(image: Image.Image) -> int:
    try:
        return int(image.getexif().get(0x0112, 1))
    except Exception:  # a broken EXIF block is not a broken image; to_rgb decides that
        return 1
