"""The `encrypted_content` of reasoning Items: raw reasoning text sealed so a client can carry it.

Codex asks for `include: ["reasoning.encrypted_content"]` and, on store:false turns, replays a
reasoning Item with only that field. Restoring the exact text keeps the replayed prompt
byte-identical, so prefix reuse survives. This is not secrecy (the text is the model's own
output, also returned in `content`): the envelope is versioned, compressed and checksummed, so a
damaged or foreign value is refused instead of silently changing the prompt.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import zlib

PREFIX = "ninfer.r1."  # the version is part of the prefix; a later format gets a new one
_DIGEST_BYTES = 16
MAX_TEXT_BYTES = 64 * 1024 * 1024  # a decompression bound: no reasoning block comes near it


class SealError(ValueError):
    """An encrypted_content value this server did not produce, or one that was altered."""


def seal(text: str) -> str:
    raw = text.encode("utf-8")
    payload = hashlib.sha256(raw).digest()[:_DIGEST_BYTES] + zlib.compress(raw, 6)
    return PREFIX + base64.urlsafe_b64encode(payload).decode("ascii").rstrip("=")


def unseal(value: str) -> str:
    if not value.startswith(PREFIX):
        raise SealError("it was not produced by this server (unknown format)")
    encoded = value[len(PREFIX):]
    try:
        payload = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
        inflater = zlib.decompressobj()
        raw = inflater.decompress(payload[_DIGEST_BYTES:], MAX_TEXT_BYTES)
    except (binascii.Error, ValueError, zlib.error) as exc:
        raise SealError(f"it is damaged ({exc})") from None
    if inflater.unconsumed_tail or not inflater.eof:
        raise SealError("it is truncated or too large")
    if hashlib.sha256(raw).digest()[:_DIGEST_BYTES] != payload[:_DIGEST_BYTES]:
        raise SealError("its checksum does not match")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SealError("it does not hold UTF-8 text") from None
