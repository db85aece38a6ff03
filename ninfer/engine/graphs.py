"""CUDA graphs of the model forward: one per decode batch size, one for a full prefill chunk.

A graph replays fixed launches over fixed device buffers, so each graph owns static inputs that
the host refills before every replay:
- decode (batch b = 1..lanes): token ids, positions, KV slots, state slots, sequence lengths and
  page tables of b sequences that append one token each;
- prefill (one sequence, `--prefill-chunk` new tokens, or a prefill piece's power of two; fewer
  tokens are padded up to it): the same fields for that chunk. A long prompt is a run of such
  chunks; its shorter last chunk goes through the runner's prefill plan (ninfer.engine.runner), and
  prefill batches of any other shape run eagerly. Replaying a chunk costs the host one small
  upload and one launch, where the eager forward issues ~2,600 kernel launches and their Python
  around them; at 1024 tokens that host work took as long as the GPU's (H200 profile,
  bench/results/2026-11-30-h200-s4);
- sampler (batch b): the per-row sampler settings of a decode batch, sampled from decode graph
  b's logits (the runner captures it in the decode graphs' pool).

The kernels see the lengths only on the device; the host copies of a captured batch raise when
read (`DeviceOnlyLengths`), so a kernel that would bake one step's lengths into a graph fails
capture instead, and the runner falls back to eager for that graph. Graph and eager runs launch
the same kernels with the same parameters, so their outputs agree exactly.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from ninfer.engine.sampler import SamplingBatch
from ninfer.forward import DeviceOnlyLengths, ForwardBatch, HostInputs, host_inputs


class StaticInputs:
    """A graph's int64 and int32 device inputs, filled from pinned host images by async copies.

    Two host images alternate: the host fills one while the copy from the other may still be
    queued behind earlier GPU work (prefill chunks are not synchronized between each other), and
    waits on an image's last copy only when it comes round again. (On a CPU device, where graphs
    never run, the same code fills plain tensors: the tests check the fills there.)
    """

    def __init__(self, n64: int, n32: int, device: torch.device):
        self.i64 = torch.zeros(n64, dtype=torch.int64, device=device)
        self.i32 = torch.zeros(n32, dtype=torch.int32, device=device)
        self._cuda = torch.device(device).type == "cuda"

        def image(n: int, dtype: torch.dtype) -> torch.Tensor:
            t = torch.zeros(n, dtype=dtype)
            return t.pin_memory() if self._cuda else t

        self._images = [(image(n64, torch.int64), image(n32, torch.int32)) for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._next = 0

    def host(self) -> tuple[np.ndarray, np.ndarray]:
        """The next host image (int64, int32) to fill, once its previous copy has been read."""
        done = self._copied[self._next]
        if done is not None and not done.query():
            done.synchronize()
        h64, h32 = self._images[self._next]
        return h64.numpy(), h32.numpy()

    def upload(self, n32: int | None = None) -> None:
        """Copy the filled image to the device (int32: its first n32 values, default all)."""
        h64, h32 = self._images[self._next]
        n32 = h32.shape[0] if n32 is None else n32
        self.i64.copy_(h64, non_blocking=True)
        self.i32[:n32].copy_(h32[:n32], non_blocking=True)
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
            self._copied[self._next] = event
        self._next ^= 1


class DecodeInputs(StaticInputs):
    """Decode graphs' inputs (batch b uses the first b rows). int64 rows: input_ids, positions,
    slot_mapping, state_slots; int32: seq_lens [max_batch] then the page table [max_batch, width]."""

    def __init__(self, max_batch: int, width: int, device: torch.device):
        super().__init__(4 * max_batch, max_batch * (1 + width), device)
        self.max_batch, self.width = max_batch, width
        self.qsl = torch.arange(max_batch + 1, dtype=torch.int32, device=device)

    def placeholder(self) -> None:
        """Valid inputs for warm-up and capture: token 0 at position 0 in slot 0 of page 0."""
        h64, h32 = self.host()
        h64[:] = 0
        h32[:] = 0
        h32[: self.max_batch] = 1
        self.upload()

    def fill(self, seqs, inputs: list[list[int]], page_size: int) -> None:
        """Rows for sequences appending one token each, from the same builder the eager path uses."""
        self.load(host_inputs(inputs, [s.num_computed for s in seqs], [s.pages for s in seqs], page_size,
                              [s.state_slot if s.state_slot is not None else 0 for s in seqs]))

    def load(self, h: HostInputs) -> None:
        h64, h32 = self.host()
        rows = h64.reshape(4, self.max_batch)
        b, base, width = len(h.query_lens), self.max_batch, self.width
        rows[0, :b] = h.input_ids
        rows[1, :b] = h.positions
        rows[2, :b] = h.slot_mapping
        rows[3, :b] = h.state_slots
        h32[:b] = h.seq_lens
        for i, pages in enumerate(h.page_tables):
            h32[base + i * width: base + i * width + len(pages)] = pages
        self.upload(n32=base + b * width)  # rows past the batch are not read

    def batch(self, b: int) -> ForwardBatch:
        rows = self.i64.view(4, self.max_batch)
        table = self.i32[self.max_batch:].view(self.max_batch, self.width)
        return ForwardBatch(
            input_ids=rows[0, :b], positions=rows[1, :b], query_start_loc=self.qsl[: b + 1],
            seq_lens=self.i32[:b], page_table=table[:b], slot_mapping=rows[2, :b], state_slots=rows[3, :b],
            query_lens_cpu=[1] * b, seq_lens_cpu=DeviceOnlyLengths([0] * b),
        )


class PrefillInputs(StaticInputs):
    """A prefill graph's inputs: one sequence appending `tokens` tokens, or fewer padded up to `tokens`
    (ForwardBatch.num_valid). int64: input_ids, positions, slot_mapping (each `tokens` long), then the
    state slot and the number of real tokens; int32: seq_len, page table."""

    def __init__(self, tokens: int, width: int, device: torch.device):
        super().__init__(3 * tokens + 2, 1 + width, device)
        self.tokens, self.width = tokens, width
        self.qsl = torch.tensor([0, tokens], dtype=torch.int32, device=device)

    def placeholder(self, page_size: int) -> None:
        """Warm-up and capture inputs: tokens 0 at positions 0.. in the first pages, state slot 0."""
        pages = list(range(-(-self.tokens // page_size)))
        self.fill([0] * self.tokens, 0, pages, 0, page_size)

    def fits(self, start: int, pages: list[int], page_size: int) -> bool:
        """Whether the page table holds the sequence's pages and those of the padding's positions."""
        return max(len(pages), -(-(start + self.tokens) // page_size)) <= self.width

    def fill(self, token_ids: list[int], start: int, pages: list[int], state_slot: int, page_size: int) -> None:
        """The chunk's inputs from the eager path's builder, padded up to the graph's size."""
        n = self.tokens
        h = host_inputs([token_ids], [start], [pages], page_size, [state_slot], pad_to=n)
        h64, h32 = self.host()
        h64[:n] = h.input_ids
        h64[n: 2 * n] = h.positions
        h64[2 * n: 3 * n] = h.slot_mapping  # padding: -1, no KV written
        h64[3 * n] = state_slot
        h64[3 * n + 1] = h.num_valid
        h32[0] = h.seq_lens[0]
        table = h.page_tables[0]  # the sequence's pages, then any valid page for the padding's positions
        used = len(table)
        h32[1: 1 + used] = table
        self.upload(n32=1 + used)  # table entries past these are not read

    def batch(self) -> ForwardBatch:
        n, i64 = self.tokens, self.i64
        return ForwardBatch(
            input_ids=i64[:n], positions=i64[n: 2 * n], query_start_loc=self.qsl, seq_lens=self.i32[:1],
            page_table=self.i32[1:].view(1, self.width), slot_mapping=i64[2 * n: 3 * n],
            state_slots=i64[3 * n: 3 * n + 1], num_valid=i64[3 * n + 1:],
            query_lens_cpu=[n], seq_lens_cpu=DeviceOnlyLengths([0]),
        )


