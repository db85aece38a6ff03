"""Turns scheduled sequences into tensors, runs one model traversal and samples on the device.

CUDA graphs (ninfer.engine.graphs): at construction on a CUDA device (CUDA kernel backend active,
graphs not disabled), one decode graph per exact batch size 1..num_lanes, one sampler graph over
each decode graph's logits, one prefill graph for a full `prefill_chunk` of one sequence and the
prefill pieces' graphs (below) are captured over static input buffers. A forward whose shape has a
graph fills its buffers from the host (pinned copies) and replays it; anything else (a batch of
several prefills, a sequence longer than the graphs' page-table width) runs eagerly.
Graph and eager runs launch the same kernels with the same parameters, so outputs agree exactly.

Prefill pieces (on CUDA devices by default; NINFER_PREFILL_PIECES=0 or 1 overrides): a prefill
shorter than the chunk (most prompts, and every prompt's last chunk) replays graphs of power-of-two
sizes (and the chunk's), the last one padded (ForwardBatch.num_valid: padding writes no KV and leaves
the recurrent state alone), instead of one eager forward whose ~2,500 kernel launches cost the host
more than the GPU work of a short prompt. `prefill_plan` picks the sizes by a cost model: a forward
costs about the same up to a knee of tokens (its weight reads) and its compute beyond; on a dense
bf16 model 100 tokens replay the 128-token graph once, 520 tokens the 512 graph and then the 8, 960
tokens the chunk's graph; a MoE model (knee 1024) replays one padded graph for any of them. The plan
does not depend on whether graphs exist, so --no-cuda-graph computes exactly what the graphs compute
(each planned piece as one eager forward).

Sampling: on CUDA the fused Triton sampler (ninfer.kernels.triton_sampler) when it draws the torch
sampler's tokens in a start-up check on this device, else the torch sampler (ninfer.engine.sampler).

Host-to-device uploads go through pinned memory with non_blocking copies: a plain
`torch.tensor(..., device="cuda")` synchronizes the stream, which would stall the host on every
step. Nothing here reads the device back; the engine's `.tolist()` of sampled tokens is the one
synchronization per step.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from ninfer.engine import media_inputs, transfers
from ninfer.engine.graphs import DecodeInputs, PrefillInputs, SamplerInputs, VerifyInputs, capture
from ninfer.engine.plan import RunnerOutput, StepPlan
from ninfer.engine.sampler import TOP_K_CAP, SamplingBatch, sample
from ninfer.engine.sequence import Sequence
from ninfer.engine.speculative import StagedDrafts, stage_drafts, staged_drafts
from ninfer.forward import CacheSpec, ForwardBatch, ModelCache, verify_inputs
from ninfer.kernels.backend import use_triton
from ninfer.kernels.linear import rows_like

log = logging.getLogger("ninfer.engine")
PIECES_ENV = "NINFER_PREFILL_PIECES"
# NINFER_GRAPH_PIECES=1: decode and verify graphs are captured in pieces (graphs.PieceGraphs), cut between
# decoder layers (graph_cut_layers), so the GPU starts a step while the host still launches most of it
GRAPH_PIECES_ENV = "NINFER_GRAPH_PIECES"
# "1": a speculative rollback copies the accepted state back instead of trading slots (ModelRunner.rollback)
ROLLBACK_COPY_ENV = "NINFER_ROLLBACK_COPY"
# The prefill plan's cost model, in tokens: a forward of up to `knee` tokens costs about the same (its
# weight reads), beyond that its compute; each replay adds REPLAY_COST (the step's small kernels and
# launch). The knee depends on the model (`piece_costs`; H200, bench/results/2026-11-30-h200-s9/call3-5):
# - dense bf16, PIECE_KNEE: 2 bytes per weight at ~4.2 TB/s against 2 FLOPs per weight and token at
#   ~750 TFLOP/s, ~180 tokens. 27B: 100 tokens padded to 128 take 22 ms, 520 as 512 + 8 65 ms, 700 as
#   512 + 256 75 ms, 960 padded to 1024 86 ms (one eager forward: 93-100 ms at every length);
# - NVFP4 weights, KNEE_NVFP4: a prefill forward of more than GEMV_MAX_M tokens dequantizes every
#   weight (~4.5 bytes moved per weight); up to HFMA_MAX_M (8) the register-fed NVFP4 GEMV reads the
#   packed weights once, and the dense knee holds (9-16 tokens: a slower GEMV, ~29 ms a forward at
#   27B). 27B: 128 tokens 41 ms, 256 + 64 84 ms, 512 63 ms, 512 + 8 82 ms, 512 + 16 + 16 121 ms,
#   1024 103-108 ms;
# - MoE, KNEE_MOE: a few hundred tokens touch every expert, and the grouped GEMMs run below the dense
#   rate. 35B-A3B bf16: 128 tokens 25 ms, 1024 48 ms, 512 + 256 67 ms.
PIECE_KNEE = 128
KNEE_NVFP4 = 512
KNEE_MOE = 1024
REPLAY_COST = 16


@dataclass
class GraphEntry:
    """A captured forward: the graph, its logits (rewritten by each replay) and its static inputs."""

    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor
    inputs: DecodeInputs | PrefillInputs | VerifyInputs
    hidden: torch.Tensor | None = None  # the logit rows' final hidden states (a static output too)
    all_hidden: torch.Tensor | None = None  # every token's final hidden states (static as well)


@dataclass
class Launch:
    """A step's forwards as `launch` queued them: each forward's sampled ids on the device (the prefill chunk's,
    then the decode batch's), the logit rows' hidden states kept for drafters, the prefill's every-token ones, the
    verify's drafts still on the device, and the read back of the ids (and drafts) already queued into pinned host
    memory (`ready` once it has landed: collect waits for that, not for whatever was queued after it). verify: the
    static rows the verify forward read (VerifyInputs, batch, width), which `launch_next_round` advances. A queued
    round also carries the counts the device assumed the round before it commits (`assumed_counts`)."""

    tokens: list[torch.Tensor] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)
    prefill_hidden: torch.Tensor | None = None
    staged: StagedDrafts | None = None
    host: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    verify: tuple | None = None
    assumed: torch.Tensor | None = None  # a queued round: the last round's committed counts it was derived from
    assumed_ready: torch.cuda.Event | None = None

    def assumed_counts(self) -> list[int]:
        """The committed counts (one per row) the device derived this queued round's inputs from; waits for their
        copy, queued right after they were computed (before this round's verify)."""
        if self.assumed_ready is not None:
            self.assumed_ready.synchronize()
        return self.assumed.tolist()


@dataclass(frozen=True)
class PieceCosts:
    """The cost model of one model's forwards (above): `knee`, or PIECE_KNEE up to `small_rows` tokens."""

    knee: int = PIECE_KNEE
    small_rows: int = 0

    def cost(self, size: int) -> int:
        return max(size, PIECE_KNEE if size <= self.small_rows else self.knee) + REPLAY_COST


def piece_costs(model: torch.nn.Module) -> PieceCosts:
    """The cost model for this model's kind (above)."""
    from ninfer.kernels.moe import Experts
    from ninfer.kernels.triton_nvfp4 import HFMA_MAX_M
    from ninfer.quant.nvfp4 import NVFP4Experts, NVFP4Linear

    kinds = {type(m) for m in model.modules()}
    if kinds & {Experts, NVFP4Experts}:
        return PieceCosts(KNEE_MOE)
    return PieceCosts(KNEE_NVFP4, HFMA_MAX_M) if NVFP4Linear in kinds else PieceCosts()


def graph_cut_layers(num_layers: int) -> frozenset[int]:
    """The decoder layers after which a piecewise decode or verify capture starts its next graph: after 1/16
    of the layers, 1/4 and 5/8 (64 layers: pieces of 4, 12, 24 and 24 layers, the logits in the last). The
    first piece launches quickly; each later one launches while the GPU runs the ones before."""
    cuts = {round(num_layers * f) - 1 for f in (1 / 16, 1 / 4, 5 / 8)}
    return frozenset(c for c in cuts if 0 <= c < num_layers - 1)


def piece_sizes(chunk: int) -> list[int]:
    """The powers of two below `chunk`, largest first: the piece graphs' sizes."""
    sizes = [1]
    while sizes[-1] * 2 < chunk:
        sizes.append(sizes[-1] * 2)
    return sizes[::-1] if chunk > 1 else []


def prefill_plan(n: int, sizes: list[int], chunk: int, costs: PieceCosts = PieceCosts()) -> list[int]:
    """The forwards that prefill n tokens (0 < n <= chunk) of one sequence: sizes from `sizes` (powers of
    two, largest first) or the chunk, each taking that many tokens except the last, which may take
    fewer (padded). The cheapest plan under the cost model above (ties: the fewest forwards)."""
    cost = costs.cost

    def best(m: int) -> tuple[int, list[int]]:
        up = min((s for s in [chunk, *sizes] if s >= m), default=chunk)  # one forward, padded
        plan = (cost(up), [up])
        down = max((s for s in sizes if s < m), default=0)  # the biggest piece, then the rest
        if down:
            rest_cost, rest = best(m - down)
            if cost(down) + rest_cost < plan[0]:
                plan = (cost(down) + rest_cost, [down, *rest])
        return plan

    if not 0 < n <= chunk:
        raise ValueError(f"a prefill plan covers 1..{chunk} tokens, not {n}")
    return best(n)[1]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, *, num_pages: int, page_size: int, num_state_slots: int,
                 num_lanes: int, vocab_size: int, device: torch.device, dtype: torch.dtype,
                 cuda_graphs: bool = True, max_seq_len: int | None = None, kv_dtype: str = "bf16",
                 prefill_chunk: int | None = None, prefill_pieces: bool | None = None, draft_tokens: int = 0,
                 cache_spec: CacheSpec | None = None, exact_verify: bool = True,
                 feature_layers: tuple[int, ...] = ()):
        """draft_tokens: the most drafts a decode row may carry (speculative decoding; 0: none). Hybrid
        models then get draft_tokens + 1 state slots per lane after the live slots: a verify forward keeps
        the recurrent state after each verified position there (ForwardBatch.verify_slots) and only reads the
        sequence's own slot, and `rollback` makes the accepted one the sequence's state slot (it trades slots
        with the lane). Leaving the own slot untouched is what lets the engine queue the next round's verify
        before this one is read back: a row that turns out finished keeps its state (Engine, overlapped rounds).
        Verify forwards of every batch size replay CUDA graphs of width draft_tokens + 1 (shorter rows padded).
        cache_spec: the cache to allocate (default the model's; a drafter may ride in it as extra layers).
        exact_verify: verified positions round exactly as plain decode steps (`verify`).
        feature_layers: the hidden states handed to drafters (RunnerOutput.hidden / prefill_hidden) are these
        decoder layers' outputs, concatenated (a block drafter's target layers), not the final ones.
        prefill_chunk: the engine's chunk length, for the prefill graph (None: no prefill graph).
        prefill_pieces: cut shorter prefills into power-of-two pieces (None: NINFER_PREFILL_PIECES if set,
        else on CUDA devices only: on CPU there are no graphs to replay)."""
        self.model = model
        self.vision_tower: torch.nn.Module | None = None  # set by the loader with --vision (media_inputs)
        self.device = torch.device(device)
        self.page_size = page_size
        self.draft_tokens = draft_tokens
        self.exact_verify = exact_verify
        self.feature_layers = tuple(feature_layers)
        if self.feature_layers:  # before any graph is captured: the features become a static output
            model.capture_layers = self.feature_layers
        # the state of lane l after verified position j goes to lane_slots[l][j]: at first the rows after the
        # live slots, then whichever rows rollback traded for them
        per_lane = draft_tokens + 1 if draft_tokens else 0
        verify_slots = num_lanes * per_lane if num_state_slots else 0
        first = [num_state_slots + lane * per_lane for lane in range(num_lanes if verify_slots else 0)]
        self.lane_slots = [list(range(f, f + per_lane)) for f in first]
        self.copy_rollback = os.environ.get(ROLLBACK_COPY_ENV) == "1"
        self.cache = ModelCache(cache_spec or model.cache_spec(), num_pages, page_size, num_state_slots + verify_slots,
                                dtype, self.device, kv_dtype=kv_dtype)
        # generated-token counts per lane, for presence/frequency penalties
        self.counts = torch.zeros((num_lanes, vocab_size), dtype=torch.float32, device=self.device)
        self.vocab_size = vocab_size
        # captured forwards keyed by (batch, tokens per sequence). `graphs` give a logit row per token:
        # decode (b, 1), and speculative verification (b, k + 1) once it captures; `prefill_graphs` give
        # the last real token's row: the prefill chunk (1, chunk) and the prefill pieces (1, size)
        self.graphs: dict[tuple[int, int], GraphEntry] = {}
        self.prefill_graphs: dict[tuple[int, int], GraphEntry] = {}
        self.graph_replays = 0  # decode replays
        self.last_hidden: torch.Tensor | None = None  # the last forward's logit rows' hidden states
        # the sampler over each decode graph's logits, by batch size (sampled tokens as output)
        self.sampler_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.sampler_replays = 0
        if prefill_pieces is None:
            env = os.environ.get(PIECES_ENV)
            prefill_pieces = env == "1" if env in ("0", "1") else self.device.type == "cuda"
        self.prefill_chunk = prefill_chunk or 0
        self.prefill_pieces = piece_sizes(self.prefill_chunk) if prefill_pieces else []
        self.piece_costs = piece_costs(model)
        self.prefill_replays = 0
        self.eager_steps = 0
        layers = getattr(model, "layers", None)
        self.graph_cuts = (graph_cut_layers(len(layers)) if os.environ.get(GRAPH_PIECES_ENV) == "1"
                           and hasattr(model, "graph_cuts") and layers is not None else frozenset())
        self._decode_inputs: DecodeInputs | None = None
        self.last_verify_width = 0  # the last verify forward's tokens per sequence (rollback reads it)
        self.last_verify_ids: torch.Tensor | None = None  # [B, width] input ids of the last verify forward
        self.last_all_hidden: torch.Tensor | None = None  # the last forward's every-token hidden states
        self._token_rows: list[torch.Tensor] | None = None  # a prefill's, while plan.want_prefill_hidden
        self._verify_rows: dict[int, VerifyInputs] = {}  # CPU: the verify rows by width, laid out as a graph's
        self.last_verify_rows: tuple | None = None  # (VerifyInputs, batch, width) of the last verify, when static
        self._sampler_inputs: SamplerInputs | None = None
        self.fused_sampler = False
        self.sampler_status = self._choose_sampler()
        log.info("sampler: %s", self.sampler_status)
        self.nvfp4_status = self._choose_nvfp4_gemv()
        if self.nvfp4_status:
            log.info("NVFP4 GEMV: %s", self.nvfp4_status)
        if self.device.type != "cuda":
            self.graph_status = "off: not a CUDA device"
        elif not cuda_graphs:
            self.graph_status = "off: disabled by setting (no_cuda_graph)"
        elif not use_triton(self.device):
            self.graph_status = "off: reference kernels read host lengths (NINFER_KERNELS=reference or no triton)"
        else:
            width = max(1, num_pages if max_seq_len is None else min(num_pages, -(-max_seq_len // page_size)))
            self.graph_status = self._capture_decode(num_lanes, width)
            if self.graphs:
                self.graph_status += "; " + self._capture_sampler(num_lanes)
            if self.graphs and draft_tokens:
                self.graph_status += "; " + self._capture_verify(num_lanes, draft_tokens, width)
            if prefill_chunk:
                self.graph_status += "; " + self._capture_prefill(prefill_chunk, width)
        log.info("CUDA graphs: %s", self.graph_status)

    # ---- uploads -----------------------------------------------------------------------------
    def _upload(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def _tensor(self, values, dtype: torch.dtype) -> torch.Tensor:
        return self._upload(torch.tensor(values, dtype=dtype))

    def _choose_sampler(self) -> str:
        """The fused Triton sampler on CUDA when it draws the torch sampler's tokens on this device
        (checked once, here); NINFER_SAMPLER=torch keeps the torch sampler."""
        if not use_triton(self.device):
            return "torch (not on a CUDA device with the Triton backend)"
        if os.environ.get("NINFER_SAMPLER", "").strip().lower() == "torch":
            return "torch (NINFER_SAMPLER=torch)"
        from ninfer.kernels.triton_sampler import check_against_reference

        problem = check_against_reference(self.device, width=max(self.vocab_size, 64))  # the serving shapes
        if problem is not None:
            log.warning("fused sampler failed its start-up check, the torch sampler runs: %s", problem)
            return f"torch (fused sampler failed its check: {problem})"
        self.fused_sampler = True
        return "fused Triton kernels"

    def _choose_nvfp4_gemv(self) -> str | None:
        """With NVFP4 weights on CUDA: whether the tensor-core GEMV passes its check on this device
        (once, before any graph is captured), and in a speculative engine its linears stored paired for it;
        None without NVFP4 weights."""
        from ninfer.quant.nvfp4 import NVFP4Linear

        if not use_triton(self.device) or not any(isinstance(m, NVFP4Linear) for m in self.model.modules()):
            return None
        from ninfer.kernels.triton_nvfp4 import pair_model_for_mma_, use_mma

        status = use_mma(self.device, speculative=self.draft_tokens > 0)
        paired = pair_model_for_mma_(self.model) if self.draft_tokens > 0 else 0
        tiled = sum(1 for m in self.model.modules() if isinstance(m, NVFP4Linear) and m.tiled)
        return (status + (f"; {paired} linears stored paired (two steps a load)" if paired else "")
                + (f", {tiled} of them tiled (16 rows a run)" if tiled else ""))

    # ---- CUDA graphs -------------------------------------------------------------------------
    def _logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits of the batch's logit rows; their final hidden states stay in `last_hidden` (drafters read
        them; under capture the tensor is the graph's, rewritten by each replay)."""
        batch.derived.clear()  # recomputed inside this forward (and inside a graph being captured)
        hidden = self.model(batch, self.cache)
        rows = batch.logit_indices()
        # what drafters read: the final hidden states, or a block drafter's target-layer features
        source = self.model.captured if self.feature_layers else hidden
        self.last_all_hidden = source
        self.last_hidden = source[rows]
        return self.model.compute_logits(hidden[rows] if self.feature_layers else self.last_hidden)

    @contextlib.contextmanager
    def _pieces(self, cut):
        """While a forward is captured in pieces: the model calls `cut` after each layer of graph_cuts."""
        self.model.graph_cuts, self.model.graph_cut = self.graph_cuts, cut
        try:
            yield
        finally:
            self.model.graph_cuts, self.model.graph_cut = frozenset(), None

    @property
    def _split(self):
        return self._pieces if self.graph_cuts else None

    def _capture_failed(self, what: str, exc: Exception) -> str:
        """Log a failed capture; returns the reason for graph_status."""
        log.warning("%s CUDA graph capture failed, %s runs eagerly: %s", what, what, exc)
        try:
            torch.cuda.synchronize(self.device)
        except Exception:
            pass
        return f"capture failed ({type(exc).__name__}: {exc})"

    @torch.inference_mode()
    def _capture_decode(self, max_batch: int, width: int) -> str:
        """Capture one decode graph per batch size, largest first, sharing one memory pool. Runs while
        the cache is empty: the placeholder inputs write slot 0 of page 0 and state slot 0, which no
        sequence has yet (and a fresh sequence never reads its state slot)."""
        inputs = self._decode_inputs = DecodeInputs(max_batch, width, self.device)
        inputs.placeholder()
        pool = None
        try:
            for b in range(max_batch, 0, -1):
                batch = inputs.batch(b)
                graph, logits = capture(lambda batch=batch: self._logits(batch), self.device,
                                        warmups=2 if b == max_batch else 1, pool=pool, split=self._split)
                pool = graph.pool()
                self.graphs[(b, 1)] = GraphEntry(graph, logits, inputs, self.last_hidden, self.last_all_hidden)
            torch.cuda.synchronize(self.device)
        except Exception as exc:  # e.g. a model path that reads the device back: run decode eagerly
            self.graphs.clear()
            self._decode_inputs = None
            if self.graph_cuts:  # captured whole instead
                self._capture_failed("piecewise decode", exc)
                self.graph_cuts = frozenset()
                return self._capture_decode(max_batch, width)
            return "off: " + self._capture_failed("decode", exc)
        pieces = f", {len(self.graph_cuts) + 1} pieces each" if self.graph_cuts else ""
        return f"on: batch sizes 1..{max_batch}, page-table width {width}{pieces}"

    @torch.inference_mode()
    def _capture_verify(self, max_batch: int, max_drafts: int, pages: int) -> str:
        """One verify graph per batch size and width 2..max_drafts+1 (tokens per sequence), in the decode
        graphs' pool: a verify forward and a decode forward never run in the same step. Placeholder rows
        write page 0's slots and state slot 0, as the decode capture does."""
        pool = self.graphs[(max_batch, 1)].graph.pool()
        captured = []
        try:
            for width in range(max_drafts + 1, 1, -1):
                inputs = VerifyInputs(max_batch, width, pages, self.device)
                inputs.placeholder()
                for b in range(max_batch, 0, -1):
                    batch = inputs.batch(b)
                    with self._verify_shapes(b):  # launched (and captured) with the decode batch's matmuls
                        graph, logits = capture(lambda batch=batch: self._logits(batch), self.device, warmups=1,
                                                pool=pool, split=self._split)
                    self.graphs[(b, width)] = GraphEntry(graph, logits, inputs, self.last_hidden, self.last_all_hidden)
                    captured.append((b, width))
            torch.cuda.synchronize(self.device)
        except Exception as exc:
            for key in captured:
                self.graphs.pop(key, None)
            if self.graph_cuts:  # captured whole instead
                self._capture_failed("piecewise verify", exc)
                self.graph_cuts = frozenset()
                return self._capture_verify(max_batch, max_drafts, pages)
            return "verify eager: " + self._capture_failed("verify", exc)
        return f"verify graphs of 2..{max_drafts + 1} tokens per sequence"

    @torch.inference_mode()
    def _capture_sampler(self, max_batch: int) -> str:
        """Capture the full sampler (penalties, top-k/top-p/min-p, counter-based noise) over each decode
        graph's logits, in the decode graphs' memory pool (a sampler replay follows its decode replay
        on the same stream, so their temporaries never overlap in time). Eagerly the sampler issues
        small launches per step (~60 for the torch sampler, two plus the uploads for the fused one),
        each with its Python; replayed, one."""
        inputs = self._sampler_inputs = SamplerInputs(max_batch, self.device)
        inputs.placeholder()
        pool = self.graphs[(max_batch, 1)].graph.pool()
        try:
            for b in range(max_batch, 0, -1):
                logits = self.graphs[(b, 1)].logits
                width = min(self.vocab_size, logits.shape[1])
                batch, lanes = inputs.batch(b)
                graph, tokens = capture(
                    lambda logits=logits, width=width, batch=batch, lanes=lanes:
                        self._sample_rows(logits[:, :width], batch, lanes),
                    self.device, warmups=1, pool=pool)
                self.sampler_graphs[(b, 1)] = (graph, tokens)
            torch.cuda.synchronize(self.device)
        except Exception as exc:
            self.sampler_graphs.clear()
            self._sampler_inputs = None
            return "sampling eager: " + self._capture_failed("sampler", exc)
        return "sampling in graphs"

    @torch.inference_mode()
    def _capture_prefill(self, tokens: int, width: int) -> str:
        """Capture the graph of one sequence's `tokens`-token prefill chunk (its own memory pool, about
        one chunk's eager workspace; kv_sizing reserves it). Runs while the cache is empty, like the
        decode capture: the placeholder chunk writes the first pages and state slot 0."""
        if -(-tokens // self.page_size) > min(width, self.cache.num_pages):
            return "prefill off: a chunk needs more pages than the page table holds"
        if tokens < 2:
            return "prefill off: a one-token chunk replays the decode graph"
        inputs = PrefillInputs(tokens, width, self.device)
        inputs.placeholder(self.page_size)
        batch = inputs.batch()
        try:
            graph, logits = capture(lambda: self._logits(batch), self.device, warmups=1)
            self.prefill_graphs[(1, tokens)] = GraphEntry(graph, logits, inputs, self.last_hidden, self.last_all_hidden)
            torch.cuda.synchronize(self.device)
        except Exception as exc:  # e.g. a MoE routing step that reads group sizes back to the host
            self.prefill_graphs.pop((1, tokens), None)
            self.prefill_pieces = []  # nothing to replay: a shorter prefill is one eager forward
            return "prefill off: " + self._capture_failed("prefill", exc)
        status = f"prefill chunk of {tokens} tokens"
        if self.prefill_pieces:
            status += "; " + self._capture_pieces(width)
        return status

    @torch.inference_mode()
    def _capture_pieces(self, width: int) -> str:
        """One graph per prefill piece size (2 tokens and more), in the prefill graph's memory pool:
        pieces run one after another and each piece's temporaries die with it. A piece graph's
        logits may share memory with another's temporaries: read them before the next forward."""
        pool = self.prefill_graphs[(1, self.prefill_chunk)].graph.pool()
        pieces = []
        try:
            for size in self.prefill_pieces:
                if size == 1:
                    continue
                inputs = PrefillInputs(size, width, self.device)
                inputs.placeholder(self.page_size)
                batch = inputs.batch()
                graph, logits = capture(lambda batch=batch: self._logits(batch), self.device, warmups=1, pool=pool)
                self.prefill_graphs[(1, size)] = GraphEntry(graph, logits, inputs, self.last_hidden,
                                                            self.last_all_hidden)
                pieces.append(size)
            torch.cuda.synchronize(self.device)
        except Exception as exc:  # no pieces then: a shorter prefill runs as one eager forward again
            for captured in self.prefill_pieces:
                self.prefill_graphs.pop((1, captured), None)
            self.prefill_pieces = []
            return "prefill pieces off: " + self._capture_failed("prefill piece", exc)
        return f"prefill pieces of {min(pieces, default=1)}..{max(pieces, default=1)} tokens"

    @property
    def prefill_graph(self) -> GraphEntry | None:
        """The full-chunk prefill graph, if captured."""
        return self.prefill_graphs.get((1, self.prefill_chunk))

    def _replay(self, seqs: list[Sequence], inputs: list[list[int]], pad_to: int | None = None,
                all_logits: bool = False) -> torch.Tensor | None:
        """Replay the graph captured for this forward's (batch, tokens per sequence), one sequence padded
        to `pad_to` tokens taking the prefill graph of that size; None when none fits."""
        n = pad_to or len(inputs[0])
        if any(len(t) != len(inputs[0]) for t in inputs) or any(getattr(s, "mrope", None) is not None for s in seqs):
            return None  # ragged rows, or MRoPE positions (the graphs' buffers hold one position per token)
        if n > 1 and all_logits:
            return None  # verification rows: `verify`
        entry = (self.graphs if n == 1 else self.prefill_graphs).get((len(seqs), n))
        if entry is None:
            return None
        if n == 1:
            if any(len(s.pages) > entry.inputs.width for s in seqs):
                return None
            entry.inputs.fill(seqs, inputs, self.page_size)
            entry.graph.replay()
            self.graph_replays += 1
            self.last_hidden, self.last_all_hidden = entry.hidden, entry.all_hidden
            return entry.logits
        if len(seqs) != 1:
            return None
        seq, prefill = seqs[0], entry.inputs
        if not prefill.fits(seq.num_computed, seq.pages, self.page_size):
            return None
        prefill.fill(inputs[0], seq.num_computed, seq.pages, seq.state_slot if seq.state_slot is not None else 0,
                     self.page_size)
        entry.graph.replay()
        self.prefill_replays += 1
        self.last_hidden, self.last_all_hidden = entry.hidden, entry.all_hidden
        return entry.logits

    # ---- public API --------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, seqs: list[Sequence], inputs: list[list[int]], all_logits: bool = False) -> torch.Tensor:
        """Append inputs[i] to seqs[i]'s cache at its computed frontier; returns float32 logits of each
        sequence's last new token (all_logits: of every new token, sequence by sequence).

        From a graph the logits are the graph's static output: read them (sample) before the next
        forward call.
        """
        if (not all_logits and self.prefill_pieces and len(seqs) == 1 and 1 < len(inputs[0]) < self.prefill_chunk
                and getattr(seqs[0], "mrope", None) is None):
            return self._forward_pieces(seqs[0], inputs[0])
        logits = self._replay(seqs, inputs, all_logits=all_logits)
        logits = logits if logits is not None else self.forward_eager(seqs, inputs, all_logits=all_logits)
        self._keep_token_rows(sum(len(t) for t in inputs))
        return logits

    def _keep_token_rows(self, n: int) -> None:
        """While a prefill's hidden states are collected (plan.want_prefill_hidden): the last forward's
        first n rows (its real tokens), copied before the next forward rewrites a graph's."""
        if self._token_rows is not None:
            self._token_rows.append(self.last_all_hidden[:n].clone())

    def _forward_pieces(self, seq: Sequence, tokens: list[int]) -> torch.Tensor:
        """A shorter prefill by its plan: each piece replayed (or eager where no graph fits), the last
        one padded where the plan says so; the logits of the last real token."""
        start, logits = 0, None
        for size in prefill_plan(len(tokens), self.prefill_pieces, self.prefill_chunk, self.piece_costs):
            # the piece continues the sequence: same pages and state slot, `start` more tokens cached
            piece = SimpleNamespace(num_computed=seq.num_computed + start, pages=seq.pages,
                                    state_slot=seq.state_slot)
            part = [tokens[start:start + size]]
            pad_to = size if len(part[0]) < size else None
            logits = self._replay([piece], part, pad_to)
            if logits is None:
                logits = self.forward_eager([piece], part, pad_to)
            self._keep_token_rows(len(part[0]))
            start += size
        return logits

    @torch.inference_mode()
    def forward_eager(self, seqs: list[Sequence], inputs: list[list[int]], pad_to: int | None = None,
                      all_logits: bool = False) -> torch.Tensor:
        """`forward` without graphs (benchmarks compare the two); pad_to: one sequence padded to that many
        tokens (ForwardBatch.build). Positions come from each sequence: its MRoPE positions where it has
        them (Sequence.positions), else its token indices."""
        self.eager_steps += 1
        batch = ForwardBatch.build(
            tokens=inputs,
            cached_lens=[s.num_computed for s in seqs],
            page_tables=[s.pages for s in seqs],
            page_size=self.page_size,
            state_slots=[s.state_slot if s.state_slot is not None else 0 for s in seqs],
            device="cpu",
            pad_to=pad_to,
            positions=[_positions(s, len(t)) for s, t in zip(seqs, inputs)],
            all_logits=all_logits,
        )
        if self.device.type != "cpu":
            for name in ("input_ids", "positions", "query_start_loc", "seq_lens", "page_table", "slot_mapping",
                         "state_slots", "num_valid", "logits_indices"):
                if getattr(batch, name) is not None:
                    setattr(batch, name, self._upload(getattr(batch, name)))
        # media pads in these rows: the vision tower's embeddings replace theirs (MRoPE sequences only,
        # which never take the graphs or the prefill pieces)
        batch.inputs_embeds = media_inputs.chunk_embeds(self.vision_tower, self.model, seqs, inputs, batch.input_ids)
        return self._logits(batch)

    # ---- the step contract ------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> RunnerOutput:
        """Run a plan's forwards and samplers (its context copies run before and after, elsewhere)."""
        return self.collect(plan, self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> Launch:
        """Queue the plan's forwards and samplers without waiting for the device: the prefill chunk (one
        row, its last token, when it samples), then the decode batch in one traversal (a row per token of
        each work: the input token and its drafts); then the read back of the sampled ids."""
        launch = Launch()
        if plan.prefill is not None:
            work = plan.prefill
            self._token_rows = [] if plan.want_prefill_hidden else None
            logits = self.forward([work.seq], [work.tokens])
            if self._token_rows is not None:
                rows, self._token_rows = self._token_rows, None
                launch.prefill_hidden = torch.cat(rows) if len(rows) > 1 else rows[0]
            self._keep_hidden(plan, launch, rows=1)
            if work.sample:  # cloned: from a graph it is a static output the decode step rewrites
                launch.tokens.append(self.sample([work.seq], logits).clone())
        if plan.decode:
            seqs, rows = [w.seq for w in plan.decode], [w.tokens for w in plan.decode]
            if all(len(r) == 1 for r in rows):
                logits = self.forward(seqs, rows)
                self._keep_hidden(plan, launch, rows=len(rows))
                launch.tokens.append(self.sample(seqs, logits))
            else:
                width = max(len(r) for r in rows)
                launch.staged = staged_drafts(plan.decode)
                logits = self.verify(seqs, rows, width, drafts=launch.staged)
                launch.verify = self.last_verify_rows
                self._keep_hidden(plan, launch, rows=len(rows) * width, width=width, lens=[len(r) for r in rows])
                per_row = [s for s in seqs for _ in range(width)]
                steps = [len(s.output_ids) + j for s in seqs for j in range(width)]
                launch.tokens.append(self._real_rows(
                    self.sample(per_row, logits, steps=steps, window=self.last_verify_ids), rows, width))
        self._read_back(launch)
        return launch

    def _read_back(self, launch: Launch) -> None:
        """Queue the copy of the launch's sampled ids (and staged drafts) to pinned host memory, with an event: the
        engine may queue the next round before it reads this one back (Engine, overlapped rounds)."""
        parts = list(launch.tokens)
        if launch.staged is not None and parts:
            parts.append(launch.staged.table.reshape(-1).to(parts[-1].dtype))
        if not parts:
            return
        launch.host, launch.ready = self._to_host(torch.cat(parts) if len(parts) > 1 else parts[0])

    def _to_host(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A copy of `values` queued into pinned host memory, and the event after it (on the CPU: the values, None)."""
        if self.device.type != "cuda":
            return values, None
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready

    def _real_rows(self, tokens: torch.Tensor, rows: list[list[int]], width: int) -> torch.Tensor:
        """A padded verify batch's sampled tokens without the padding's rows (in order, as collect reads them)."""
        if all(len(r) == width for r in rows):
            return tokens
        keep = [i * width + j for i, r in enumerate(rows) for j in range(len(r))]
        return tokens[self._tensor(keep, torch.long)]

    @torch.inference_mode()
    def verify(self, seqs: list[Sequence], rows: list[list[int]], width: int | None = None,
               drafts: StagedDrafts | None = None) -> torch.Tensor:
        """One traversal over each sequence's last token and drafts (rows[i], padded to `width`): float32
        logits of every position [B * width, V], from the verify graph of this batch size when captured
        (MRoPE sequences run eagerly). Recurrent state: see ModelRunner.__init__ and `rollback`.

        Every position computes what a plain decode step of these B sequences computes there: attention
        as one-query decode rows, the recurrent layers stepped with the decode kernels, and the decode
        GEMV's matmuls run with the B-row problem's config (ninfer.kernels.linear.rows_like), so bf16
        rounding, and with it greedy output, is the same with and without drafts. That costs weight
        traffic where the B-row config streams the weights once per B rows (CUDA-core configs, B <= 2):
        exact_verify=False runs all rows as one product instead (measured: k=3 verify 1.10x a plain step
        at the 27B shape, C=1), with rounding that may differ from plain decoding in the last bits.

        drafts: drafts still on the device (speculative.stage_drafts), copied into the input ids there;
        the rows hold placeholders in their place."""
        width = width or max(len(r) for r in rows)
        if width - 1 > self.draft_tokens:
            raise ValueError(f"a verify row of {width} tokens exceeds the {self.draft_tokens} drafts allocated")
        self.last_verify_width = width
        positions = [_positions(s, width) for s in seqs]  # MRoPE sequences: theirs (and no graph)
        mrope = any(p is not None for p in positions)
        h = verify_inputs(rows, [s.num_computed for s in seqs], [s.pages for s in seqs], self.page_size,
                          [s.state_slot if s.state_slot is not None else 0 for s in seqs],
                          [self._verify_slots(s.lane, width) for s in seqs], width, positions if mrope else None)
        b = len(seqs)
        entry = self.graphs.get((b, width))
        entry = entry if entry is not None and not mrope and entry.inputs.fits(seqs) else None
        # the graph's static rows, or on the CPU rows laid out alike: launch_next_round advances them on the device
        cpu_rows = self.device.type == "cpu" and not mrope
        static = entry.inputs if entry is not None else self._cpu_rows(width) if cpu_rows else None
        self.last_verify_rows = (static, b, width) if static is not None else None
        if static is not None:
            static.load(h)
            self.last_verify_ids = static.i64[: b * width].view(b, width)
            if drafts is not None:
                drafts.place(self.last_verify_ids, self._tensor)
            return self._run_verify(static, b, width, entry)
        self.eager_steps += 1
        batch = ForwardBatch.for_verify(h)
        if self.device.type != "cpu":
            for name in ("input_ids", "positions", "query_start_loc", "seq_lens", "page_table", "slot_mapping",
                         "state_slots", "logits_indices", "row_seq_lens", "verify_slots"):
                setattr(batch, name, self._upload(getattr(batch, name)))
        if drafts is not None:
            drafts.place(batch.input_ids.view(len(seqs), width), self._tensor)
        self.last_verify_ids = batch.input_ids.view(len(seqs), width)
        with self._verify_shapes(len(seqs)):
            return self._logits(batch)

    def _cpu_rows(self, width: int) -> VerifyInputs:
        """The CPU's verify rows of this width, laid out as a verify graph's static inputs (every lane, every page)."""
        rows = self._verify_rows.get(width)
        if rows is None:
            rows = self._verify_rows[width] = VerifyInputs(len(self.counts), width, self.cache.num_pages, self.device)
        return rows

    def _run_verify(self, inputs: VerifyInputs, b: int, width: int, entry: GraphEntry | None) -> torch.Tensor:
        """The verify forward over static rows: the graph's replay, or (CPU) one eager forward over the same rows,
        whose reference kernels read the lengths on the host (free there)."""
        if entry is not None:
            entry.graph.replay()
            self.graph_replays += 1
            self.last_hidden, self.last_all_hidden = entry.hidden, entry.all_hidden
            return entry.logits
        self.eager_steps += 1
        batch = inputs.host_batch(b)
        with self._verify_shapes(b):
            return self._logits(batch)

    @torch.inference_mode()
    def launch_next_round(self, plan: StepPlan, prev: Launch, drafts: torch.Tensor, stop_ids: torch.Tensor,
                          page_tables: list[list[int]] | None = None) -> Launch:
        """Queue the verify round after `prev`, before prev is read back, from inputs derived on the device
        (next_round.advance_rows: prev's accepted counts give each row's positions, KV slots, lengths, state slot and
        bonus token), for `plan`'s rows: prev's sequences, in its order, every row as wide as prev's. drafts: [b, >=
        width-1] the rows' next drafts on the device (the MTP head's, queued behind prev's verify); stop_ids: [b, E]
        each row's stop tokens (-1 pads), at which a row's commit ends as the host's will; page_tables: the rows'
        page lists when they grew since prev's rows were loaded (the next round's positions need them). Sampled rows
        draw at their output positions (offset by prev's commit on the device); penalised rows are never queued so
        (their counts are the host's). Returns the launch, to be collected after prev's."""
        from ninfer.engine.next_round import advance_rows

        inputs, b, width = prev.verify
        if page_tables:
            inputs.load_pages(page_tables, self._tensor)
        committed = advance_rows(inputs, b, width, prev.tokens[-1], drafts, stop_ids, self.page_size)
        launch = Launch(verify=prev.verify)
        # the counts the rows were advanced by, to the host before this round's verify runs: the engine checks them
        # against its own commit of prev before it commits anything of this round
        launch.assumed, launch.assumed_ready = self._to_host(committed)
        ids = inputs.i64[: b * width].view(b, width)
        stage_drafts(plan.decode, [width - 1] * b, ids[:, 1:].clone())  # as verified: the read back brings them
        launch.staged = staged_drafts(plan.decode)
        self.last_verify_width, self.last_verify_ids, self.last_verify_rows = width, ids, prev.verify
        entry = self.graphs.get((b, width))
        entry = entry if entry is not None and entry.inputs is inputs else None  # CPU rows: eager
        logits = self._run_verify(inputs, b, width, entry)
        self._keep_hidden(plan, launch, rows=b * width)
        seqs = [w.seq for w in plan.decode]
        per_row = [s for s in seqs for _ in range(width)]
        steps = [len(s.output_ids) + j for s in seqs for j in range(width)]
        launch.tokens.append(self.sample(per_row, logits, steps=steps, step_offset=committed.repeat_interleave(width)))
        self._read_back(launch)
        return launch

    @property
    def decode_graph_inputs(self) -> DecodeInputs | None:
        """The decode graphs' static inputs (their batch and page-table sizes), None when they are off:
        drafters that capture graphs of their own size them alike."""
        return self._decode_inputs

    def _verify_shapes(self, batch: int):
        """Exact verification: the verify forward's matmuls as the B-row decode step's (see `verify`);
        fast: as one product of all its rows (one pass over the weights)."""
        return rows_like(batch) if self.exact_verify else contextlib.nullcontext()

    def _verify_slots(self, lane: int | None, width: int) -> list[int]:
        """The lane's per-position state slots of a verify forward (see __init__)."""
        if not self.cache.conv.shape[0]:
            return [0] * width
        return self.lane_slots[lane or 0][:width]

    def collect(self, plan: StepPlan, launch: Launch) -> RunnerOutput:
        """Wait for the launch's read back (the sampled ids and the drafts the verify took on the device): the
        one host synchronization of a step."""
        if launch.ready is not None:
            launch.ready.synchronize()
        flat = launch.host.tolist() if launch.host is not None else []
        if launch.staged is not None:
            flat = launch.staged.fill(flat)
        sampled, at = [], 0
        for work in plan.works:
            n = work.logit_rows
            sampled.append(flat[at: at + n])
            at += n
        hidden = None
        if plan.want_hidden:  # one [rows, hidden] tensor per forward, split by work (still on the device)
            rows = torch.cat(launch.hidden) if len(launch.hidden) > 1 else launch.hidden[0]
            sizes = [1 if not w.decode else len(w.tokens) for w in plan.works]
            hidden = list(rows.split(sizes))
        return RunnerOutput(sampled, hidden, launch.prefill_hidden)

    def _keep_hidden(self, plan: StepPlan, launch: Launch, rows: int, width: int = 0,
                     lens: list[int] | None = None) -> None:
        """The forward's logit rows' hidden states, copied when the plan asks for them (a graph's are
        rewritten by the next replay); a padded verify batch's without the padding's rows."""
        if plan.want_hidden:
            hidden = self.last_hidden[:rows]
            if width and lens and any(n != width for n in lens):
                hidden = hidden[self._tensor([i * width + j for i, n in enumerate(lens) for j in range(n)], torch.long)]
            launch.hidden.append(hidden.clone())

    # ---- speculative rollback ----------------------------------------------------------------
    @torch.inference_mode()
    def rollback(self, works, committed: list[int], width: int | None = None) -> list[tuple[int, int]]:
        """After a verify forward of `width` tokens per row: a row that committed c tokens needs the recurrent
        state after its position c-1, which the forward left in the lane's verify slot c-1. The two trade places:
        the verify slot becomes the sequence's state slot and its old slot the lane's verify slot c-1, so no state
        moves (a copy would read and write a row's 151 MB of 27B state). Returns the trades (old slot, new slot),
        which the slot pool must follow (SlotPool.exchange). Attention KV needs nothing: slots past the frontier are
        rewritten before anything reads them. NINFER_ROLLBACK_COPY=1 copies the state back instead (the A/B of the trade)."""
        if self.cache.conv.shape[0] == 0:
            return []
        width = width or self.last_verify_width
        # every row of the forward, drafts or not: a shorter row was padded up to the width
        redo = [(w.seq, c) for w, c in zip(works, committed)
                if width > 1 and 0 < c <= width and w.seq.state_slot is not None]
        trades = []
        for seq, c in redo:
            lane = self.lane_slots[seq.lane or 0]
            if self.copy_rollback:
                transfers.copy_state(self.cache, lane[c - 1], seq.state_slot)
                continue
            trades.append((seq.state_slot, lane[c - 1]))
            seq.state_slot, lane[c - 1] = lane[c - 1], seq.state_slot
        return trades

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
    def sample(self, seqs: list[Sequence], logits: torch.Tensor, graphs: bool = True,
               steps: list[int] | None = None, window: torch.Tensor | None = None,
               step_offset: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [rows] on the device, row i drawn with seqs[i]'s settings as its output token number
        steps[i] (default: its next one; verification rows of one sequence take consecutive numbers, so a
        seeded draw at an output position is the same with and without speculation). From a sampler graph
        they are its static output: read them before the next call. graphs=False: never the sampler
        graph (benchmarks compare the two).

        window: a verify batch's input ids [B, width] on the device (each sequence's last token, then its
        drafts; the rows are seqs' in that order): a penalised row counts the drafts before its position
        as generated tokens, as plain decoding would have counted them had they been sampled.
        step_offset: [rows] added to `steps` on the device (a round queued before the last one's commit is known)."""
        params = [s.sampling for s in seqs]
        width = min(self.vocab_size, logits.shape[1])  # drop padded embedding rows past the tokenizer
        penalised = any(p.presence_penalty or p.frequency_penalty for p in params)
        if not penalised and all(p.temperature <= 0 for p in params):
            # all greedy, nothing to penalise: the sampler's answer is this argmax; skipping its two
            # uploads and its kernels shortens the step's tail (the GPU idles through it)
            return logits[:, :width].argmax(dim=-1)
        if step_offset is not None:
            if penalised:
                raise ValueError("a round queued ahead cannot sample penalised rows (their counts are the host's)")
            batch, lanes = self._upload_sampling(seqs, steps)
            batch.step = batch.step + step_offset
            return self._sample_rows(logits[:, :width], batch, lanes)
        if window is not None and penalised and window.shape[1] > 1:
            batch, lanes = self._upload_sampling(seqs, steps)
            return self._sample_rows(logits[:, :width], batch, lanes, counts=self._window_counts(lanes, window))
        graph = self.sampler_graphs.get((len(seqs), 1)) if graphs else None
        if graph is not None and logits is self.graphs[(len(seqs), 1)].logits:  # a decode graph's logits
            floats, longs = self._sampling_rows(seqs, steps)
            self._sampler_inputs.fill(*longs, floats)
            graph[0].replay()
            self.sampler_replays += 1
            return graph[1]
        return self._sample_rows(logits[:, :width], *self._upload_sampling(seqs, steps))

    def _sample_rows(self, logits: torch.Tensor, batch: SamplingBatch, lanes: torch.Tensor,
                     counts: torch.Tensor | None = None) -> torch.Tensor:
        """The sampler on [B, width] logits: the fused Triton kernels when they passed their start-up
        check on this device, else the torch sampler over the rows' gathered penalty counts. counts: the
        rows' own counts [B, >= width] instead of their lanes' (a verify window's, `_window_counts`)."""
        if counts is not None:
            lanes = torch.arange(counts.shape[0], device=counts.device)
        else:
            counts = self.counts
        if self.fused_sampler:
            from ninfer.kernels.triton_sampler import fused_sample

            return fused_sample(logits, batch, counts, lanes)
        return sample(logits, batch, counts[lanes, : logits.shape[1]])

    def _window_counts(self, lanes: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """Penalty counts of a verify batch's rows [B * width, V]: position j of a sequence's window counts
        its lane's committed tokens and the drafts at window indices 1..j (index 0, the last committed
        token, is counted already). Those are the tokens a plain step at that output position follows when
        the drafts stand; past a rejected draft the row's sample is not used. Device ops only."""
        b, w = window.shape
        counts = self.counts[lanes].view(b, w, -1)  # a copy: the lanes' own rows stay as they are
        ids, ones = window.to(torch.long), torch.ones(b, w, 1, dtype=counts.dtype, device=counts.device)
        for i in range(1, w):  # draft i counts at positions i..w-1
            counts[:, i:].scatter_add_(2, ids[:, i].view(b, 1, 1).expand(b, w - i, 1), ones[:, i:])
        return counts.view(b * w, -1)

    @staticmethod
    def _sampling_rows(seqs: list[Sequence], steps: list[int] | None = None) -> tuple[list[list[float]], list[list[int]]]:
        """Per-row sampler settings, one list per field: floats in SamplingBatch.FLOAT_ROWS order, longs
        in SamplingBatch.LONG_ROWS order (top_k, seed, output index) and then the lane."""
        params = [s.sampling for s in seqs]
        floats = [[p.temperature for p in params], [p.top_p for p in params], [p.min_p for p in params],
                  [p.presence_penalty for p in params], [p.frequency_penalty for p in params]]
        longs = [[p.top_k if 0 < p.top_k <= TOP_K_CAP else TOP_K_CAP for p in params], [p.seed for p in params],
                 steps if steps is not None else [len(s.output_ids) for s in seqs], [s.lane for s in seqs]]
        return floats, longs

    def _upload_sampling(self, seqs: list[Sequence], steps: list[int] | None = None) -> tuple[SamplingBatch, torch.Tensor]:
        """The sampler's per-row settings and the rows' lanes, in two uploads."""
        rows_f, rows_l = self._sampling_rows(seqs, steps)
        longs = self._tensor(rows_l, torch.long)
        return SamplingBatch.from_rows(self._tensor(rows_f, torch.float32), longs), longs[3]

    def sampling_inputs(self, seqs: list[Sequence], width: int) -> tuple[SamplingBatch, torch.Tensor]:
        """The torch sampler's arguments: the per-row settings and the rows' penalty counts over `width`
        tokens (the sampler tests compare `sample(logits, *sampling_inputs(...))` with `ModelRunner.sample`)."""
        batch, lanes = self._upload_sampling(seqs)
        return batch, self.counts[lanes, :width]


def _positions(seq, count: int):
    """seq's MRoPE positions for its next `count` tokens, or None for text positions."""
    at = getattr(seq, "positions", None)
    return at(seq.num_computed, seq.num_computed + count) if at is not None else None
