"""CPU media preparation: fetch, decode, smart-resize and pack images and video for the vision tower.

    fetch.py         bytes from http(s) URLs and data URIs
    image.py         pillow decode -> RGB -> resize -> patches
    video.py         PyAV decode -> frame sampling -> resize -> patches, per-group timestamps
    patches.py       Qwen smart resize and the BF16 patch layout shared by both
    cache.py         digest-keyed LRU, live-bytes account, single-flight builds
    preprocessor.py  MediaPreprocessor: one request's items on a bounded worker pool
"""

from ninfer.media.errors import (
                                 InvalidMediaError,
                                 MediaBudgetExceededError,
                                 MediaError,
                                 MediaFetchError,
                                 MediaTimeoutError,
)
from ninfer.media.preprocessor import MediaPreprocessor, media_digest
from ninfer.media.types import MediaItem, MediaLimits, MediaStats, PreparedBatch, PreparedMedia

__all__ = [
    "InvalidMediaError", "MediaBudgetExceededError", "MediaError", "MediaFetchError", "MediaTimeoutError",
    "MediaItem", "MediaLimits", "MediaPreprocessor", "MediaStats", "PreparedBatch", "PreparedMedia",
    "media_digest",
]