class VerifyInputs(StaticInputs):
    """Verify graphs' inputs: b sequences (the first b rows) appending `width` tokens each (the last token
    and its drafts, padded: forward.verify_inputs). int64: input_ids, positions, slot_mapping (max_batch
    * width each), state slots [max_batch], per-position state slots [max_batch, width], logit rows
    (0..T-1, fixed); int32: sequence lengths [max_batch], row lengths [max_batch * width], page table
    [max_batch, page width]."""

    def __init__(self, max_batch: int, width: int, pages: int, device: torch.device):
        tokens = max_batch * width
        super().__init__(3 * tokens + max_batch * (width + 1) + tokens, max_batch + tokens + max_batch * pages, device)
        self.max_batch, self.width, self.pages = max_batch, width, pages
        self.qsl = torch.arange(max_batch + 1, dtype=torch.int32, device=device) * width
        h64, _ = self.host()
        h64[-tokens:] = np.arange(tokens)  # logit rows: every token, in both host images
        self._images[1][0].numpy()[-tokens:] = np.arange(tokens)

    def _views64(self, t: torch.Tensor | np.ndarray):
        mb, w = self.max_batch, self.width
        tokens = mb * w
        own = 3 * tokens + mb
        return (t[:tokens], t[tokens: 2 * tokens], t[2 * tokens: 3 * tokens], t[3 * tokens: own],
                t[own: own + mb * w].reshape(mb, w), t[own + mb * w:])

    def _views32(self, t: torch.Tensor | np.ndarray):
        mb, tokens = self.max_batch, self.max_batch * self.width
        return t[:mb], t[mb: mb + tokens], t[mb + tokens:].reshape(mb, self.pages)

    def placeholder(self) -> None:
        """Warm-up and capture inputs: rows of token 0 over page 0, every state slot 0."""
        h64, h32 = self.host()
        h64[: -self.max_batch * self.width] = 0
        h32[:] = 1
        self._views32(h32)[2][:] = 0
        self.upload()

    def fits(self, seqs) -> bool:
        return all(len(s.pages) <= self.pages for s in seqs)

    def load(self, h: HostInputs) -> None:
        """A verify batch's host arrays (forward.verify_inputs with this width) into the buffers."""
        b, w = len(h.query_lens), self.width
        h64, h32 = self.host()
        ids, pos, slots, own, scratch, _ = self._views64(h64)
        ids[: b * w], pos[: b * w], slots[: b * w] = h.input_ids, h.positions, h.slot_mapping
        own[:b] = h.state_slots
        scratch[:b] = h.verify_slots
        seq_lens, row_lens, table = self._views32(h32)
        seq_lens[:b] = h.seq_lens
        row_lens[: b * w] = h.row_seq_lens
        for i, pages in enumerate(h.page_tables):
            table[i, : len(pages)] = pages
        self.upload()

    def host_batch(self, b: int) -> ForwardBatch:
        """`batch(b)` with its lengths also on the host, for the CPU's reference kernels (where reading them is free)."""
        batch = self.batch(b)
        batch.seq_lens_cpu, batch.row_seq_lens_cpu = batch.seq_lens.tolist(), batch.row_seq_lens.tolist()
        return batch

    def load_pages(self, page_tables: list[list[int]], upload) -> None:
        """Rewrite the first rows' page tables on the device alone (queued copies, no host image): pages that
        sequences gained after their rows were loaded. upload(values, dtype): a device tensor of the values."""
        _, _, table = self._views32(self.i32)
        for i, pages in enumerate(page_tables):
            table[i, : len(pages)].copy_(upload(pages, torch.int32))

    def batch(self, b: int) -> ForwardBatch:
        w = self.width
        ids, pos, slots, own, scratch, logit_rows = self._views64(self.i64)
        seq_lens, row_lens, table = self._views32(self.i32)
        return ForwardBatch(
            input_ids=ids[: b * w], positions=pos[: b * w], query_start_loc=self.qsl[: b + 1],
            seq_lens=seq_lens[:b], page_table=table[:b], slot_mapping=slots[: b * w], state_slots=own[:b],
            query_lens_cpu=[w] * b, seq_lens_cpu=DeviceOnlyLengths([0] * b), logits_indices=logit_rows[: b * w],
            verify_width=w, row_seq_lens=row_lens[: b * w], verify_slots=scratch[:b],
        )


