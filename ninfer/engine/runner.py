"""Turns scheduled sequences into tensors, runs one model traversal and samples on the device.

CUDA graphs for decode: at construction on a CUDA device (CUDA kernel backend active, graphs not
disabled), one graph per exact batch size 1..num_lanes is captured over static input buffers
(token ids, positions, seq lens, page table, slot mapping, state slots). A step whose every
sequence appends one token fills those buffers from the host with one pinned copy per dtype and
replays the graph of its batch size; anything else (prefill chunks, a sequence longer than the
page-table width of the graphs) runs eagerly. Graph and eager decode run the same kernels with the
same launch parameters, so greedy outputs agree exactly.

Host-to-device uploads go through pinned memory with non_blocking copies: a plain
`torch.tensor(..., device="cuda")` synchronizes the stream, which would stall the host on every
step. Nothing here reads the device back; the engine's `.tolist()` of sampled tokens is the one
synchronization per step.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from ninfer.engine.sampler import TOP_K_CAP, SamplingBatch, sample
from ninfer.engine.sequence import Sequence
from ninfer.kernels.backend import use_triton
from ninfer.models.batch import ForwardBatch, ModelCache

log = logging.getLogger("ninfer.engine")


class _DeviceOnlyLengths(list):
    """Host lengths of a captured batch: only their count is known. Reading a value means a kernel
    would bake one step's lengths into the graph, so it raises (and capture falls back to eager)."""

    def __getitem__(self, index):
        raise RuntimeError("a CUDA-graph decode batch has no host sequence lengths (reference kernel in graph?)")

    def __iter__(self):
        raise RuntimeError("a CUDA-graph decode batch has no host sequence lengths (reference kernel in graph?)")


