"""Placeholder expansion: each template media placeholder becomes the pads its prepared media fills.

The template writes one `<|image_pad|>` / `<|video_pad|>` per item (reference section 6); the
vision tower produces one embedding per merged token, so the prompt must hold that many pads
(section 7). An image's pad becomes `num_tokens` pads. A video's whole
`<|vision_start|><|video_pad|><|vision_end|>` becomes, per temporal group, `<t seconds>` text and
its own start/pads/end run, as the Qwen3-VL processor writes it.

Expansion happens on the rendered text before tokenization, so the timestamp text is encoded
together with the template text around it exactly as the reference processor's tokenizer sees it;
`Expansion.shift` maps the builder's character offsets in the unexpanded text into the expanded one.

The prepared items are duck-typed (ninfer.media.PreparedMedia): `modality`, `digest`, `grid_thw`,
`num_tokens`, `tokens_per_group`, `timestamps`; the chat layer does not import media/.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PADS = {"image": "<|image_pad|>", "video": "<|video_pad|>"}
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"


@dataclass(frozen=True)
class PadRun:
    """One run of pads in the expanded text: an image or one video group."""

    char: int  # offset of the first pad in the expanded text
    grid_thw: tuple[int, int, int]
    kind: str
    digest: str
    item: int  # index into the builder's media list


@dataclass
class Expansion:
    text: str
    runs: list[PadRun] = field(default_factory=list)
    # replaced ranges of the unexpanded text, ascending, with the total growth once each is passed
    _ends: list[int] = field(default_factory=list)
    _starts: list[int] = field(default_factory=list)
    _growth: list[int] = field(default_factory=list)

    def shift(self, offset: int) -> int | None:
        """`offset` (unexpanded) in the expanded text; None inside a replaced placeholder."""
        k = bisect.bisect_right(self._ends, offset)  # replacements wholly before the offset
        if k < len(self._starts) and self._starts[k] < offset:
            return None
        return offset + (self._growth[k - 1] if k else 0)


def expand_media(text: str, controls: Sequence[tuple[int, int, str]], media: Sequence[Any]) -> Expansion:
    """Replace the placeholders of `text` (its control tokens: `controls`) by `media`, in order.

    The caller has checked that the placeholders' kinds are the media's kinds, in order."""
    pads = [k for k, (_, _, spelling) in enumerate(controls) if spelling in PADS.values()]
    out: list[str] = []
    expansion = Expansion("")
    pos = growth = size = 0  # read position in text, total growth, length of the output so far
    for item, (k, prepared) in enumerate(zip(pads, media)):
        start, end, spelling = controls[k]
        if prepared.modality == "video":
            if _is(controls, k - 1, VISION_START, end=start) and _is(controls, k + 1, VISION_END, start=end):
                start, end = controls[k - 1][0], controls[k + 1][1]
            pieces, runs = _video(prepared)
        else:
            pieces, runs = [spelling * prepared.num_tokens], [0]
        out.append(text[pos:start])
        size += start - pos
        base = size
        for offset, grid in zip(runs, _grids(prepared), strict=True):
            expansion.runs.append(PadRun(base + offset, grid, prepared.modality, prepared.digest, item))
        new = "".join(pieces)
        out.append(new)
        size += len(new)
        growth += len(new) - (end - start)
        expansion._starts.append(start)
        expansion._ends.append(end)
        expansion._growth.append(growth)
        pos = end
    out.append(text[pos:])
    expansion.text = "".join(out)
    return expansion


def _is(controls: Sequence[tuple[int, int, str]], k: int, spelling: str, *, start: int | None = None,
        end: int | None = None) -> bool:
    """Whether control k exists, is `spelling`, and touches the pad (no text between)."""
    if not 0 <= k < len(controls) or controls[k][2] != spelling:
        return False
    return (start is None or controls[k][0] == start) and (end is None or controls[k][1] == end)


def _video(prepared: Any) -> tuple[list[str], list[int]]:
    """The expanded text of a video and the offset of each group's first pad in it."""
    pieces, runs, size = [], [], 0
    pads = PADS["video"] * prepared.tokens_per_group
    for seconds in prepared.timestamps:
        head = f"<{seconds:.1f} seconds>{VISION_START}"
        runs.append(size + len(head))
        piece = head + pads + VISION_END
        pieces.append(piece)
        size += len(piece)
    return pieces, runs


def _grids(prepared: Any) -> list[tuple[int, int, int]]:
    """The grid of each pad run: the whole grid for an image, (1, h, w) per video group."""
    t, h, w = prepared.grid_thw
    if prepared.modality != "video":
        return [(t, h, w)]
    if len(prepared.timestamps) != t:
        raise ValueError(f"a prepared video has {t} temporal groups but {len(prepared.timestamps)} timestamps")
    return [(1, h, w)] * t
