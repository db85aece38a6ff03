"""Where each template message sits in a rendered ChatML prompt.

The layout probe renders the same messages with a marker at the start of every content. Marker
text changes what a turn contains but not which turns exist, so the probe's control tokens must
match the real prompt's one for one (otherwise no layout is claimed). A message then lies in the
turn whose opener precedes its marker; it ends with that turn's closer, or, when the next message
shares the turn (tool results in one user turn), with the first control token after it.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass

from ninfer.chat.control_tokens import find_markers

TURN_OPEN, TURN_CLOSE = "<|im_start|>", "<|im_end|>"


@dataclass
class Layout:
    starts: list[int | None]  # offset of the opener of the turn holding each message
    ends: list[int | None]  # offset just after each message (its turn's closer and line break)

    @staticmethod
    def unknown(count: int) -> "Layout":
        return Layout([None] * count, [None] * count)


def turn_start_at_or_before(controls: list[tuple[int, int, str]], offset: int) -> int | None:
    """Offset of the last turn opener at or before `offset`."""
    index = _last_before(controls, bisect.bisect_right([c[0] for c in controls], offset), TURN_OPEN)
    return None if index is None else controls[index][0]


def message_layout(real_text: str, real_controls: list[tuple[int, int, str]], probe_text: str,
                   probe_controls: list[tuple[int, int, str]], count: int) -> Layout:
    layout = Layout.unknown(count)
    if [c[2] for c in real_controls] != [c[2] for c in probe_controls]:
        return layout
    found = [(k, start) for start, _, k in find_markers(probe_text) if k < count]
    printed = Counter(k for k, _ in found)
    marks = {k: start for k, start in found if printed[k] == 1}  # a message printed twice has no one place
    order = sorted(marks)
    if [marks[k] for k in order] != sorted(marks.values()):
        return layout  # the template reordered messages: no claim
    probe_starts = [c[0] for c in probe_controls]
    for n, k in enumerate(order):
        first_after = bisect.bisect_left(probe_starts, marks[k])
        next_mark = marks[order[n + 1]] if n + 1 < len(order) else None
        opener = _last_before(probe_controls, first_after, TURN_OPEN)
        if opener is not None:
            layout.starts[k] = real_controls[opener][0]
        closer = _first_from(probe_controls, first_after, TURN_CLOSE)
        if next_mark is not None and (closer is None or probe_controls[closer][0] > next_mark):
            # The next message continues this turn: this one ends at the first control token after it.
            if first_after < len(probe_controls) and probe_controls[first_after][0] < next_mark:
                layout.ends[k] = real_controls[first_after][1]
            continue
        if closer is not None:
            end = real_controls[closer][1]
            layout.ends[k] = end + 1 if real_text[end:end + 1] == "\n" else end
    return layout


def _last_before(controls: list[tuple[int, int, str]], index: int, spelling: str) -> int | None:
    for i in range(index - 1, -1, -1):
        if controls[i][2] == spelling:
            return i
    return None


def _first_from(controls: list[tuple[int, int, str]], index: int, spelling: str) -> int | None:
    for i in range(index, len(controls)):
        if controls[i][2] == spelling:
            return i
    return None
