"""A verify round's inputs derived on the device from the round before it, so the engine can queue round n+1
before it reads round n back (Engine: overlapped rounds).

Round n's static rows (graphs.VerifyInputs) hold, per sequence, its last committed token and drafts at positions
p..p+w-1, their KV slots and context lengths, the state slot it reads and the w verify slots its positions' states
go to. Round n+1 of a row that commits c tokens starts at p + c with the target's token after its accepted drafts
(the bonus) and the drafter's next drafts; its state slot is the verify slot c-1 (the state after its last committed
position), which trades places with the old one in the lane's verify slots: the same trade ModelRunner.rollback
makes on the host once round n is read back, so the host's books and the device's agree whenever the host commits
what the device assumed (the engine checks that, against the counts the device used, read back before it adopts
the round; a row where they differ is never continued from these rows).
"""

from __future__ import annotations

import logging

import torch

from ninfer.engine.graphs import VerifyInputs
from ninfer.engine.speculative import accepted_prefix
from ninfer.kernels.backend import use_triton

log = logging.getLogger("ninfer.engine")
_fused_failed = False  # the fused advance raised once in this process: torch ops from then on


def committed_counts(ids: torch.Tensor, samples: torch.Tensor, stop_ids: torch.Tensor) -> torch.Tensor:
    """Tokens each row of a verify round commits, as the host's commit counts them when nothing else ends the row:
    its accepted drafts (those equal to the target's token at their position) and the target's token after them,
    cut after the first stop token among those. ids: [b, w] the round's inputs (last token, drafts); samples: [b, w]
    the target's tokens; stop_ids: [b, E] (-1 pads). Device ops only."""
    w = ids.shape[1]
    accepted = (ids[:, 1:] == samples[:, : w - 1]).long().cumprod(1).sum(1)
    committed = accepted + 1
    if stop_ids.shape[1]:
        stops = (samples[:, :, None] == stop_ids[:, None, :]).any(-1)
        first = torch.where(stops.any(1), stops.long().argmax(1), w)
        committed = torch.minimum(committed, first + 1)
    return committed


def host_committed_count(drafts: list[int], sampled: list[int], stop_ids: set[int]) -> int:
    """`committed_counts` of one row, on the host (the engine checks its commit against it)."""
    n = accepted_prefix(drafts, sampled)
    for j, token in enumerate(sampled[: n + 1]):
        if token in stop_ids:
            return j + 1
    return n + 1


def warm_up(runner, stops: int) -> None:
    """Compile the fused advance before serving, so the first queued round does not wait for Triton: once over the
    static rows of the runner's one-sequence verify graph (rows of the real launches' shape, so the same compiled
    variant; the next launch loads them afresh), with `stops` stop tokens a row (the engine's end-of-sequence set)."""
    width = runner.draft_tokens + 1
    entry = runner.graphs.get((1, width))
    if entry is None or not use_triton(entry.inputs.i64):
        return
    device = entry.inputs.i64.device
    advance_rows(entry.inputs, 1, width, torch.zeros(width, dtype=torch.long, device=device),
                 torch.zeros(1, width - 1, dtype=torch.long, device=device),
                 torch.full((1, max(stops, 1)), -1, dtype=torch.long, device=device), runner.page_size)


def advance_rows(rows: VerifyInputs, b: int, w: int, samples: torch.Tensor, drafts: torch.Tensor,
                 stop_ids: torch.Tensor, page_size: int) -> torch.Tensor:
    """Rewrite the first b rows of a verify round (width w) in place into the next round's: samples [b * w] the
    round's sampled tokens, drafts [b, >= w-1] the next drafts. Returns the committed counts [b] (device). On CUDA
    one Triton launch (kernels.triton_next_round) computes the same."""
    global _fused_failed
    if use_triton(rows.i64) and not _fused_failed:
        from ninfer.kernels.triton_next_round import advance_rows_fused

        try:
            return advance_rows_fused(rows, b, w, samples, drafts, stop_ids, page_size)
        except Exception:  # it did not compile or launch here (s40: not yet run on a GPU): the torch ops below
            log.exception("the fused next-round advance failed; advancing queued rounds with torch ops from now on")
            _fused_failed = True
    ids, pos, slots, own, scratch, _ = rows._views64(rows.i64)
    seq_lens, row_lens, table = rows._views32(rows.i32)
    ids, pos, slots = ids[: b * w].view(b, w), pos[: b * w].view(b, w), slots[: b * w].view(b, w)
    own, scratch = own[:b], scratch[:b]
    samples = samples.view(b, w).to(ids.dtype)
    c = committed_counts(ids, samples, stop_ids)
    last = (c - 1)[:, None]
    bonus = samples.gather(1, last)
    accepted_state = scratch.gather(1, last)
    scratch.scatter_(1, last, own[:, None])
    own.copy_(accepted_state[:, 0])
    ids[:, :1].copy_(bonus)
    ids[:, 1:].copy_(drafts[:, : w - 1])
    pos.add_(c[:, None])
    page = table[:b].long().gather(1, pos // page_size)
    slots.copy_(page * page_size + pos % page_size)
    seq_lens[:b].add_(c.to(seq_lens.dtype))
    row_lens[: b * w].view(b, w).add_(c[:, None].to(row_lens.dtype))
    return c
