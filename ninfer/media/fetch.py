"""Acquire the bytes of a media source: an http(s) URL (httpx) or a data URI.

Bad sources are invalid_media, a source over the byte limit is media_budget_exceeded, and a
remote failure or a timeout keeps its own server-error code.
"""

from __future__ import annotations

import base64
import binascii
import time
import urllib.parse

import httpx

from ninfer.media.errors import (
    InvalidMediaError,
    MediaBudgetExceededError,
    MediaFetchError,
    MediaTimeoutError,
)

_MAX_REDIRECTS = 5
_CHUNK = 1 << 16


class Fetcher:
    """Turns sources into bytes; one pooled httpx client shared by the worker threads."""

    def __init__(self, max_bytes: int, timeout_s: float = 30.0, connect_timeout_s: float = 10.0):
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._client = httpx.Client(
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            follow_redirects=True, max_redirects=_MAX_REDIRECTS,
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
        )

    def close(self) -> None:
        self._client.close()

    def acquire(self, source: str, deadline: float | None = None) -> bytes:
        """The bytes behind `source`; `deadline` is a time.monotonic() instant or None."""
        head = source[:16].lower()
        if head.startswith("data:"):
            return decode_data_uri(source, self.max_bytes)
        if head.startswith(("http://", "https://")):
            return self._get(source, deadline)
        scheme = source.split(":", 1)[0] if ":" in source else ""
        raise InvalidMediaError(f"unsupported media source scheme {scheme!r}: use an http(s) URL or a data URI")

    def _get(self, url: str, deadline: float | None) -> bytes:
        # httpx timeouts bound each operation; the overall bound (a slow trickle) is ours
        end = time.monotonic() + self.timeout_s
        if deadline is not None:
            end = min(end, deadline)
        remaining = end - time.monotonic()
        if remaining <= 0:
            raise MediaTimeoutError(f"fetching media from {_origin(url)} timed out")
        # and no single connect or read may outlast the request's deadline: a peer that stalls mid-body would
        # otherwise hold this preprocessing thread (and the pool's capacity) for the client's whole read timeout
        timeout = httpx.Timeout(min(self.timeout_s, remaining), connect=min(self.connect_timeout_s, remaining))
        try:
            if not httpx.URL(url).host:
                raise InvalidMediaError("the media URL has no host")
            with self._client.stream("GET", url, timeout=timeout) as response:
                if response.status_code >= 400:
                    raise MediaFetchError(f"fetching media failed: HTTP {response.status_code} from {_origin(url)}")
                declared = response.headers.get("content-length")
                if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
                    raise _oversize(self.max_bytes)
                chunks, size = [], 0
                for chunk in response.iter_bytes(_CHUNK):
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise _oversize(self.max_bytes)
                    if time.monotonic() > end:
                        raise MediaTimeoutError(f"fetching media from {_origin(url)} timed out")
                    chunks.append(chunk)
                return b"".join(chunks)
        except httpx.TimeoutException:
            raise MediaTimeoutError(f"fetching media from {_origin(url)} timed out") from None
        except httpx.InvalidURL as exc:
            raise InvalidMediaError(f"invalid media URL: {exc}") from None
        except httpx.HTTPError as exc:
            raise MediaFetchError(f"fetching media from {_origin(url)} failed: {type(exc).__name__}") from None


def decode_data_uri(uri: str, max_bytes: int) -> bytes:
    """data:[<mediatype>][;base64],<data> -> bytes; base64 must be well formed."""
    header, sep, payload = uri.partition(",")
    if not sep:
        raise InvalidMediaError("the media data URI has no ',' before its data")
    if header.lower().endswith(";base64"):
        payload = "".join(payload.split())  # line breaks inside base64 are common and harmless
        if len(payload) // 4 * 3 > max_bytes:  # reject before decoding a huge string
            raise _oversize(max_bytes)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidMediaError("the media data URI is not valid base64") from None
    else:
        data = urllib.parse.unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise _oversize(max_bytes)
    if not data:
        raise InvalidMediaError("the media data URI holds no data")
    return data


def _oversize(max_bytes: int) -> MediaBudgetExceededError:
    return MediaBudgetExceededError(f"the media source is larger than the {max_bytes}-byte limit")


def _origin(url: str) -> str:
    """Scheme and host only: error messages must not echo query strings (they may carry tokens)."""
    parsed = httpx.URL(url)
    return f"{parsed.scheme}://{parsed.host}"
