"""The engine: a loop on its own thread that runs prefill chunks and decode batches.

Callers submit from any thread (or asyncio through `stream`); events are handed to a per-request
callback, so delivery and serialization happen outside the loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import torch

from ninfer.engine import context_cost, media_inputs, next_round, transfers
from ninfer.engine.context_ops import ContextExecutor
from ninfer.engine.counters import Counters, HostWork
from ninfer.engine.emitter import batched as batched_events
from ninfer.engine.emitter import loop_emitter
from ninfer.engine.exposure import RequestExposure, StreamInterval, host_marks
from ninfer.engine.kv_manager import KVManager
from ninfer.engine.kv_pool import PagePool, SlotPool
from ninfer.engine.kv_sizing import auto_kv_capacity, check_kv_fits
from ninfer.engine.memory_report import environment, memory_report
from ninfer.engine.next_round import host_committed_count
from ninfer.engine.output_control import OutputController
from ninfer.engine.output_processor import OutputProcessor
from ninfer.engine.plan import RunnerOutput, SeqWork, StepPlan
from ninfer.engine.request_slots import RequestSlots
from ninfer.engine.runner import Launch, ModelRunner
from ninfer.engine.scheduler import Scheduler
from ninfer.engine.sequence import Sequence, Status
from ninfer.engine.spec_control import DraftController
from ninfer.engine.speculative import Proposer, accepted_prefix, speculates
from ninfer.engine.types import (
    ContextLengthExceededError,
    EngineRequest,
    EngineUnavailableError,
    FinishEvent,
    FinishReason,
    InvalidRequestError,
    ProgressEvent,
    QueueTimeoutError,
    ResolvedSampling,
    SchedulingEvent,
    ThinkingBudgetCapacityError,
    ThinkingControl,
    VisionDisabledError,
)
from ninfer.timed_choice import TimedChoice

log = logging.getLogger("ninfer.engine")
OVERLAP_ENV = "NINFER_OVERLAP_ROUNDS"  # "1" / "0" / "auto": EngineSettings.overlap_rounds True / False / None
OVERLAP_TRIAL = 16  # rounds a try of queueing (or not) takes, per batch size; their median cycle decides
OVERLAP_REVISIT = 1024  # rounds of the faster way before both are tried again (the host's load changes)

GENERIC_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0}
@dataclass
class EngineSettings:
    max_context: int = 8192
    kv_capacity: int | str | None = None  # tokens; "auto" sizes it from free device memory; None follows max_context
    kv_dtype: str = "bf16"  # KV storage: bf16 (the model's dtype, unquantized), fp8, int8, nvfp4 or k8v4 (ninfer.forward)
    max_concurrency: int = 1
    max_pending_requests: int = 16
    pending_timeout_ms: int = 30000
    prefill_chunk: int = 1024
    page_size: int = 16
    state_slots: int | None = None  # None: 2 * max_concurrency
    default_max_tokens: int = 8192
    default_thinking_budget: int | None = None
    sampling_presets: dict[str, dict[str, float]] = field(default_factory=dict)
    sampling_overrides: dict[str, float] = field(default_factory=dict)  # process flags
    greedy: bool = False
    seed: int | None = None
    eos_ids: set[int] = field(default_factory=set)
    prefix_reuse: bool = True  # --no-prefix-reuse turns cross-request reads and writes off
    host_context_bytes: int | None = None  # pause-snapshot budget; None: 8 GiB + 8 state images; 0: replay only
    context_cost_presets: str | None = None  # --context-cost-presets FILE: measured route costs (context_cost)
    no_cuda_graph: bool = False  # --no-cuda-graph: decode runs eagerly instead of replaying CUDA graphs
    # the request log's per-request records: SchedulingEvents (pause/restore/replay) and each request's share of
    # the engine's time (exposure.RequestExposure) in its FinishEvent
    scheduling_events: bool = False
    draft_tokens: int = 0  # speculative decoding: the most drafts per decode row (with a proposer)
    spec: str | None = None  # --spec: the loader builds this drafter from the artifact (mtp, dflash, dflash2)
    lm_head_draft: bool = False  # --lm-head-draft: drafts scored on the artifact's proposal head (draft_head)
    # verified positions round exactly as plain decode steps (greedy output identical with and without
    # drafts); False: one matmul pass over all verify rows, faster where B <= 2 (ModelRunner.verify)
    exact_verify: bool = True
    # per step, draft only as many tokens as pay for their verification (ninfer.engine.spec_control); the
    # server turns it on; off, every decode row drafts up to draft_tokens
    adaptive_drafts: bool = False
    # queue a verify round before the one before it is read back, from inputs derived on the device (the MTP head
    # drafting ahead; Engine._queue_next_round). None (the default): on CUDA chosen per batch size by timing the
    # engine's own rounds both ways (OVERLAP_TRIAL; on two H100s queueing cost ~1 % at C=1, the device already busy
    # through the host's part of a round, s39; on the H200 that part outlasted the drafts ahead, s38), off on the
    # CPU (its forward runs as it is launched: nothing to overlap). NINFER_OVERLAP_ROUNDS=1 / 0 / auto overrides it
    overlap_rounds: bool | None = None
    vision: bool = False  # --vision: the artifact's vision tower is loaded and requests may carry media


def overlap_chooser() -> TimedChoice:
    """The timed choice between queueing verify rounds and not (EngineSettings.overlap_rounds None on CUDA)."""
    return TimedChoice((False, True), what="queued verify rounds", trial=OVERLAP_TRIAL, revisit=OVERLAP_REVISIT,
                       max_gap=0.001)


def resolve_sampling(settings: EngineSettings, request: EngineRequest) -> ResolvedSampling:
    """Request values over process flags over the artifact's preset for the thinking mode; a seed is drawn
    when neither the request nor the process gives one. The router calls this too, to log what runs."""
    s = settings
    preset = s.sampling_presets.get("thinking" if request.thinking else "non_thinking", {})
    merged = {**GENERIC_SAMPLING, **preset, **s.sampling_overrides}
    given = request.sampling
    for name in GENERIC_SAMPLING:
        value = getattr(given, name)
        if value is not None:
            merged[name] = value
    if s.greedy:
        merged["temperature"] = 0.0
    seed = given.seed if given.seed is not None else s.seed
    if seed is None:
        seed = random.getrandbits(63)
    seed = (int(seed) + 2**63) % 2**64 - 2**63  # the sampler's seeds are int64 tensors: wrap, never overflow
    return ResolvedSampling(seed=seed, **{k: merged[k] for k in GENERIC_SAMPLING})


class Engine:
    """The loop: schedule a step, run its context copies and forwards, commit the sampled tokens, update.

    `thinking`: the reasoning channel's control ids and budget suffix, from the chat frontend
    (ninfer.chat.thinking); None: no reasoning channel is followed.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, settings: EngineSettings, *,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 thinking: ThinkingControl | None = None, proposer: Proposer | None = None):
        self.settings = settings
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        spec = model.cache_spec()
        drafts = settings.draft_tokens if proposer is not None else 0
        # a drafter with KV of its own (the MTP head) rides in the trunk's cache as more attention layers
        cache_spec = proposer.cache_spec(spec) if hasattr(proposer, "cache_spec") else spec
        num_slots = settings.state_slots or 2 * settings.max_concurrency
        self.kv_sizing = None
        if settings.kv_capacity == "auto":
            verify_slots = settings.max_concurrency * (drafts + 1) if drafts else 0  # ModelRunner: verify states
            self.kv_sizing = auto_kv_capacity(
                model, page_size=settings.page_size, prefill_chunk=settings.prefill_chunk,
                num_state_slots=num_slots + verify_slots if spec.num_state_layers else 0,
                max_context=settings.max_context, max_concurrency=settings.max_concurrency,
                vocab_size=tokenizer.vocab_size, device=self.device, dtype=dtype, kv_dtype=settings.kv_dtype,
                cuda_graphs=not settings.no_cuda_graph, spec=cache_spec)
            capacity = self.kv_sizing.tokens
            log.info("KV capacity auto: %d tokens (%s)", capacity, self.kv_sizing.as_dict())
        else:
            capacity = settings.kv_capacity or settings.max_context
        self.kv_capacity = capacity
        num_pages = (capacity + settings.page_size - 1) // settings.page_size
        check_kv_fits(cache_spec, tokens=num_pages * settings.page_size, device=self.device, dtype=dtype,
                      kv_dtype=settings.kv_dtype, num_state_slots=num_slots if spec.num_state_layers else 0)
        # each sequence's effective ceiling (/v1/models' max_model_len): a pool smaller than --max-context lowers it
        self.max_context = min(settings.max_context, capacity)
        pages = PagePool(num_pages, settings.page_size)
        slots = SlotPool(num_slots) if spec.num_state_layers > 0 else None
        self.runner = ModelRunner(model, num_pages=pages.num_pages, page_size=settings.page_size,
                                  num_state_slots=num_slots if slots else 0, num_lanes=settings.max_concurrency,
                                  vocab_size=tokenizer.vocab_size, device=self.device, dtype=dtype,
                                  cuda_graphs=not settings.no_cuda_graph, max_seq_len=settings.max_context,
                                  kv_dtype=settings.kv_dtype, prefill_chunk=settings.prefill_chunk,
                                  draft_tokens=drafts, cache_spec=cache_spec, exact_verify=settings.exact_verify,
                                  feature_layers=tuple(getattr(proposer, "feature_layers", ()) if drafts else ()))
        self.proposer = proposer if drafts else None
        self.drafts_control = DraftController(drafts) if drafts and settings.adaptive_drafts else None
        if hasattr(self.proposer, "bind"):
            self.proposer.bind(self.runner)
        self.hybrid = slots is not None
        self.overlap, self.overlap_choice = self._overlap_setting(settings)
        if self.overlap:
            next_round.warm_up(self.runner, len(settings.eos_ids))
        if hasattr(self.proposer, "ahead_drafts"):
            log.info("queued verify rounds: %s", "timed per batch size" if self.overlap_choice is not None
                     else ("on" if self.overlap else "off"))
        self._overlap_now = False  # this step's call (_overlap_step)
        self._queued: tuple[StepPlan, Launch] | None = None  # the next round, queued before this one's read back
        self._decided: tuple[tuple[str, ...], int] | None = None  # the draft controller's call made while queueing
        self._stop_tables: dict[tuple, torch.Tensor] = {}  # queued rounds' stop tokens, by the rows' sets (_stop_rows)
        self.queued_rounds = 0  # rounds queued before the last one was read back
        self.dropped_rows = 0  # rows of such rounds not committed (the request ended, or a commit fell short)
        self.miscounted_rows = 0  # rows the device advanced by other counts than the host's (never expected)
        model_cache = self.runner.cache
        # host bytes for pause snapshots: --host-context-mib, else 8 GiB plus 8 state images
        host_budget = settings.host_context_bytes
        if host_budget is None:
            host_budget = 8 * 2**30 + 8 * transfers.state_bytes(model_cache)
        # caches paged like the model's (a block drafter's context): their pages are copied and paused with it
        companions = tuple(self.proposer.companion_caches()) if hasattr(self.proposer, "companion_caches") else ()
        # what each pause route costs here, so a pause takes the cheaper one (resolved once, logged)
        self.context_costs = context_cost.resolve(self.device, context_cost.prefill_signature(
            model, settings.kv_dtype, settings.prefill_chunk, settings.vision), settings.context_cost_presets)
        c = self.context_costs
        log.info("context costs on %s: transfer d2h %.1f / h2d %.1f GiB/s (%s), prefill %.0f tok/s for %s (%s)",
                 c.hardware, c.d2h_bytes_per_s / context_cost.GIB, c.h2d_bytes_per_s / context_cost.GIB,
                 c.transfer_source, c.prefill_tokens_per_s, c.signature, c.prefill_source)
        self.kv = KVManager(pages, slots, prefix_reuse=settings.prefix_reuse, host_budget=host_budget,
                            costs=self.context_costs,
                            snapshot_bytes=lambda n, state: transfers.snapshot_bytes(model_cache, n, state, companions),
                            private_boundary=getattr(self.proposer, "rewrites_boundary", False))
        self.cache = self.kv.cache  # the retained checkpoints (an index; the KV manager owns their pages)
        self.scheduler = Scheduler(max_concurrency=settings.max_concurrency, prefill_chunk=settings.prefill_chunk,
                                   kv=self.kv, draft_tokens=settings.draft_tokens if proposer else 0,
                                   max_context=self.max_context,
                                   draft_reach=drafts - 1 if hasattr(self.proposer, "draft_ahead") else 0)
        self.thinking = thinking or ThinkingControl(think_end_id=None)
        self.counters = Counters()
        self.context = ContextExecutor(self.kv, model_cache, self.counters, companions)
        self.output = OutputProcessor(self.thinking, self.counters, max_context=self.max_context)
        self.work = HostWork()
        self._startup_report: dict[str, Any] | None = None
        self._recovering: set[str] = set()  # restored requests whose next commit completes recovery
        # the iteration under way, while the request log is on: its start's host_marks and, by sequence, its step's
        # works (sequence, decode row, unit) as planned (exposure)
        self._exposing: tuple[tuple[float, ...], dict[int, tuple[Sequence, bool, str]]] | None = None
        self.healthy = True
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._by_id: dict[str, Sequence] = {}
        self.slots = RequestSlots(settings.max_concurrency + settings.max_pending_requests,
                                  settings.pending_timeout_ms / 1000.0)
        self._order = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None

    # ---- public API --------------------------------------------------------------------------
    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self._loop, name="ninfer-engine", daemon=True)
        self._thread.start()
        return self

    @classmethod
    def build_and_start(cls, build: Callable[[], "Engine"]) -> "Engine":
        """Construct the engine (model load, cache allocation) on the thread that will run its loop.

        On CPU this matters: once a second thread has run OpenMP-parallel torch work, the engine
        thread's own parallel regions run about half as fast on a 2-core machine (measured: 95 vs
        54 ms per SmolLM2 decode step). Keeping every torch op on one thread avoids it.
        """
        ready = threading.Event()
        box: dict[str, object] = {}

        def main() -> None:
            try:
                engine = box["engine"] = build()
            except BaseException as exc:  # surfaced to the caller below
                box["error"] = exc
                ready.set()
                return
            engine._thread = threading.current_thread()
            ready.set()
            engine._loop()

        threading.Thread(target=main, name="ninfer-engine", daemon=True).start()
        ready.wait()
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box["engine"]  # type: ignore[return-value]

    def startup_report(self) -> dict[str, Any]:
        """server_start's memory (arenas, workspace, vision layout), formats and environment, taken once, after
        start-up's warm-up (the first call)."""
        if self._startup_report is None:
            s = self.settings
            vision_bound = None
            if s.vision:  # ninfer.media (pillow, PyAV) only where vision is on
                from ninfer.media.types import MediaLimits

                vision_bound = MediaLimits().max_request_tokens
            self._startup_report = {
                "memory": memory_report(self.runner, self.proposer, self.context.companions,
                                        vision_token_bound=vision_bound,
                                        prompt_token_bound=self.max_context),
                "formats": {"weight_storage_dtypes": context_cost.storage_dtypes(self.runner.model),
                            "kv_cache": s.kv_dtype,
                            "prefill_signature": self.context_costs.signature,
                            "prefill": {"chunk_tokens": s.prefill_chunk, "page_size": s.page_size,
                                        "cuda_graphs": self.device.type == "cuda" and not s.no_cuda_graph}},
                "environment": environment(self.device),
                "context_cost": self.context_costs.as_dict(),
            }
        return self._startup_report

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread:
            self._thread.join(timeout=30)

    def submit(self, request: EngineRequest, emit: Callable[[object], None]) -> None:
        """Validate and enqueue; raises EngineError subclasses for requests that cannot be taken."""
        if not self.healthy:
            raise EngineUnavailableError("the engine failed and cannot accept work")
        seq = self._prepare(request, emit)
        seq.deadline = self.slots.claim(request.request_id)  # the last refusal: overload or a spent deadline
        with self._lock:
            self._order += 1
            seq.order = self._order
            self._by_id[request.request_id] = seq
        self._inbox.put(("submit", seq))
        self._wake.set()

    def reserve(self, request_id: str) -> None:
        """Hold a lifetime slot for a request about to be prepared (request_slots); raises ServerOverloadedError."""
        if not self.healthy:
            raise EngineUnavailableError("the engine failed and cannot accept work")
        self.slots.reserve(request_id)

    def release(self, request_id: str) -> None:
        """The reserved request's answer is written (or abandoned): its slot is free."""
        self.slots.release(request_id)

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))
        self._wake.set()

    async def stream(self, request: EngineRequest) -> AsyncIterator[object]:
        """Submit and yield events until the terminal FinishEvent; cancels the request if abandoned."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        self.submit(request, loop_emitter(loop, events.put_nowait, lambda: self.cancel(request.request_id)))
        done = False
        try:
            while True:
                ev = await events.get()
                if isinstance(ev, Exception):
                    done = True
                    raise ev
                yield ev
                if isinstance(ev, FinishEvent):
                    done = True
                    return
        finally:
            if not done:
                self.cancel(request.request_id)

    def generate(self, request: EngineRequest, timeout: float = 600.0) -> list[object]:
        """Blocking convenience for tests and benchmarks: all events of one request."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        self.submit(request, events.put)
        out = []
        deadline = time.monotonic() + timeout
        while True:
            ev = events.get(timeout=max(deadline - time.monotonic(), 0.001))
            if isinstance(ev, Exception):
                raise ev
            out.append(ev)
            if isinstance(ev, FinishEvent):
                return out

    def snapshot(self) -> dict[str, object]:
        """Gauges and counters for /metrics, copied without blocking the loop."""
        sched = self.scheduler
        resident = list(sched.resident)
        c = self.counters
        return {
            "ready": self.healthy,
            "held_requests": len(self.slots),  # lifetime slots: preparing, in the engine, or answer not yet written
            "running": len(resident),
            "waiting": len(sched.waiting),
            "paused": len(sched.paused),
            "prefilling": sum(s.status is Status.PREFILL for s in resident),
            "replaying": sum(s.status is Status.PREFILL and bool(s.output_ids) for s in resident),
            "materializing": 0,  # snapshot restores and prefix copies complete inside admission
            "capture_pending": 0,  # a checkpoint's capture runs in the step that computes its position
            "terminal_pending": self.slots.terminal_pending,
            "decode_ready": sum(s.status is Status.DECODE for s in resident),
            "kv_pages_used": sched.pages.used_pages,
            "kv_pages_capacity": sched.pages.num_pages,
            "kv_capacity_tokens": self.kv_capacity,
            "kv_sizing": self.kv_sizing.as_dict() if self.kv_sizing else None,
            "state_slots_used": sched.slots.used_slots if sched.slots else 0,
            "state_slots_capacity": sched.slots.num_slots if sched.slots else 0,
            "preemptions": sched.preemptions,
            "prefix_hits": self.cache.hits,
            "prefix_misses": self.cache.misses,
            "prefix_captures": self.cache.captures,
            "prefix_evictions": self.cache.evictions,
            "retained_checkpoints": len(self.cache.entries),
            "prefix_pressure_evictions": self.cache.pressure_evictions,
            "last_selection": dict(self.cache.last_selection) if self.cache.last_selection else None,
            "host_context_used_bytes": self.kv.host_used,
            "host_context_capacity_bytes": self.kv.host_budget,
            **{k: v for k, v in vars(c).items() if k not in ("requests", "context_transfer_bytes", "state_images")},
            "state_images": dict(c.state_images),
            "spec_decode_rounds": c.spec_rounds,
            "spec_decode_draft_tokens": c.spec_drafted_tokens,
            "spec_decode_accepted_tokens": c.spec_accepted_tokens,
            "spec_decode_fallback_steps": c.spec_fallback_steps,
            "requests": dict(c.requests),
            "context_transfer_bytes": dict(c.context_transfer_bytes),
            **self.work.snapshot(),
        }

    # ---- preparation (caller's thread) -------------------------------------------------------
    def resolve_sampling(self, request: EngineRequest) -> ResolvedSampling:
        return resolve_sampling(self.settings, request)

    def _prepare(self, request: EngineRequest, emit) -> Sequence:
        s = self.settings
        n = len(request.prompt_ids)
        ceiling = self.max_context
        if n == 0:
            raise InvalidRequestError("the prompt is empty")
        if n > ceiling:
            raise ContextLengthExceededError(n, ceiling)
        if len(request.stop) > 4 or any(not x for x in request.stop):
            raise InvalidRequestError("stop takes at most 4 non-empty strings")
        max_tokens = s.default_max_tokens if request.max_tokens is None else request.max_tokens
        if max_tokens < 0:
            raise InvalidRequestError("max_tokens must be non-negative")
        capacity = min(max_tokens, ceiling - n)
        thinking_open = request.thinking and self.thinking.think_end_id is not None
        budget = request.thinking_budget if request.thinking_budget is not None else s.default_thinking_budget
        if thinking_open and budget is not None and capacity > budget:
            needed = budget + len(self.thinking.close_suffix) + 1
            if capacity < needed:
                raise ThinkingBudgetCapacityError(
                    f"the output budget of {capacity} tokens extends past the thinking budget of {budget} but "
                    f"cannot hold the {len(self.thinking.close_suffix)}-token closing suffix and one more token "
                    f"(needs {needed})"
                )
        controller = OutputController(self.tokenizer, stops=request.stop, eos_ids=s.eos_ids,
                                      thinking=self.thinking, thinking_open=thinking_open,
                                      thinking_budget=budget if thinking_open else None)
        # attention-only models reuse any page-aligned prefix of a finished request; only hybrid
        # models need their state captured at the frontend's boundaries
        checkpoints = sorted({p for p in request.checkpoints if 0 < p < n}) if self.hybrid and s.prefix_reuse else []
        if request.media and self.runner.vision_tower is None:
            raise VisionDisabledError("media input needs the engine started with --vision (a vision tower)")
        mrope, mrope_delta, prompt_key = media_inputs.setup(request)
        return Sequence(request=request, order=0, sampling=self.resolve_sampling(request), max_tokens=max_tokens,
                        controller=controller, emit=emit, deadline=math.inf, checkpoints=checkpoints,
                        mrope=mrope, mrope_delta=mrope_delta, prompt_key=prompt_key,
                        exposure=RequestExposure() if s.scheduling_events else None)

    # ---- the loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            with batched_events():  # this iteration's events wake each consumer loop once, at its end
                self._exposing = None
                marks = host_marks(self.work) if self.settings.scheduling_events else None
                try:
                    with self.work.phase("engine_boundary"):
                        self._drain_inbox()
                        self._expire_waiting()
                        queued, self._queued = self._queued, None
                        plan = queued[0] if queued is not None else self.scheduler.schedule()
                        if self.proposer is not None:  # drafters read the target's hidden states
                            plan.want_hidden = True
                            plan.want_prefill_hidden = getattr(self.proposer, "wants_prefill_hidden", False)
                        started = time.perf_counter()
                        if marks is not None:
                            self._exposing = (marks, {id(w.seq): (w.seq, w.decode, _unit(w)) for w in plan.works})
                        self._admitted(plan)
                        self._preempted(plan)
                        for seq in plan.starved:
                            self._finish(seq, FinishReason.CONTEXT)
                    worked = not plan.empty
                    if plan.prefill is not None or plan.decode or plan.before or plan.after:
                        self._overlap_now = self._overlap_step(plan)
                        self.work.run_step("decode" if plan.decode else "prefill",
                                           lambda plan=plan, queued=queued: self._step(plan, queued and queued[1]))
                        self._timed_round(plan)
                        if self._exposing is not None:
                            with self.work.phase("engine_maintenance"), self.work.detail("request_observation"):
                                self._expose()
                        if self.drafts_control is not None and plan.decode and plan.prefill is None:
                            width = max(len(w.tokens) for w in plan.decode)
                            self.drafts_control.step_time(len(plan.decode), width, time.perf_counter() - started)
                    else:  # no step: a pause or restore that copies nothing still reaches its boundary
                        with self.work.phase("engine_maintenance"):
                            self._pause_boundaries(plan)
                except Exception as exc:  # an engine-wide failure: fail everything, report unhealthy
                    log.exception("engine step failed")
                    self._fail_all(exc)
                    return
            if not worked:
                self._wake.wait(timeout=0.05)
                self._wake.clear()

    def _overlap_setting(self, settings: EngineSettings) -> tuple[bool, TimedChoice | None]:
        """(queue verify rounds, the timed choice that decides it per batch size when it is measured): from
        NINFER_OVERLAP_ROUNDS over settings.overlap_rounds; only with a drafter that drafts ahead (the MTP head)."""
        env = os.environ.get(OVERLAP_ENV, "").strip().lower()
        wanted = {"1": True, "0": False, "auto": None}.get(env, settings.overlap_rounds)
        if not hasattr(self.proposer, "ahead_drafts"):
            return False, None
        if wanted is None:
            return (True, overlap_chooser()) if self.device.type == "cuda" else (False, None)
        return wanted, None

    def _overlap_step(self, plan: StepPlan) -> bool:
        """Whether this step queues the next round (when it can): the setting, or the timed choice for its batch
        size, this step's cycle timed under it (start to start; counted only for a step of full-width verify rows,
        `_timed_round`)."""
        if not self.overlap or self.overlap_choice is None or not plan.decode or plan.prefill is not None:
            return self.overlap
        b = len(plan.decode)
        on = self.overlap_choice.choose(b)
        self.overlap_choice.begin(b, on, time.perf_counter())
        return on

    def _timed_round(self, plan: StepPlan) -> None:
        """After a step `_overlap_step` timed: its cycle counts if every row verified k drafts (the rounds queueing
        is for), else not (the next step's start then times nothing)."""
        if self.overlap_choice is not None and plan.decode and plan.prefill is None and all(
                len(w.tokens) == self.runner.draft_tokens + 1 for w in plan.decode):
            self.overlap_choice.end(time.perf_counter())

    def _step(self, plan: StepPlan, launched: Launch | None = None) -> bool:
        """Copies, forwards, commits and the scheduler's update for one plan (launched: already queued, by
        `_queue_next_round` during the step before)."""
        predicted = []
        # with the request log on, a prompt chunk's device intervals (its forward and drafter work: work.gpu_seconds)
        prefilled = plan.prefill.seq.exposure if plan.prefill is not None and launched is None else None
        with self.work.phase("program_submit"):
            if launched is None:
                self.context.run(plan.before)
            self._pause_boundaries(plan)
            if launched is None:
                interval = StreamInterval(self.device) if prefilled is not None else None
                # drafts after the copies and restores: a drafter reads its context from the pages they fill
                self._propose(plan)
                launched = self.runner.launch(plan)
                if hasattr(self.proposer, "draft_ahead") and plan.decode and launched.tokens:  # next round's drafts
                    self.proposer.draft_ahead(plan, launched.tokens[-1])
                if hasattr(self.proposer, "observe_deferred"):  # the last plain step's observe, under this forward
                    self.proposer.observe_deferred()
                if interval is not None:
                    prefilled.prefill_intervals.append(interval.stop())
                predicted = self._predicted(plan)
                self.context.run(plan.after)
            queued = self._queue_next_round(plan, launched) if self._overlap_now else None
        with self.work.phase("device_wait"):
            output = self.runner.collect(plan, launched)
        with self.work.phase("engine_commit_output"):
            finished, committed = self._commit(plan, output)
            if predicted:
                self._sample(predicted, plan, output)
            live = [w for w in plan.decode if id(w.seq) in committed]  # a queued round's ended rows are not
            if any(w.draft_ids for w in live):  # finished rows too: a retained endpoint keeps the state slot
                width = max(len(w.tokens) for w in plan.decode)
                trades = self.runner.rollback(live, [committed[id(w.seq)] for w in live], width)
                for held, verify_slot in trades:  # the accepted states' slots are the pool's now
                    self.scheduler.slots.exchange(held, verify_slot)
            self.scheduler.update(plan, output, committed)
            if hasattr(self.proposer, "observe"):  # the drafter's half-step over the committed positions
                interval = StreamInterval(self.device) if prefilled is not None else None
                self.proposer.observe(plan, output, committed)
                if interval is not None:
                    prefilled.prefill_intervals.append(interval.stop())
            counted = self.output.take_counted()
            if counted:
                lanes, ids = zip(*counted)
                self.runner.count_tokens(list(lanes), list(ids))
            as_queued = self._as_queued(plan, output, committed, queued[1]) if queued is not None else {}
            for seq, reason in finished:  # a state the queued round may have overwritten is not retained
                self._finish(seq, reason, keep_state=as_queued.get(id(seq), True))
            if queued is not None:
                self._adopt_queued(*queued, as_queued)
        return True

    # ---- overlapped rounds: the next verify queued before this one is read back ------------------------
    def _queue_next_round(self, plan: StepPlan, launched: Launch) -> tuple[StepPlan, Launch] | None:
        """Queue the next verify round of this plan's rows now, behind this one, when it is sure to be that round:
        a decode-only plan of full-width rows whose next drafts the MTP head queued behind it (draft_ahead), none of
        them penalised (penalty counts are the host's), inside a thinking budget's end, within 2 rounds of its
        max_tokens or context, or carrying MRoPE positions, nothing waiting that could be admitted, and pages free
        for both rounds. Its inputs come from this round's on the device (ModelRunner.launch_next_round); the host
        catches up one round behind. A row whose commit turns out other than the device assumed (a stop string, the
        request cancelled or finished) is not committed from it (`_adopt_queued`). Each round's device work then
        follows the last without waiting for the host's commit, its launches and the read back between them (on the
        H200 at C=1, 0.3-1.3 ms of a ~9 ms MTP3 round, s38)."""
        runner, k = self.runner, self.runner.draft_tokens
        width = k + 1
        works = plan.decode
        if (plan.prefill is not None or plan.before or plan.after or not works or launched.verify is None
                or not hasattr(self.proposer, "ahead_drafts")
                or not self._inbox.empty() or self._queue_waits() or any(len(w.tokens) != width for w in works)):
            return None
        drafts = self.proposer.ahead_drafts(plan)
        if drafts is None or any(not self._may_queue(w.seq, 2 * width) for w in works):
            return None
        if self.drafts_control is not None:  # the controller's call for the next step, made now (and kept if no)
            ids = tuple(w.seq.request_id for w in works)
            n = self.drafts_control.drafts(len(works), list(ids))
            if n < k:
                self._decided = (ids, n)
                return None
        # pages for this round, the next one and its drafts ahead: positions up to start + 2 * width + k - 2
        reach = [w.start + 2 * width + k - 1 for w in works]
        grow = [(w.seq, upto) for w, upto in zip(works, reach) if self.kv.pages_for(upto) > len(w.seq.pages)]
        need = sum(self.kv.pages_for(upto) - len(s.pages) for s, upto in grow)
        rows = launched.verify[0]
        if need + len(self.scheduler.resident) > self.kv.pages.free_pages or any(
                self.kv.pages_for(upto) > rows.pages for upto in reach):
            return None
        for seq, upto in grow:
            self.kv.grow(seq, upto)
        queued = StepPlan(decode=[SeqWork(w.seq, w.start, [w.tokens[0]], decode=True, draft_budget=k) for w in works],
                          want_hidden=True)
        nxt = runner.launch_next_round(queued, launched, drafts, self._stop_rows(works),
                                       [w.seq.pages for w in works] if grow else None)
        self.proposer.draft_ahead(queued, nxt.tokens[-1], rows=rows)
        self.queued_rounds += 1
        return queued, nxt

    def _stop_rows(self, works) -> torch.Tensor:
        """The rows' stop tokens [b, E] on the device (-1 pads), uploaded once per distinct set of rows."""
        stops = tuple(tuple(sorted(w.seq.controller.eos_ids)) for w in works)
        table = self._stop_tables.get(stops)
        if table is None:
            wide = max(map(len, stops))
            table = self.runner._tensor([list(s) + [-1] * (wide - len(s)) for s in stops], torch.long)
            if len(self._stop_tables) >= 64:  # request-specific sets: keep the table small
                self._stop_tables.clear()
            self._stop_tables[stops] = table
        return table

    def _queue_waits(self) -> bool:
        """Whether the scheduler has someone to bind or restore (it plans only between unqueued rounds)."""
        s = self.scheduler
        return bool(s.paused or (s.waiting and s._free_lanes))

    def _may_queue(self, seq: Sequence, tokens: int) -> bool:
        """Whether the next `tokens` committed tokens can end seq's rows only as the device counts them (a stop
        token, or the last of its max_tokens or context) and draw them as the device does."""
        if (seq.status is not Status.DECODE or seq.sampling.penalized or seq.forced or seq.mrope is not None
                or not speculates(seq)):
            return False
        room = seq.max_tokens - len(seq.output_ids)
        room = min(room, self.max_context - seq.total_len)
        control = seq.controller
        budget_near = (control.budget is not None and control.thinking_open and not control.budget_applied
                       and control.model_reasoning_tokens + tokens >= control.budget)
        return room >= tokens and not budget_near

    def _as_queued(self, plan: StepPlan, output: RunnerOutput, committed: dict, queued: Launch) -> dict[int, bool]:
        """Per decode row of a round that had the next one queued behind it: whether the host committed what the
        device assumed when it queued that round (next_round.committed_counts: the accepted run, cut at a stop token,
        every token as sampled), checked against the counts the device actually used (read back with the queued
        round: a device that counted otherwise, never expected, costs a replay, not a wrong token). Where not, the
        queued round's states overwrote the one the commit ends at."""
        offset = len(plan.works) - len(plan.decode)
        device = queued.assumed_counts()
        agreed = {}
        for i, work in enumerate(plan.decode):
            seq, c = work.seq, committed.get(id(work.seq), 0)
            sampled = output.sampled[offset + i]
            expected = host_committed_count(work.draft_ids, sampled, seq.controller.eos_ids)
            if device[i] != expected:
                self.miscounted_rows += 1
                log.error("request %s: the device advanced its queued round by %d tokens, the host counts %d",
                          seq.request_id, device[i], expected)
            agreed[id(seq)] = (c == expected == device[i]
                               and seq.output_ids[len(seq.output_ids) - c:] == sampled[:c])
        return agreed

    def _adopt_queued(self, queued: StepPlan, launched: Launch, agreed: dict[int, bool]) -> None:
        """Make the queued round the next step: each row that goes on as the device assumed gets its start and
        input token (the host's commit of this step); other rows are left out of its commit. A request that goes
        on from a state the queued round overwrote (never expected: `_may_queue` rules out what could cause it) is
        paused to be rebuilt by replay."""
        for work in queued.decode:
            seq = work.seq
            if seq.status is Status.DECODE and agreed.get(id(seq), False):
                work.start = seq.num_computed
                work.tokens = [seq.output_ids[-1]] + work.tokens[1:]
                continue
            if seq.status is Status.DECODE:
                log.error("request %s: its commit differs from the round queued after it; rebuilding by replay",
                          seq.request_id)
                self.scheduler.pause(seq, StepPlan(), snapshot=False)
        self._queued = (queued, launched)

    def _propose(self, plan: StepPlan) -> None:
        """Ask the proposer for the drafts the plan's decode rows have room for."""
        works = [w for w in plan.decode if w.draft_budget > 0]
        decided, self._decided = self._decided, None
        if self.proposer is None or not works:
            return
        budgets = [w.draft_budget for w in works]
        if self.drafts_control is not None:  # as many drafts as pay for their verification (may be none)
            ids = [w.seq.request_id for w in works]
            k = (decided[1] if decided is not None and decided[0] == tuple(ids) and len(works) == len(plan.decode)
                 else self.drafts_control.drafts(len(plan.decode), ids))
            if k == 0:
                return
            budgets = [min(b, k) for b in budgets]
        self.proposer.propose(works, budgets)

    def _predicted(self, plan: StepPlan) -> list:
        """The proposer's drafts for this step's rows without drafts (free acceptance samples, spec_control), read
        after the last step's deferred observe (whose catch-up may have just given them) and before this step's own
        observe moves them on."""
        if self.drafts_control is None or not hasattr(self.proposer, "predictions"):
            return []
        return self.proposer.predictions(plan)

    def _sample(self, predicted: list, plan: StepPlan, output: RunnerOutput) -> None:
        """Each predicted draft against the token its row sampled: one read back of drafts computed before this
        step (the step's own synchronization has passed them), no verify step."""
        drafts = torch.stack([d for _, d in predicted]).tolist()
        offset = len(plan.works) - len(plan.decode)
        sampled = {id(w.seq): output.sampled[offset + i] for i, w in enumerate(plan.decode)}
        for (seq, _), draft in zip(predicted, drafts):
            tokens = sampled.get(id(seq))
            if tokens and seq.status is not Status.FINISHED:
                self.drafts_control.sample(seq.request_id, draft == tokens[0])

    def _commit(self, plan: StepPlan, output: RunnerOutput) -> tuple[list[tuple[Sequence, FinishReason]], dict]:
        """Commit each work's samples; returns the requests that ended, with why, and the tokens each decode
        row committed (its accepted drafts and the target's token after them)."""
        finished, committed = [], {}
        prefill = plan.prefill
        if prefill is not None:
            seq = prefill.seq
            replayed = seq.recomputed(prefill.start, prefill.end)  # rebuilt after a replay-route pause
            initial = len(prefill.tokens) - replayed
            self.counters.prefill_chunks += 1
            self.counters.replayed_tokens += replayed
            self.counters.prefill_tokens += initial
            if seq.exposure is not None:
                seq.exposure.replayed_tokens += replayed
                seq.exposure.prefill_tokens += initial
            last = prefill.end >= seq.prefill_target
            if not last or seq.samples_after_prefill:
                self._progress(seq, prefill.end)
            # the old frontier rebuilt: a request with output resumes decoding without resampling; one paused
            # mid-prompt goes on prefilling (its rebuilding chunk may also be its last, which samples)
            if (last and not seq.samples_after_prefill) or (replayed and prefill.end >= seq.computed_high):
                self._scheduling_event(seq, "replay_complete", "replay")
            if last and seq.samples_after_prefill:
                if seq.max_tokens == 0:
                    finished.append((seq, FinishReason.LENGTH))
                else:
                    finished += self._commit_tokens(seq, output.sampled[0])[0]
        if plan.decode:
            self.counters.decode_steps += 1
        for work, sampled in zip(plan.decode, output.sampled[len(plan.works) - len(plan.decode):]):
            if work.seq.status is not Status.DECODE:  # a queued round's row whose request ended before it (Engine._step)
                self.dropped_rows += 1
                continue
            row = sampled
            if work.draft_ids:  # the drafts the target confirms, then its own token after them
                accepted = accepted_prefix(work.draft_ids, sampled)
                row = sampled[: accepted + 1]
                self.counters.count_round(len(work.draft_ids), accepted)
                work.seq.count_round(len(work.draft_ids), accepted)
                if self.drafts_control is not None:
                    self.drafts_control.round(work.seq.request_id, len(work.draft_ids), accepted)
            elif self.proposer is not None:  # a speculative engine's row decoding one token
                self.counters.spec_fallback_steps += 1
                work.seq.spec_fallback_steps += 1
            ended, committed[id(work.seq)] = self._commit_tokens(work.seq, row)
            finished += ended
        return finished, committed

    def _commit_tokens(self, seq: Sequence, tokens: list[int]) -> tuple[list[tuple[Sequence, FinishReason]], int]:
        committed, reason = self.output.commit(seq, tokens)
        if committed and self._recovering and seq.request_id in self._recovering:  # first fresh token after a restore
            self._recovering.discard(seq.request_id)
            self._scheduling_event(seq, "recovery_complete", None)
        return ([(seq, reason)] if reason is not None else []), committed

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                self.scheduler.enqueue(item)
            elif kind == "cancel":
                seq = self._by_id.get(item)
                if seq is not None and seq.status is not Status.FINISHED:
                    self._finish(seq, FinishReason.CANCELLED)

    def _expire_waiting(self) -> None:
        now = time.monotonic()
        for seq in [s for s in self.scheduler.waiting if s.deadline <= now]:
            self.scheduler.finish(seq, retain=False)
            self._drop(seq)
            seq.emit(QueueTimeoutError(
                f"request was not admitted within {self.settings.pending_timeout_ms} ms"))
            self._count_outcome("queue_timeout")

    def _admitted(self, plan: StepPlan) -> None:
        """Timing, counters and events of the requests bound this step."""
        for admission in plan.admitted:
            seq, route = admission.seq, admission.route
            if seq.t_paused is not None:
                paused = time.monotonic() - seq.t_paused
                self.counters.paused_seconds += paused
                if seq.exposure is not None:
                    seq.exposure.paused_seconds += paused
                seq.t_paused = None
            if route != "snapshot":
                if seq.t_admit is None:  # initial binding: the request's cached count is fixed here
                    seq.cached_tokens = admission.reused
                    seq.prefix_path = "checkpoint" if admission.reused else "root"
                    self.counters.cached_prompt_tokens += admission.reused
                elif route == "replay":
                    self.counters.replay_restores += 1
                    if seq.exposure is not None:
                        seq.exposure.replay_restores += 1
            if seq.t_admit is None:
                seq.t_admit = time.monotonic()
                self.counters.prompt_tokens += seq.prompt_len
                if seq.request.return_progress:
                    seq.emit(ProgressEvent(seq.prompt_len, seq.cached_tokens, seq.cached_tokens, 0.0))
            # only penalties read a lane's counts; a request paused again by a later decision of this very
            # step holds no lane (its counts start over when it is bound next)
            if seq.sampling.penalized and seq.lane is not None:
                self.runner.reset_lane(seq.lane, seq.output_ids)
            if route:
                self._scheduling_event(seq, "restore_started", route)

    def _expose(self) -> None:
        """Each request in this iteration's step takes the iteration's time (exposure); one that finished in it
        took its share when it finished."""
        marks, works = self._exposing
        after = host_marks(self.work)
        for seq, decode, unit in works.values():
            if seq.exposure is not None and seq.status is not Status.FINISHED:
                seq.exposure.add(marks, after, decode=decode, unit=unit)
                self._first_output(seq)

    def _expose_so_far(self, seq: Sequence) -> None:
        """A request finishing inside the iteration under way takes the iteration's time so far, if it is in
        the iteration's step."""
        work = self._exposing[1].get(id(seq)) if self._exposing is not None else None
        if seq.exposure is not None and work is not None:
            with self.work.detail("request_observation"):
                _, decode, unit = work
                seq.exposure.add(self._exposing[0], host_marks(self.work), decode=decode, unit=unit)
                self._first_output(seq)

    @staticmethod
    def _first_output(seq: Sequence) -> None:
        """Freeze first_output_timing at the end of the iteration that committed the request's first output (its
        events are published as the iteration ends)."""
        if seq.output_ids and seq.exposure.first_output is None:
            seq.exposure.freeze_first_output(t_submit=seq.t_submit, t_admit=seq.t_admit,
                                             computed=seq.prompt_len - seq.cached_tokens)

    def _preempted(self, plan: StepPlan) -> None:
        now = time.monotonic()
        for seq in plan.preempted:
            seq.t_paused = now
            self._scheduling_event(seq, "pause_started", "snapshot" if seq.snapshot is not None else "replay")

    def _pause_boundaries(self, plan: StepPlan) -> None:
        """The pause-cycle boundaries reached once the plan's copies are under way (snapshots to the host, restores
        from it; a replay-route pause or restore copies nothing): paused and restored."""
        for seq in plan.preempted:
            self._scheduling_event(seq, "paused", "snapshot" if seq.snapshot is not None else "replay")
        for admission in plan.admitted:
            if admission.route:
                self._scheduling_event(admission.seq, "restored", admission.route)

    def _progress(self, seq: Sequence, computed: int) -> None:
        if seq.request.return_progress and seq.t_admit is not None:
            elapsed = (time.monotonic() - seq.t_admit) * 1000.0
            seq.emit(ProgressEvent(seq.prompt_len, seq.cached_tokens, min(computed, seq.prompt_len), elapsed))

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None, keep_state: bool = True) -> None:
        """End a request; its context goes to the prefix cache unless cancelled or failed, or (keep_state False, on
        a hybrid model) its recurrent state is no longer the one at its end."""
        retain = reason not in (FinishReason.CANCELLED, FinishReason.ERROR) and (keep_state or not self.hybrid)
        if hasattr(self.proposer, "forget"):
            self.proposer.forget(seq, retained=retain and self.kv.retains_endpoint(seq))
        if self.drafts_control is not None:
            self.drafts_control.forget(seq.request_id)
        self.output.flush_tail(seq, reason)
        self._expose_so_far(seq)
        self.scheduler.finish(seq, retain=retain)
        if seq.preemptions:
            self._recovering.discard(seq.request_id)
            self._scheduling_event(seq, "terminal", None)
        self._drop(seq)
        seq.emit(self.output.finish_event(seq, reason, error, speculative=self.proposer is not None))
        self._count_outcome(reason.value)

    # ---- observability: pause/restore events --------------------------------------------------
    def _scheduling_event(self, seq: Sequence, kind: str, route: str | None) -> None:
        """Tell the request's consumer about a pause-cycle boundary (only when the request log wants them)."""
        if not self.settings.scheduling_events:
            return
        with self.work.detail("request_observation"):
            self._emit_scheduling_event(seq, kind, route)

    def _emit_scheduling_event(self, seq: Sequence, kind: str, route: str | None) -> None:
        if kind == "restored":
            self._recovering.add(seq.request_id)
        c, now = self.counters, time.monotonic_ns()
        seq.emit(SchedulingEvent(
            kind=kind, preemption_index=seq.preemptions, route=route, steady_ns=now,
            elapsed_ns=now - int(seq.t_submit * 1e9),
            global_tokens={"prefill": c.prefill_tokens, "decode": c.decode_tokens, "replay": c.replayed_tokens},
            # the request's own share of each global counter (global minus request: the others' work), then its frontier
            request_tokens={"prefill": seq.exposure.prefill_tokens, "decode": max(len(seq.output_ids) - 1, 0),
                            "replay": seq.exposure.replayed_tokens,
                            "computed": seq.paused_frontier if kind in ("pause_started", "paused") else seq.num_computed,
                            "generated": len(seq.output_ids)}))

    @property
    def host_used(self) -> int:
        return self.kv.host_used

    def _drop(self, seq: Sequence) -> None:
        with self._lock:
            self._by_id.pop(seq.request_id, None)
        self.slots.finished(seq.request_id)

    def _count_outcome(self, outcome: str) -> None:
        self.counters.requests[outcome] = self.counters.requests.get(outcome, 0) + 1

    def _fail_all(self, exc: Exception) -> None:
        self.healthy = False
        with self._lock:
            seqs = list(self._by_id.values())
        for seq in seqs:
            if seq.status is not Status.FINISHED:
                try:
                    self._finish(seq, FinishReason.ERROR, error=f"{type(exc).__name__}: {exc}")
                except Exception:  # keep failing the rest
                    log.exception("failing request %s", seq.request_id)


def _unit(work: SeqWork) -> str:
    """What a step's work is, for a request's exposure: a decode round, a prompt chunk, or a replay chunk."""
    if work.decode:
        return "decode"
    return "control" if work.seq.recomputed(work.start, work.end) == len(work.tokens) else "prefill"
