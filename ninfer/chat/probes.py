"""Finding client text in a rendered prompt.

Jinja cannot say which output bytes came from which input, so the builder renders probes: copies of
the lowered messages with markers at chosen places. A marker found in a probe names an exact offset
of the real prompt when the probe, markers removed, agrees with the real prompt up to that point;
a place the template trimmed or rewrote fails that check and is reported as unrepresentable.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

from ninfer.chat.control_tokens import find_markers, marker
from ninfer.chat.lowering import Site


def with_markers(messages: list[dict[str, Any]], placements: list[tuple[Site, int]]) -> list[dict[str, Any]]:
    """A copy of `messages` with marker(k) inserted at each site (the originals are not touched)."""
    out = list(messages)
    by_message: dict[int, list[tuple[Site, int]]] = defaultdict(list)
    for site, k in placements:
        by_message[site.message].append((site, k))
    for index, placed in by_message.items():
        message = dict(out[index])
        content = message["content"]
        # Back to front, so an insertion never shifts a site still to be filled.
        placed.sort(key=lambda p: (p[0].item or 0, float("inf") if p[0].offset is None else p[0].offset),
                    reverse=True)
        if isinstance(content, str):
            for site, k in placed:
                content = content[: site.offset] + marker(k) + content[site.offset:]
        else:
            content = [dict(item) for item in content]
            for site, k in placed:
                if site.offset is None:
                    content.insert(site.item + 1, {"type": "text", "text": marker(k)})
                else:
                    text = content[site.item]["text"]
                    content[site.item]["text"] = text[: site.offset] + marker(k) + text[site.offset:]
        message["content"] = content
        out[index] = message
    return out


def with_leading_markers(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A copy of `messages` whose content starts with marker(i) for message i (the layout probe)."""
    out = []
    for i, message in enumerate(messages):
        copy = dict(message)
        content = copy.get("content") or ""
        if isinstance(content, str):
            copy["content"] = marker(i) + content
        else:
            copy["content"] = [{"type": "text", "text": marker(i)}, *content]
        out.append(copy)
    return out


def resolve_markers(probe_text: str, real_text: str) -> dict[int, int]:
    """Offsets into `real_text` of the markers of `probe_text` that land on an exact frontier."""
    found = find_markers(probe_text)
    plain = "".join(probe_text[a:b] for a, b in _gaps(found, len(probe_text)))
    agree = len(os.path.commonprefix([plain, real_text]))
    counts: dict[int, int] = defaultdict(int)
    for _, _, k in found:
        counts[k] += 1
    located: dict[int, int] = {}
    removed = 0
    for start, end, k in found:
        offset = start - removed
        removed += end - start
        if counts[k] == 1 and offset <= agree:  # a marker printed twice has no single place
            located[k] = offset
    return located


def _gaps(found: list[tuple[int, int, int]], length: int) -> list[tuple[int, int]]:
    spans, pos = [], 0
    for start, end, _ in found:
        spans.append((pos, start))
        pos = end
    spans.append((pos, length))
    return spans