class _DecodeBuffers:
    """Static device inputs of the decode graphs (batch b uses the first b rows) and their pinned host images."""

    def __init__(self, max_batch: int, width: int, device: torch.device):
        self.max_batch, self.width = max_batch, width
        # rows: input_ids, positions, slot_mapping, state_slots
        self.i64 = torch.zeros((4, max_batch), dtype=torch.int64, device=device)
        # seq_lens [max_batch] then the page table [max_batch, width]
        self.i32 = torch.zeros(max_batch * (1 + width), dtype=torch.int32, device=device)
        self.qsl = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.host_i64 = torch.zeros(self.i64.shape, dtype=torch.int64).pin_memory()
        self.host_i32 = torch.zeros(self.i32.shape, dtype=torch.int32).pin_memory()
        self.copied: torch.cuda.Event | None = None  # the last upload, before the host images are rewritten

    def reset(self) -> None:
        """Valid placeholder inputs for warm-up and capture: token 0 at position 0 in slot 0 of page 0."""
        self.host_i64.zero_()
        self.host_i32.zero_()
        self.host_i32[: self.max_batch] = 1
        self.upload()

    def upload(self) -> None:
        self.i64.copy_(self.host_i64, non_blocking=True)
        self.i32.copy_(self.host_i32, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()

    def batch(self, b: int) -> ForwardBatch:
        table = self.i32[self.max_batch:].view(self.max_batch, self.width)
        return ForwardBatch(
            input_ids=self.i64[0, :b], positions=self.i64[1, :b], query_start_loc=self.qsl[: b + 1],
            seq_lens=self.i32[:b], page_table=table[:b], slot_mapping=self.i64[2, :b], state_slots=self.i64[3, :b],
            query_lens_cpu=[1] * b, seq_lens_cpu=_DeviceOnlyLengths([0] * b),
        )


class ModelRunner:
    def __init__(self, model: torch.nn.Module, *, num_pages: int, page_size: int, num_state_slots: int,
                 num_lanes: int, vocab_size: int, device: torch.device, dtype: torch.dtype,
                 cuda_graphs: bool = True, max_seq_len: int | None = None, kv_dtype: str = "bf16"):
        self.model = model
        self.device = torch.device(device)
        self.page_size = page_size
        self.cache = ModelCache(model.cache_spec(), num_pages, page_size, num_state_slots, dtype, self.device,
                                kv_dtype=kv_dtype)
        # generated-token counts per lane, for presence/frequency penalties
        self.counts = torch.zeros((num_lanes, vocab_size), dtype=torch.float32, device=self.device)
        self.vocab_size = vocab_size
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_replays = 0
        self.eager_steps = 0
        self._buffers: _DecodeBuffers | None = None
        if self.device.type != "cuda":
            self.graph_status = "off: not a CUDA device"
        elif not cuda_graphs:
            self.graph_status = "off: disabled by setting (no_cuda_graph)"
        elif not use_triton(self.device):
            self.graph_status = "off: reference kernels read host lengths (NINFER_KERNELS=reference or no triton)"
        else:
            width = num_pages if max_seq_len is None else min(num_pages, -(-max_seq_len // page_size))
            self.graph_status = self._capture(num_lanes, max(1, width))
        log.info("decode CUDA graphs: %s", self.graph_status)

    # ---- uploads -----------------------------------------------------------------------------
    def _upload(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def _tensor(self, values, dtype: torch.dtype) -> torch.Tensor:
        return self._upload(torch.tensor(values, dtype=dtype))

    # ---- CUDA graphs -------------------------------------------------------------------------
    def _decode_logits(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.model(batch, self.cache)
        return self.model.compute_logits(hidden[batch.last_token_indices()])

    @torch.inference_mode()
    def _capture(self, max_batch: int, width: int) -> str:
        """Capture one decode graph per batch size, largest first, sharing one memory pool. Runs while
        the cache is empty: the placeholder inputs write slot 0 of page 0 and state slot 0, which no
        sequence has yet (and a fresh sequence never reads its state slot)."""
        buffers = self._buffers = _DecodeBuffers(max_batch, width, self.device)
        buffers.reset()
        side = torch.cuda.Stream(self.device)
        pool = None
        try:
            for b in range(max_batch, 0, -1):
                batch = buffers.batch(b)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):  # warm-up: Triton JIT, cuBLAS heuristics, allocator
                    for _ in range(2 if b == max_batch else 1):
                        self._decode_logits(batch)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    logits = self._decode_logits(batch)
                pool = graph.pool()
                self.graphs[b] = (graph, logits)
            torch.cuda.synchronize(self.device)
        except Exception as exc:  # e.g. a model path that reads the device back: run decode eagerly
            log.warning("decode CUDA graph capture failed, decode runs eagerly: %s", exc)
            self.graphs.clear()
            self._buffers = None
            try:
                torch.cuda.synchronize(self.device)
            except Exception:
                pass
            return f"off: capture failed ({type(exc).__name__}: {exc})"
        return f"on: batch sizes 1..{max_batch}, page-table width {width}"

    def _replay(self, seqs: list[Sequence], inputs: list[list[int]]) -> torch.Tensor | None:
        entry = self.graphs.get(len(seqs))
        buffers = self._buffers
        if entry is None or buffers is None:
            return None
        if any(len(s.pages) > buffers.width for s in seqs):
            return None
        if buffers.copied is not None and not buffers.copied.query():
            buffers.copied.synchronize()  # the previous upload must have read the host images (the
            # engine's per-step sync means it has: query() answers without blocking)
        h64: np.ndarray = buffers.host_i64.numpy()
        h32: np.ndarray = buffers.host_i32.numpy()
        ps, width, base = self.page_size, buffers.width, buffers.max_batch
        for i, (s, toks) in enumerate(zip(seqs, inputs)):
            pos = s.num_computed
            h64[0, i] = toks[0]
            h64[1, i] = pos
            h64[2, i] = s.pages[pos // ps] * ps + pos % ps
            h64[3, i] = s.state_slot if s.state_slot is not None else 0
            h32[i] = pos + 1
            h32[base + i * width: base + i * width + len(s.pages)] = s.pages
        buffers.upload()
        graph, logits = entry
        graph.replay()
        self.graph_replays += 1
        return logits

    # ---- public API --------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, seqs: list[Sequence], inputs: list[list[int]]) -> torch.Tensor:
        """Append inputs[i] to seqs[i]'s cache; returns float32 logits of each sequence's last new token.

        From a decode graph the logits are the graph's static output: read them (sample) before the
        next forward call.
        """
        if self.graphs and all(len(toks) == 1 for toks in inputs):
            logits = self._replay(seqs, inputs)
            if logits is not None:
                return logits
        self.eager_steps += 1
        batch = ForwardBatch.build(
            tokens=inputs,
            cached_lens=[s.num_computed for s in seqs],
            page_tables=[s.pages for s in seqs],
            page_size=self.page_size,
            state_slots=[s.state_slot if s.state_slot is not None else 0 for s in seqs],
            device="cpu",
        )
        if self.device.type != "cpu":
            for name in ("input_ids", "positions", "query_start_loc", "seq_lens", "page_table", "slot_mapping",
                         "state_slots"):
                setattr(batch, name, self._upload(getattr(batch, name)))
        hidden = self.model(batch, self.cache)
        return self.model.compute_logits(hidden[batch.last_token_indices()])

    def reset_lane(self, lane: int, output_ids: list[int]) -> None:
        """Start a lane's penalty counts over (from a restored request's committed output, if any)."""
        self.counts[lane].zero_()
        if output_ids:
            ids = self._tensor(output_ids, torch.long)
            self.counts[lane].index_add_(0, ids, torch.ones(len(output_ids), device=self.device))

    def count_tokens(self, lanes: list[int], token_ids: torch.Tensor | list[int]) -> None:
        if isinstance(token_ids, list):
            token_ids = self._tensor(token_ids, torch.long)
        # flat index_add_: no host sync on CUDA (an accumulating index_put_ may sort on the host side)
        flat = self._tensor(lanes, torch.long) * self.counts.shape[1] + token_ids.to(self.device).long()
        self.counts.view(-1).index_add_(0, flat, torch.ones(flat.shape, dtype=torch.float32, device=self.device))

    @torch.inference_mode()
    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        params = [s.sampling for s in seqs]
        floats = self._tensor([[p.temperature for p in params], [p.top_p for p in params],
                               [p.min_p for p in params], [p.presence_penalty for p in params],
                               [p.frequency_penalty for p in params]], torch.float32)
        longs = self._tensor([[p.top_k if 0 < p.top_k <= TOP_K_CAP else TOP_K_CAP for p in params],
                              [p.seed for p in params], [len(s.output_ids) for s in seqs],
                              [s.lane for s in seqs]], torch.long)
        batch = SamplingBatch(
            temperature=floats[0], top_p=floats[1], min_p=floats[2], presence_penalty=floats[3],
            frequency_penalty=floats[4], top_k=longs[0], seed=longs[1], step=longs[2],
        )
        width = min(self.vocab_size, logits.shape[1])  # drop padded embedding rows past the tokenizer
        counts = self.counts[longs[3], :width]
        return sample(logits[:, :width], batch, counts)