class SamplerInputs(StaticInputs):
    """The sampler graphs' per-row settings (batch b uses the first b columns). int64 rows:
    SamplingBatch.LONG_ROWS (top_k, seed, output index), then the lane; int32 rows hold the float32
    bits of SamplingBatch.FLOAT_ROWS."""

    LONGS = 4
    FLOATS = 5

    def __init__(self, max_batch: int, device: torch.device):
        super().__init__(self.LONGS * max_batch, self.FLOATS * max_batch, device)
        self.max_batch = max_batch

    def fill(self, top_k: list[int], seeds: list[int], steps: list[int], lanes: list[int],
             floats: list[list[float]]) -> None:
        """Each argument one value per row; floats: the five float rows in the order above."""
        h64, h32 = self.host()
        b, mb = len(lanes), self.max_batch
        longs, f32 = h64.reshape(self.LONGS, mb), h32.view(np.float32).reshape(self.FLOATS, mb)
        for row, values in enumerate((top_k, seeds, steps, lanes)):
            longs[row, :b] = values
        f32[:, :b] = floats
        self.upload()

    def placeholder(self) -> None:
        """Capture inputs: sampled rows (temperature 1, no truncation) on lane 0."""
        mb = self.max_batch
        self.fill([20] * mb, [0] * mb, [0] * mb, [0] * mb, [[1.0] * mb, [1.0] * mb, [0.0] * mb, [0.0] * mb, [0.0] * mb])

    def batch(self, b: int) -> tuple[SamplingBatch, torch.Tensor]:
        """The first b rows' SamplingBatch (views of the device buffers) and their lanes."""
        longs = self.i64.view(self.LONGS, self.max_batch)[:, :b]
        floats = self.i32.view(torch.float32).view(self.FLOATS, self.max_batch)[:, :b]
        return SamplingBatch.from_rows(floats, longs), longs[3]


