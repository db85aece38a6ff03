"""3-axis (temporal, height, width) MRoPE position ids for a prompt with image / video spans.

The Qwen3.5 rule: text advances by one on all three axes. A media frame whose first token would
sit at position s, with merged grid (h', w') = (h / 2, w / 2), puts its token at row r, column c
(row-major) on (T, H, W) = (s, s + r, s + c); the next token after it sits at s + max(h', w').
A video is a sequence of such frames (the template separates them with timestamp text). After the
prompt every axis agrees again, so decode positions are plain: next_position, next_position + 1, ...

Positions are per sequence and absolute: the same prompt prefix always gets the same ids, so a
cached prefix stays valid, and a chunked prefill slices `positions[:, a:b]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

IMAGE_TOKEN_ID = 248056  # <|image_pad|>
VIDEO_TOKEN_ID = 248057  # <|video_pad|>


@dataclass(frozen=True)
class MediaSpan:
    """One contiguous run of placeholder tokens: `start` is the prompt index of its first token,
    `grid_thw` the vision tower's patch grid for it. A span with t > 1 is t frames back to back."""

    start: int
    grid_thw: tuple[int, int, int]
    kind: str = "image"  # "image" or "video"; the positions do not depend on it

    def num_tokens(self, spatial_merge_size: int = 2) -> int:
        t, h, w = self.grid_thw
        return t * h * w // spatial_merge_size ** 2


@dataclass(frozen=True)
class MropePositions:
    positions: torch.Tensor  # [3, T] long: T, H, W axes
    next_position: int  # the position of the first token after the prompt, on all three axes

    @property
    def rope_delta(self) -> int:
        """next_position - T: decode token i (0-based in the sequence) sits at i + rope_delta."""
        return self.next_position - self.positions.shape[1]


def mrope_positions(num_tokens: int, spans: Sequence[MediaSpan], spatial_merge_size: int = 2,
                    device: torch.device | str | None = None) -> MropePositions:
    """Positions of a num_tokens-long prompt whose media placeholders are `spans` (any order,
    not overlapping). Loops over spans only; each span's and each text run's ids are one tensor op."""
    positions = torch.empty(3, num_tokens, dtype=torch.long, device=device)
    token, pos = 0, 0  # next prompt index to fill, and its position
    for span in sorted(spans, key=lambda s: s.start):
        if span.start < token:
            raise ValueError(f"media span at {span.start} overlaps the previous one (ends at {token})")
        end = span.start + span.num_tokens(spatial_merge_size)
        if end > num_tokens:
            raise ValueError(f"media span at {span.start} ({end - span.start} tokens) runs beyond the prompt "
                             f"({num_tokens} tokens)")
        positions[:, token:span.start] = torch.arange(pos, pos + span.start - token, device=device)
        pos += span.start - token
        t, h, w = span.grid_thw
        rows, cols = h // spatial_merge_size, w // spatial_merge_size
        step = max(rows, cols)
        first = pos + step * torch.arange(t, device=device)[:, None]  # each frame's s, [t, 1]
        r = torch.arange(rows, device=device).repeat_interleave(cols)
        c = torch.arange(cols, device=device).repeat(rows)
        positions[0, span.start:end] = first.expand(t, rows * cols).reshape(-1)
        positions[1, span.start:end] = (first + r).reshape(-1)
        positions[2, span.start:end] = (first + c).reshape(-1)
        token, pos = end, pos + step * t
    positions[:, token:] = torch.arange(pos, pos + num_tokens - token, device=device)
    return MropePositions(positions, pos + num_tokens - token)


def decode_positions(next_position: int, count: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[3, count] ids of the tokens after the prompt: the degenerate case where the axes agree."""
    return torch.arange(next_position, next_position + count, device=device).expand(3, count)


def media_spans(token_ids: Sequence[int] | torch.Tensor, image_grid_thw: Sequence[Sequence[int]] = (),
                video_grid_thw: Sequence[Sequence[int]] = (), image_token_id: int = IMAGE_TOKEN_ID,
                video_token_id: int = VIDEO_TOKEN_ID, spatial_merge_size: int = 2) -> list[MediaSpan]:
    """The spans of a tokenized prompt: runs of image / video placeholder tokens, matched in order
    with the items' grids. A video contributes one span per frame (grid (1, h, w)); frames that
    follow each other without text between are split into frames too."""
    ids = torch.as_tensor(token_ids).reshape(-1).cpu()
    spans: list[MediaSpan] = []
    for kind, token_id, grids in (("image", image_token_id, image_grid_thw), ("video", video_token_id, video_grid_thw)):
        frames = [(1, int(h), int(w)) for t, h, w in grids for _ in range(int(t))]
        sizes = [h * w // spatial_merge_size ** 2 for _, h, w in frames]
        is_pad = torch.cat([torch.zeros(1, dtype=torch.bool), ids == token_id, torch.zeros(1, dtype=torch.bool)])
        edges = torch.nonzero(is_pad[1:] != is_pad[:-1]).reshape(-1).tolist()  # run starts and ends, alternating
        k = 0
        for run_start, run_end in zip(edges[::2], edges[1::2]):
            at = run_start
            while at < run_end and k < len(frames) and at + sizes[k] <= run_end:
                spans.append(MediaSpan(at, frames[k], kind))
                at, k = at + sizes[k], k + 1
            if at != run_end:
                raise ValueError(f"{kind} placeholder run at {run_start} ({run_end - run_start} tokens) does not "
                                 f"match the {kind} grids given")
        if k != len(frames):
            raise ValueError(f"{len(frames) - k} {kind} item(s) or frame(s) have no placeholder tokens")
    return sorted(spans, key=lambda s: s.start)
