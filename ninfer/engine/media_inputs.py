"""The engine's side of media (EngineRequest.media): MRoPE positions and cache identity for a
sequence, and the input embeddings of a prefill chunk that covers media pads.

- Positions (`setup`): a prompt with media gets [3, prompt_len] MRoPE positions (ninfer.models.mrope;
  each pad run, i.e. an image or one temporal group of a video, is a (1, h, w) span), and the offset
  that text positions past the prompt take. Text-only prompts keep plain positions (mrope None).
- Identity (`setup`): Sequence.prompt_key is the prompt with each pad replaced by (digest, grid, k),
  k the pad's index in its item. The context cache compares these keys instead of token ids, so a
  prefix matches only with the same media at the same places (pads of different media never match);
  the MRoPE positions of a prefix follow from its tokens and grids, so equal keys mean equal positions.
- Embeddings (`chunk_embeds`): when a chunk first covers an item's pads the vision tower encodes the
  item (all such items of a step in one tower call), the embeddings stay on the Sequence until its
  computed frontier passes the item, and the chunk's rows of them replace the text embeddings (one
  index_copy_ per step). An item wholly inside a reused prefix is never covered by a chunk, so it is
  never encoded. A replay after a pause encodes again (the embeddings were freed).
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from ninfer.engine.types import EngineRequest, InvalidRequestError, MediaInput, VisionDisabledError
from ninfer.models.mrope import MediaSpan, mrope_positions


def item_groups(item: MediaInput, merge: int = 2) -> list[tuple[int, int]]:
    """(first token index, pad count) of each pad run of an item: one for an image, one per temporal
    group of a video."""
    t, h, w = item.grid_thw
    starts = item.group_starts or [item.start]
    per_group = item.num_tokens // len(starts)
    if per_group * len(starts) != item.num_tokens or per_group != h * w // merge ** 2:
        raise InvalidRequestError(f"media at {item.start}: {len(starts)} pad runs do not match grid {item.grid_thw} "
                                  f"({item.num_tokens} tokens)")
    return [(s, per_group) for s in starts]


def item_token_indices(item: MediaInput) -> np.ndarray:
    """Prompt indices of the item's pads, in the order of its embeddings."""
    return np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in item_groups(item)])


def setup(request: EngineRequest) -> tuple[np.ndarray | None, int, list | None]:
    """(MRoPE positions [3, prompt_len], the offset of positions past the prompt, the prompt's cache key);
    (None, 0, None) for a text-only prompt."""
    if not request.media:
        return None, 0, None
    n = len(request.prompt_ids)
    spans, key = [], list(request.prompt_ids)
    for item in request.media:
        t, h, w = item.grid_thw
        for start, count in item_groups(item):
            if start < 0 or start + count > n:
                raise InvalidRequestError(f"media pads at {start}..{start + count} run beyond the prompt ({n} tokens)")
            spans.append(MediaSpan(start, (1, h, w), item.kind))
        ident = (item.digest, tuple(item.grid_thw))
        for k, index in enumerate(item_token_indices(item).tolist()):
            key[index] = (*ident, k)
    try:
        mrope = mrope_positions(n, spans)
    except ValueError as exc:
        raise InvalidRequestError(f"media spans: {exc}") from None
    return mrope.positions.numpy(), mrope.rope_delta, key


def _encode(tower: torch.nn.Module, items: list[MediaInput], device: torch.device) -> list[torch.Tensor]:
    """One tower call over several items; their merged embeddings, item by item."""
    dtype = next(tower.parameters()).dtype
    patches = torch.cat([torch.as_tensor(i.pixel_values) for i in items]).to(device=device, dtype=dtype)
    out = tower(patches, [tuple(i.grid_thw) for i in items])
    return list(out.split([i.num_tokens for i in items]))


def chunk_embeds(tower: torch.nn.Module | None, model: torch.nn.Module, seqs: list, inputs: list[list[int]],
                 input_ids: torch.Tensor) -> torch.Tensor | None:
    """The step's input embeddings [T, H] when a row covers media pads, else None (the model embeds the
    ids itself). seqs[i] appends inputs[i] at its num_computed; the rows are inputs concatenated (a
    padded single row may have more input_ids than tokens)."""
    todo = []  # (seq, item index, item, batch rows of its pads inside the chunk, their indices in the item)
    row = 0
    for seq, tokens in zip(seqs, inputs):
        row, first = row + len(tokens), row
        media = getattr(getattr(seq, "request", None), "media", None)
        if not media or seq.num_computed >= seq.prompt_len:
            continue
        start, end = seq.num_computed, seq.num_computed + len(tokens)
        for k, item in enumerate(media):
            if item.start >= end or item.start + _span(item) <= start:
                continue
            idx = item_token_indices(item)
            inside = np.nonzero((idx >= start) & (idx < end))[0]
            if len(inside):
                todo.append((seq, k, item, first + idx[inside] - start, inside))
    if not todo:
        return None
    if tower is None:
        raise VisionDisabledError("this engine was started without --vision: it cannot run media input")
    missing = [(seq, k, item) for seq, k, item, _, _ in todo if k not in seq.media_embeds]
    if missing:
        with _timed({id(seq): seq for seq, _, _ in missing}.values(), input_ids.device):
            encoded = _encode(tower, [m[2] for m in missing], input_ids.device)
        for (seq, k, _), emb in zip(missing, encoded):
            seq.media_embeds[k] = emb
    x = model.embed_tokens(input_ids)
    rows = torch.as_tensor(np.concatenate([t[3] for t in todo]), device=x.device)
    values = torch.cat([seq.media_embeds[k][torch.as_tensor(inside, device=x.device)]
                        for seq, k, _, _, inside in todo])
    x.index_copy_(0, rows, values.to(x.dtype))
    for seq, tokens in zip(seqs, inputs):  # free what the frontier passes with this chunk
        end = seq.num_computed + len(tokens)
        held = getattr(seq, "media_embeds", None) or {}
        for k in [k for k in held if _item_end(seq.request.media[k]) <= end]:
            del held[k]
    return x


@contextlib.contextmanager
def _timed(seqs, device: torch.device):
    """Time a vision encode for the request log (timings_seconds.vision): CUDA events on the device's stream
    (read at the request's end, never waited on here), wall time on the CPU. An encode batching items of
    several requests counts whole for each of them."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        for seq in seqs:
            seq.vision_events.append((start, end))
        return
    t0 = time.perf_counter()
    yield
    for seq in seqs:
        seq.vision_seconds += time.perf_counter() - t0


def vision_seconds(seq) -> float:
    """The request's vision encode time so far (its events complete before the request's last step)."""
    total = seq.vision_seconds
    for start, end in seq.vision_events:
        end.synchronize()
        total += start.elapsed_time(end) / 1000.0
    return total


def _item_end(item: MediaInput) -> int:
    return item.start + _span(item)


def _span(item: MediaInput) -> int:
    """Tokens from the item's first pad to past its last (timestamp text between groups included)."""
    groups = item_groups(item)
    return groups[-1][0] + groups[-1][1] - item.start
