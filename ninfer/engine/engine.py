"""The engine: a loop on its own thread that runs prefill chunks and decode batches.

Callers submit from any thread (or asyncio through `stream`); events are handed to a per-request
callback, so delivery and serialization happen outside the loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import torch

from ninfer.engine.context_cache import ContextCache
from ninfer.engine.context_ops import ContextOps
from ninfer.engine.counters import Counters, HostWork
from ninfer.engine.kv_pool import PagePool, SlotPool
from ninfer.engine.kv_sizing import auto_kv_capacity
from ninfer.engine.output_control import OutputController, ThinkingControl
from ninfer.engine.runner import ModelRunner
from ninfer.engine.scheduler import Scheduler
from ninfer.engine.sequence import Sequence, Status
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
    ServerOverloadedError,
    ThinkingBudgetCapacityError,
    Timings,
    TokenEvent,
    Usage,
)

log = logging.getLogger("ninfer.engine")

GENERIC_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0}
THINKING_GUIDANCE = (
    "\n\nConsidering the limited time by the user, I have to give the solution based on the thinking directly now.\n"
)


@dataclass
class EngineSettings:
    max_context: int = 8192
    kv_capacity: int | str | None = None  # tokens; "auto" sizes it from free device memory; None follows max_context
    kv_dtype: str = "bf16"  # KV storage: bf16 (the model's dtype, unquantized), fp8 or int8 (ninfer.forward)
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
    no_cuda_graph: bool = False  # --no-cuda-graph: decode runs eagerly instead of replaying CUDA graphs
    scheduling_events: bool = False  # emit SchedulingEvents (pause/restore/replay) for the request log


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
    def __init__(self, model: torch.nn.Module, tokenizer, settings: EngineSettings, *,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.settings = settings
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        spec = model.cache_spec()
        num_slots = settings.state_slots or 2 * settings.max_concurrency
        self.kv_sizing = None
        if settings.kv_capacity == "auto":
            self.kv_sizing = auto_kv_capacity(
                model, page_size=settings.page_size, prefill_chunk=settings.prefill_chunk,
                num_state_slots=num_slots if spec.num_state_layers else 0, max_context=settings.max_context,
                max_concurrency=settings.max_concurrency, vocab_size=tokenizer.vocab_size, device=self.device,
                dtype=dtype, kv_dtype=settings.kv_dtype, cuda_graphs=not settings.no_cuda_graph)
            capacity = self.kv_sizing.tokens
            log.info("KV capacity auto: %d tokens (%s)", capacity, self.kv_sizing.as_dict())
        else:
            capacity = settings.kv_capacity or settings.max_context
        self.kv_capacity = capacity
        pages = PagePool((capacity + settings.page_size - 1) // settings.page_size, settings.page_size)
        slots = SlotPool(num_slots) if spec.num_state_layers > 0 else None
        self.runner = ModelRunner(model, num_pages=pages.num_pages, page_size=settings.page_size,
                                  num_state_slots=num_slots if slots else 0, num_lanes=settings.max_concurrency,
                                  vocab_size=tokenizer.vocab_size, device=self.device, dtype=dtype,
                                  cuda_graphs=not settings.no_cuda_graph, max_seq_len=settings.max_context,
                                  kv_dtype=settings.kv_dtype, prefill_chunk=settings.prefill_chunk)
        self.hybrid = slots is not None
        self.cache = ContextCache(pages, slots, hybrid=self.hybrid, enabled=settings.prefix_reuse)
        self.scheduler = Scheduler(max_concurrency=settings.max_concurrency, prefill_chunk=settings.prefill_chunk,
                                   pages=pages, slots=slots, cache=self.cache)
        self.scheduler.before_pause = self._before_pause
        self.thinking = self._thinking_control(tokenizer)
        self.counters = Counters()
        self.context = ContextOps(self.cache, pages, slots, self.runner.cache, self.counters, page_size=settings.page_size,
                                  host_budget=settings.host_context_bytes)
        self.work = HostWork()
        self._recovering: set[str] = set()  # restored requests whose next commit completes recovery
        self.healthy = True
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._by_id: dict[str, Sequence] = {}
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
        with self._lock:
            if request.request_id in self._by_id:
                raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
            limit = self.settings.max_concurrency + self.settings.max_pending_requests
            if len(self._by_id) >= limit:
                raise ServerOverloadedError(
                    f"the server holds {len(self._by_id)} requests, its limit of running plus pending requests"
                )
            self._order += 1
            seq.order = self._order
            self._by_id[request.request_id] = seq
        self._inbox.put(("submit", seq))
        self._wake.set()

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))
        self._wake.set()

    async def stream(self, request: EngineRequest) -> AsyncIterator[object]:
        """Submit and yield events until the terminal FinishEvent; cancels the request if abandoned."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        self.submit(request, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
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
            "running": len(resident),
            "waiting": len(sched.waiting),
            "paused": len(sched.paused),
            "prefilling": sum(s.status is Status.PREFILL for s in resident),
            "replaying": sum(s.status is Status.PREFILL and bool(s.output_ids) for s in resident),
            "materializing": 0,  # snapshot restores and prefix copies complete inside admission
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
            "host_context_used_bytes": self.context.host_used,
            "host_context_capacity_bytes": self.context.host_budget,
            **{k: v for k, v in vars(c).items() if k not in ("requests", "context_transfer_bytes")},
            "requests": dict(c.requests),
            "context_transfer_bytes": dict(c.context_transfer_bytes),
            **self.work.snapshot(),
        }

    # ---- preparation (caller's thread) -------------------------------------------------------
    def _thinking_control(self, tokenizer) -> ThinkingControl:
        end_id = tokenizer.token_to_id("</think>")
        if end_id is None:
            return ThinkingControl(think_end_id=None)
        suffix = tokenizer.encode(THINKING_GUIDANCE) + [end_id]
        return ThinkingControl(think_end_id=end_id, think_start_id=tokenizer.token_to_id("<think>"),
                               close_suffix=suffix)

    def resolve_sampling(self, request: EngineRequest) -> ResolvedSampling:
        return resolve_sampling(self.settings, request)

    def _prepare(self, request: EngineRequest, emit) -> Sequence:
        s = self.settings
        n = len(request.prompt_ids)
        ceiling = min(s.max_context, self.kv_capacity)
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
        deadline = time.monotonic() + s.pending_timeout_ms / 1000.0
        # attention-only models reuse any page-aligned prefix of a finished request; only hybrid
        # models need their state captured at the frontend's boundaries
        checkpoints = sorted({p for p in request.checkpoints if 0 < p < n}) if self.hybrid and s.prefix_reuse else []
        return Sequence(request=request, order=0, sampling=self.resolve_sampling(request), max_tokens=max_tokens,
                        controller=controller, emit=emit, deadline=deadline, checkpoints=checkpoints)

    # ---- the loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            try:
                with self.work.phase("engine_boundary"):
                    self._drain_inbox()
                    self._expire_waiting()
                    self._admit()
                worked = self.work.run_step("prefill", self._prefill_step)
                worked |= self.work.run_step("decode", self._decode_step)
            except Exception as exc:  # an engine-wide failure: fail everything, report unhealthy
                log.exception("engine step failed")
                self._fail_all(exc)
                return
            if not worked:
                self._wake.wait(timeout=0.05)
                self._wake.clear()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                item.status = Status.WAITING
                self.scheduler.waiting.append(item)
            elif kind == "cancel":
                seq = self._by_id.get(item)
                if seq is not None and seq.status is not Status.FINISHED:
                    self._finish(seq, FinishReason.CANCELLED)

    def _expire_waiting(self) -> None:
        now = time.monotonic()
        for seq in [s for s in self.scheduler.waiting if s.deadline <= now]:
            self.scheduler.remove(seq)
            self._drop(seq)
            seq.emit(QueueTimeoutError(
                f"request was not admitted within {self.settings.pending_timeout_ms} ms"))
            self._count_outcome("queue_timeout")

    def _admit(self) -> None:
        for seq in self.scheduler.admit():
            restored = None  # the route of a paused request coming back
            if seq.t_paused is not None:
                self.counters.paused_seconds += time.monotonic() - seq.t_paused
                seq.t_paused = None
                restored = "snapshot" if seq.snapshot is not None else "replay"
            if seq.snapshot is not None:
                self.context.restore_snapshot(seq)
            else:
                reused = self.context.reuse_prefix(seq)
                if seq.t_admit is None:  # initial binding: the request's cached count is fixed here
                    seq.cached_tokens = reused
                    seq.prefix_path = "checkpoint" if reused else "root"
                    self.counters.cached_prompt_tokens += reused
                elif seq.output_ids:
                    self.counters.replay_restores += 1
                if seq.output_ids and seq.num_computed >= seq.prefill_target:
                    seq.status = Status.DECODE  # a retained prefix covered the whole replay
            if seq.t_admit is None:
                seq.t_admit = time.monotonic()
                self.counters.prompt_tokens += seq.prompt_len
                if seq.request.return_progress:
                    seq.emit(ProgressEvent(seq.prompt_len, seq.cached_tokens, seq.cached_tokens, 0.0))
            if seq.sampling.penalized:  # only penalties read a lane's counts: the others never count
                self.runner.reset_lane(seq.lane, seq.output_ids)
            if restored:
                self._scheduling_event(seq, "restored", restored)

    def _prefill_step(self) -> bool:
        unit = self.scheduler.next_prefill()
        if unit is None:
            return False
        if isinstance(unit, Sequence):  # no room even alone: the pool is smaller than this context
            self._starved(unit)
            return True
        seq = unit.seq
        with self.work.phase("program_submit"):
            logits = self.runner.forward([seq], [seq.tokens(unit.start, unit.end)])
        computed = unit.end - unit.start
        seq.num_computed = unit.end
        if unit.end in seq.checkpoints:
            self.context.capture(seq, unit.end, "input")
        self.counters.prefill_chunks += 1
        if seq.output_ids:
            self.counters.replayed_tokens += computed
        else:
            self.counters.prefill_tokens += computed
        if not unit.is_last:
            self._progress(seq)
            return True
        if not seq.samples_after_prefill:  # replay done: resume decoding without resampling
            seq.status = Status.DECODE
            self._scheduling_event(seq, "replay_complete", "replay")
            return True
        self._progress(seq)
        if seq.max_tokens == 0:
            self._finish(seq, FinishReason.LENGTH)
            return True
        with self.work.phase("program_post"):
            sampled = self.runner.sample([seq], logits)
        with self.work.phase("device_wait"):
            token = int(sampled[0])
        seq.status = Status.DECODE
        with self.work.phase("engine_commit_output"):
            self._commit(seq, token)
        return True

    def _progress(self, seq: Sequence) -> None:
        if seq.request.return_progress and seq.t_admit is not None:
            elapsed = (time.monotonic() - seq.t_admit) * 1000.0
            seq.emit(ProgressEvent(seq.prompt_len, seq.cached_tokens, min(seq.num_computed, seq.prompt_len), elapsed))

    def _decode_step(self) -> bool:
        ready, starved = self.scheduler.decode_batch()
        for seq in starved:
            self._starved(seq)
        if not ready:
            return bool(starved)
        with self.work.phase("program_submit"):
            logits = self.runner.forward(ready, [[s.output_ids[-1]] for s in ready])
        with self.work.phase("program_post"):
            sampled = self.runner.sample(ready, logits)
        with self.work.phase("device_wait"):
            tokens = sampled.tolist()  # the one host sync per step
        self.counters.decode_steps += 1
        with self.work.phase("engine_commit_output"):
            counted: list[tuple[int, int]] = []
            for seq, token in zip(ready, tokens):
                seq.num_computed += 1
                if seq.status is not Status.DECODE:
                    continue
                if seq.forced:  # thinking-budget control tokens replace the sample
                    self._commit(seq, seq.forced.popleft(), forced=True, counted=counted)
                else:
                    self._commit(seq, token, counted=counted)
            if counted:
                lanes, ids = zip(*counted)
                self.runner.count_tokens(list(lanes), list(ids))
        return True

    def _starved(self, seq: Sequence) -> None:
        oldest = min(self.scheduler.resident, key=lambda s: s.order)
        if seq is oldest:
            self._finish(seq, FinishReason.CONTEXT)
        else:
            self.scheduler.pause(seq)

    def _commit(self, seq: Sequence, token: int, forced: bool = False,
                counted: list[tuple[int, int]] | None = None) -> None:
        """Commit one token. `counted` collects (lane, token) for one batched penalty-count upload per
        decode step; without it the token is counted at once."""
        now = time.monotonic()
        if seq.t_first is None:
            seq.t_first = now
        seq.t_last = now
        seq.output_ids.append(token)
        if self._recovering and seq.request_id in self._recovering:  # first fresh token after a restore
            self._recovering.discard(seq.request_id)
            self._scheduling_event(seq, "recovery_complete", None)
        self.counters.generation_tokens += 1
        if len(seq.output_ids) > 1:
            self.counters.decode_tokens += 1
        if not seq.sampling.penalized:
            pass  # nothing reads its counts: no upload, no kernels
        elif counted is None:
            self.runner.count_tokens([seq.lane], [token])  # uploaded through pinned memory: no host sync
        else:
            counted.append((seq.lane, token))
        events, reason = seq.controller.commit(token, forced=forced)
        for ev in events:
            seq.emit(ev)
        if reason is None:
            if len(seq.output_ids) >= seq.max_tokens:
                reason = FinishReason.LENGTH
            elif seq.total_len >= self.settings.max_context:
                reason = FinishReason.CONTEXT
        if reason is not None:
            self._finish(seq, reason)
        elif not seq.forced and seq.controller.budget_exhausted():
            seq.forced.extend(self.thinking.close_suffix)

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        if reason in (FinishReason.LENGTH, FinishReason.CONTEXT, FinishReason.CANCELLED):
            tail = seq.controller.finish_text()
            if tail:
                seq.emit(TokenEvent([], seq.controller.channel, tail))
        if reason not in (FinishReason.CANCELLED, FinishReason.ERROR):
            self.context.retain_endpoint(seq)
        self.context.free_snapshot(seq)
        self.scheduler.remove(seq)
        seq.status = Status.FINISHED
        if seq.preemptions:
            self._recovering.discard(seq.request_id)
            self._scheduling_event(seq, "terminal", None)
        self._drop(seq)
        now = time.monotonic()
        admitted = seq.t_admit or now
        first = seq.t_first or now
        timings = Timings(
            cache_n=seq.cached_tokens,
            prompt_n=seq.prompt_len - seq.cached_tokens,
            prompt_ms=(first - admitted) * 1000.0 if seq.t_admit else 0.0,
            predicted_n=len(seq.output_ids),
            predicted_ms=((seq.t_last or first) - first) * 1000.0,
        )
        usage = Usage(prompt_tokens=seq.prompt_len, cached_tokens=seq.cached_tokens,
                      completion_tokens=len(seq.output_ids), reasoning_tokens=seq.controller.reasoning_tokens)
        seq.emit(FinishEvent(reason, usage, timings, stop_string=seq.controller.stop_string,
                             thinking_budget_applied=seq.controller.budget_applied,
                             preemptions=seq.preemptions, prefix_reuse_path=seq.prefix_path, error=error))
        self._count_outcome(reason.value)

    # ---- observability: pause/restore events and transfer accounting --------------------------
    def _before_pause(self, seq: Sequence) -> None:
        self.context.snapshot_on_pause(seq)
        self._scheduling_event(seq, "paused", "snapshot" if seq.snapshot is not None else "replay", index=1)

    def _scheduling_event(self, seq: Sequence, kind: str, route: str | None, index: int = 0) -> None:
        """Tell the request's consumer about a pause-cycle boundary (only when the request log wants them).

        `index` is 1 while pausing: the scheduler counts the preemption after its pause hook returns.
        """
        if not self.settings.scheduling_events:
            return
        if kind == "restored":
            self._recovering.add(seq.request_id)
        c, now = self.counters, time.monotonic_ns()
        seq.emit(SchedulingEvent(
            kind=kind, preemption_index=seq.preemptions + index, route=route, steady_ns=now,
            elapsed_ns=now - int(seq.t_submit * 1e9),
            global_tokens={"prefill": c.prefill_tokens, "decode": c.decode_tokens, "replay": c.replayed_tokens},
            request_tokens={"computed": seq.num_computed, "generated": len(seq.output_ids)}))

    @property
    def host_used(self) -> int:
        return self.context.host_used

    def _drop(self, seq: Sequence) -> None:
        with self._lock:
            self._by_id.pop(seq.request_id, None)

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
