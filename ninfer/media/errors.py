"""Typed media errors, raised where a problem is found and rendered once at the HTTP edge.

Each class carries the contract's `code` and the HTTP `status` it maps to, like
ninfer.engine.types.EngineError. `item` is the index of the offending media item in the list given
to MediaPreprocessor.prepare, so the router can name the request field. The errors cross Ray
process boundaries, so they pickle with their attributes.
"""

from __future__ import annotations


class MediaError(Exception):
    """A media item the server cannot prepare."""

    code = "media_error"
    status = 500

    def __init__(self, message: str, *, item: int | None = None):
        super().__init__(message)
        self.message = message
        self.item = item

    def __reduce__(self):
        # the default reduce passes only args to __init__, which would drop `item`
        return (self.__class__, (self.message,), {"item": self.item})


class InvalidMediaError(MediaError):
    """A bad source (scheme, data URI, base64) or bytes that do not decode to usable content."""

    code = "invalid_media"
    status = 400


class MediaBudgetExceededError(MediaError):
    """A resource rejection: source bytes, decoded pixels, patches, tokens or live memory."""

    code = "media_budget_exceeded"
    status = 400


class MediaFetchError(MediaError):
    """The remote server could not deliver the media (connection failure, HTTP error status)."""

    code = "media_fetch_failed"
    status = 502


class MediaTimeoutError(MediaError):
    """Fetching or preparing the media ran past its deadline."""

    code = "media_timeout"
    status = 504