class PieceGraphs:
    """One forward captured as several CUDA graphs, replayed back to back (`capture` with `split`).

    A CUDA graph launch costs the host time in proportion to its kernels, and the GPU starts on a graph
    only once its launch returns. Cut into pieces, the GPU runs the first (a few layers) while the host
    launches the rest. Under torch.profiler a 27B decode or verify graph's launch took ~1.1-1.2 ms on the
    H200 (bench/results/2026-12-04-h200-s14, --timeline), but that was mostly the profiler's: without it
    a plain step's whole program_submit is ~0.3 ms, and pieces gained 1.6 % at C=1 and 0.7 % at C=8
    (plain decode, 27B NVFP4), so they stay opt-in (NINFER_GRAPH_PIECES=1)."""

    def __init__(self, graphs: list[torch.cuda.CUDAGraph]):
        self.graphs = graphs

    def replay(self) -> None:
        for graph in self.graphs:
            graph.replay()

    def pool(self):
        return self.graphs[0].pool()


def capture(run, device: torch.device, *, warmups: int, pool=None, split=None):
    """Warm `run` up on a side stream (Triton JIT and autotune, cuBLAS heuristics, the allocator),
    then capture it; returns the graph and `run`'s output, which each replay rewrites.

    split: a context manager factory, split(cut), under which `run` calls cut() wherever the capture goes
    on in a new graph (ModelRunner: between decoder layers); the graph returned is then a PieceGraphs. Every
    piece records into the first one's memory pool (or `pool`), and what one piece leaves for the next stays
    referenced by `run` until it returns, so pieces replayed in order compute what one graph would."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmups):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    if split is None:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = run()
        return graph, out
    graphs: list[torch.cuda.CUDAGraph] = []

    def begin() -> None:
        graph = torch.cuda.CUDAGraph()
        shared = graphs[0].pool() if graphs else pool
        if shared is None:
            graph.capture_begin(capture_error_mode="thread_local")
        else:
            graph.capture_begin(pool=shared, capture_error_mode="thread_local")
        graphs.append(graph)

    def cut() -> None:
        graphs[-1].capture_end()
        begin()

    torch.cuda.synchronize(device)
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        begin()
        try:
            with split(cut):
                out = run()
        except BaseException:
            with contextlib.suppress(Exception):  # the capture's own error is the one to report
                graphs[-1].capture_end()
            raise
        graphs[-1].capture_end()
    torch.cuda.current_stream(device).wait_stream(stream)
    return PieceGraphs(graphs), out
