"""One launch for next_round.advance_rows on CUDA: a verify round's static rows rewritten in place into the next
round's, a program per sequence. In torch the same takes ~30 small kernels, ~0.1 ms of device time a round on an H100
(s39: the cost that made queued rounds ~1 % slower there); here one kernel reads and writes a few hundred bytes.

Layout (graphs.VerifyInputs, first b rows, width W): ids, positions, slots [b * W] int64; own [b] and scratch [b, W]
int64 state slots; seq_lens [b] and row_lens [b * W] int32; the page table [b, pages] int32. Same results as the torch
path bit for bit (integers only); tests/test_overlapped_rounds.py checks them under Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _advance_kernel(IDS, POS, SLOTS, OWN, SCRATCH, SEQ_LENS, ROW_LENS, TABLE, SAMPLES, DRAFTS, STOPS, COMMITTED,
                    table_stride, drafts_stride, stops_stride, n_stops, page_size,
                    W: tl.constexpr, WP2: tl.constexpr, EP2: tl.constexpr):
    row = tl.program_id(0)
    j = tl.arange(0, WP2)
    inw = j < W
    base = row * W
    samples = tl.load(SAMPLES + base + j, mask=inw, other=-1)
    # draft j (ids[j + 1]) stands while it equals the target's token at j: accepted = the first j where it does not
    drafts_in = tl.load(IDS + base + j + 1, mask=j < W - 1, other=-1)
    miss = (drafts_in != samples) | (j >= W - 1)
    accepted = tl.min(tl.where(miss, j, W - 1), axis=0)
    # cut after the first stop token among the committed ones
    e = tl.arange(0, EP2)
    stops = tl.load(STOPS + row * stops_stride + e, mask=e < n_stops, other=-2)
    hit = tl.sum((samples[:, None] == stops[None, :]).to(tl.int32), axis=1) > 0
    first_stop = tl.min(tl.where(hit & inw, j, W), axis=0)
    c = tl.minimum(accepted + 1, first_stop + 1)
    last = c - 1
    bonus = tl.sum(tl.where(j == last, samples, 0), axis=0)
    # state: the verify slot after the last committed position becomes the sequence's, the old one takes its place
    scratch = tl.load(SCRATCH + base + j, mask=inw, other=0)
    accepted_state = tl.sum(tl.where(j == last, scratch, 0), axis=0)
    own = tl.load(OWN + row)
    tl.store(SCRATCH + base + j, tl.where(j == last, own, scratch), mask=inw)
    tl.store(OWN + row, accepted_state)
    drafts = tl.load(DRAFTS + row * drafts_stride + j - 1, mask=(j >= 1) & inw, other=0)
    tl.store(IDS + base + j, tl.where(j == 0, bonus, drafts), mask=inw)
    pos = tl.load(POS + base + j, mask=inw, other=0) + c
    tl.store(POS + base + j, pos, mask=inw)
    page = tl.load(TABLE + row * table_stride + pos // page_size, mask=inw, other=0).to(tl.int64)
    tl.store(SLOTS + base + j, page * page_size + pos % page_size, mask=inw)
    tl.store(SEQ_LENS + row, tl.load(SEQ_LENS + row) + c.to(tl.int32))
    row_lens = tl.load(ROW_LENS + base + j, mask=inw, other=0)
    tl.store(ROW_LENS + base + j, row_lens + c.to(tl.int32), mask=inw)
    tl.store(COMMITTED + row, c)


def advance_rows_fused(rows, b: int, w: int, samples: torch.Tensor, drafts: torch.Tensor, stop_ids: torch.Tensor,
                       page_size: int) -> torch.Tensor:
    """next_round.advance_rows in one launch; returns the committed counts [b] (int64, on the device)."""
    ids, pos, slots, own, scratch, _ = rows._views64(rows.i64)
    seq_lens, row_lens, table = rows._views32(rows.i32)
    samples = samples.reshape(-1).to(torch.int64).contiguous()
    drafts = drafts.to(torch.int64)
    if drafts.stride(-1) != 1:
        drafts = drafts.contiguous()
    stops = stop_ids.to(torch.int64).contiguous() if stop_ids.shape[1] else torch.full((b, 1), -1, dtype=torch.int64,
                                                                                         device=samples.device)
    committed = torch.empty(b, dtype=torch.int64, device=samples.device)
    _advance_kernel[(b,)](
        ids, pos, slots, own, scratch, seq_lens, row_lens, table, samples, drafts, stops, committed,
        table.stride(0), drafts.stride(0), stops.stride(0), stop_ids.shape[1], page_size,
        W=w, WP2=triton.next_power_of_2(w), EP2=triton.next_power_of_2(max(stops.shape[1], 1)), num_warps=1)
    return committed
