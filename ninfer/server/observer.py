"""One generation request's lifecycle, seen once and told three ways: JSONL events, metrics, stderr records.

Every generation endpoint (Chat Completions, Responses, Messages) uses it through the one pipeline
(server.generation), after its schema/model validation (those rejections are not measurement
requests and get no request id):

    trace = request.app.state.observer.begin(RequestShape.of("openai_chat", conversation, ...), request_id)
    with trace.preparation():                 # a failure here -> request_rejected, then re-raised
        media = await prepare_media(...)
        trace.media_prepared(media.batch.stats)   # the preprocessor's request-scoped MediaStats
        prompt = build_prompt(...)
        trace.prompt_built(seconds)           # template + tokenizer + media placeholder expansion
        trace.submitting(engine_request, prompt)
        events = await ctx.engine.open(engine_request)   # event lists
    with trace.generation():                  # exactly one terminal: request_done or request_error
        async for batch in trace.watch(events):  # SchedulingEvents become request_scheduling; never yielded
            ...
        trace.finish(decoded)                 # request_done (or request_error for an engine failure)

Leaving generation() without finish() (client gone, engine error, exception) writes request_error; an
exception after finish() is a response failure: counted and logged, never a second terminal.
Stderr records carry counts, codes and timings only: never prompts, outputs, bodies or client messages.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator

from ninfer.chat import ir
from ninfer.config import ServerConfig
from ninfer.engine.engine import resolve_sampling
from ninfer.engine.types import (
    EngineError,
    EngineRequest,
    FinishEvent,
    FinishReason,
    ProgressEvent,
    SchedulingEvent,
    TokenEvent,
)
from ninfer.media import MediaStats
from ninfer.protocol.anthropic_errors import anthropic_category, anthropic_status
from ninfer.protocol.errors import ProtocolError, from_engine_error
from ninfer.server.metrics import RequestFigures
from ninfer.server.request_log import ModelIdentity, RequestLog, server_start_fields
from ninfer.server.startup import DEFAULT_DRAFTS, engine_settings

log = logging.getLogger("ninfer.request")

NO_SPECULATION = {"backend": None, "draft_window": None, "rounds": 0, "drafted_tokens": 0, "accepted_tokens": 0,
                  "fallback_steps": 0, "accepted_per_position": []}


@dataclass(frozen=True)
class RequestShape:
    """What a validated request asks for: counts and options, never text."""

    protocol: str  # openai_chat, openai_responses, anthropic_messages
    model: str
    stream: bool
    message_count: int
    media_item_count: int
    tool_count: int
    tool_choice: str
    has_tool_history: bool
    requested_output_tokens: int | None  # None: the server default applies
    requested_reasoning_effort: str | None
    preserve_thinking: bool | None  # the explicit option; None when unspecified
    preserve_thinking_semantic_change: bool = False  # Responses: replay changed thinking semantics

    @classmethod
    def of(cls, protocol: str, conversation: ir.Conversation, *, model: str, stream: bool,
           max_tokens: int | None, semantic_change: bool = False) -> "RequestShape":
        parts = [p for m in conversation.messages for p in m.parts]
        media = sum(isinstance(p, (ir.ImagePart, ir.VideoPart)) for p in parts)
        media += sum(isinstance(c, ir.ImagePart) for p in parts if isinstance(p, ir.ToolResultPart) for c in p.content)
        options = conversation.options
        return cls(protocol=protocol, model=model, stream=stream, message_count=len(conversation.messages),
                   media_item_count=media, tool_count=len(conversation.tools), tool_choice=conversation.tool_choice,
                   has_tool_history=any(isinstance(p, (ir.ToolCallPart, ir.ToolResultPart)) for p in parts),
                   requested_output_tokens=max_tokens, requested_reasoning_effort=options.reasoning_effort,
                   preserve_thinking=options.preserve_thinking, preserve_thinking_semantic_change=semantic_change)


class RequestObserver:
    """One per router (or in-process server): the request log writer, request figures and id counter."""

    def __init__(self, cfg: ServerConfig, model: ModelIdentity, request_log: RequestLog | None):
        self.cfg = cfg
        self.model = model
        self.log = request_log
        self.figures = RequestFigures()
        # the engine's sampling inputs, so request_start can log the resolved sampler
        self.sampling_settings = replace(engine_settings(cfg), sampling_presets=model.sampling_presets)
        self._ids = itertools.count(1)

    @classmethod
    def for_config(cls, cfg: ServerConfig, *, role: str = "server", replica: str | None = None,
                   model: ModelIdentity | None = None, engine=None) -> "RequestObserver":
        """Open the request log (if configured) and write this process's server_start (`engine`: the engine when it
        lives in this process, for its capacities, memory and environment)."""
        model = model or ModelIdentity.of(cfg)
        request_log = RequestLog.for_config(cfg)
        if request_log is not None:
            facts = {"engine": engine.snapshot(), "report": engine.startup_report()} if engine is not None else {}
            request_log.write("server_start", **server_start_fields(cfg, model, role=role, replica=replica, **facts))
        logging.getLogger("ninfer.server").info(
            "%s ready: model %s (%s), context %d tokens, auth %s, request log %s", role, model.model_id,
            model.architecture, cfg.max_context, "on" if cfg.api_key else "off", cfg.request_log_jsonl or "off")
        return cls(cfg, model, request_log)

    def next_id(self) -> int:
        return self.log.next_request_id() if self.log else next(self._ids)

    def begin(self, shape: RequestShape, http_request_id: str) -> "RequestTrace":
        """The request enters preparation: it gets its id and will get exactly one JSONL outcome."""
        return RequestTrace(self, shape, http_request_id)


class RequestTrace:
    def __init__(self, observer: RequestObserver, shape: RequestShape, http_request_id: str):
        self.observer = observer
        self.shape = shape
        self.id = observer.next_id()
        self.http_id = http_request_id
        self.t_begin = time.monotonic()
        self.t_submit: float | None = None
        self.t_admit: float | None = None
        self.t_first: float | None = None
        self.engine_request: EngineRequest | None = None
        self.media_stats = MediaStats()  # a text-only request keeps these zeros
        self.tokenizer_seconds = 0.0
        self.prompt_tokens = 0
        self.thinking = False
        self.sampling: dict[str, Any] | None = None
        self.token_ids: list[int] = []
        self.fin: FinishEvent | None = None
        self.engine_error: EngineError | None = None
        self.started = False
        self.settled = False  # a terminal (request_rejected, request_done or request_error) was written
        # the last pause-cycle boundary seen and when it arrived (router clock, ns); None: never preempted
        self.last_boundary: tuple[SchedulingEvent, int] | None = None

    # ---- preparation -------------------------------------------------------------------------
    @contextmanager
    def preparation(self):
        """Preparation failures become request_rejected (the exception still propagates); success: start."""
        try:
            yield self
        except BaseException as exc:
            self._reject(_as_protocol_error(exc))
            raise
        self._start()

    def media_prepared(self, stats: MediaStats | None) -> None:
        """The request's own media figures, as the preprocessor measured them (PreparedBatch.stats);
        None for a request without media."""
        if stats is not None:
            self.media_stats = stats

    def prompt_built(self, seconds: float) -> None:
        """Seconds spent rendering the template, tokenizing and expanding media placeholders."""
        self.tokenizer_seconds = seconds

    def submitting(self, engine_request: EngineRequest, prompt) -> None:
        """Called just before the engine submission. With the request log on, the seed the engine would
        draw is drawn here and pinned, so the logged sampler is exactly what runs."""
        self.engine_request = engine_request
        self.prompt_tokens = len(engine_request.prompt_ids)
        self.thinking = bool(getattr(prompt, "thinking", engine_request.thinking))
        if self.observer.log is not None:
            resolved = resolve_sampling(self.observer.sampling_settings, engine_request)
            if engine_request.sampling.seed is None:
                engine_request.sampling = replace(engine_request.sampling, seed=resolved.seed)
            self.sampling = {k: getattr(resolved, k) for k in ("temperature", "top_p", "top_k", "min_p",
                                                               "presence_penalty", "frequency_penalty", "seed")}
        self.t_submit = time.monotonic()

    def _reject(self, err: ProtocolError) -> None:
        if self.settled:
            return
        self.settled = True
        self.observer.figures.count("rejected")
        status, kind = err.status, err.type
        if self.shape.protocol == "anthropic_messages":  # what the client received: Anthropic's status and type
            status = anthropic_status(err)
            kind = anthropic_category(status)
        log.info("%s %s rejected: %d %s", self.http_id, self.shape.protocol, status, err.code or kind)
        self._write("request_rejected", phase="prepare", request=self._shape_fields(),
                    error={"status": status, "type": kind, "code": err.code, "param": err.param,
                           "message": err.message})

    def _start(self) -> None:
        self.started = True
        s, cfg = self.shape, self.observer.cfg
        budget = s.requested_output_tokens if s.requested_output_tokens is not None else cfg.default_max_tokens
        log.info("%s %s start: prompt %d tokens, max_tokens %d (%s), %s, tools %d, thinking %s", self.http_id,
                 s.protocol, self.prompt_tokens, budget, "client" if s.requested_output_tokens is not None else "default",
                 "stream" if s.stream else "non-stream", s.tool_count, "on" if self.thinking else "off")
        m = self.media_stats
        self._write("request_start", request=self._request_fields(),
                    preparation_seconds={"total": (self.t_submit or time.monotonic()) - self.t_begin,
                                         "media_acquisition": m.acquire_seconds,
                                         "media_gate_wait": m.gate_wait_seconds,
                                         "media_preprocess_wall": m.wall_seconds,
                                         "media_preprocess_work": m.work_seconds,
                                         "tokenizer": self.tokenizer_seconds},
                    media=self._media_fields())

    # ---- generation --------------------------------------------------------------------------
    async def watch(self, batches: AsyncIterator[list[Any]]) -> AsyncIterator[list[Any]]:
        """The engine stream's event lists as the endpoint should see them, observed on the way through."""
        try:
            async for batch in batches:
                kept = []
                for ev in batch:
                    if isinstance(ev, SchedulingEvent):
                        self._scheduling(ev)
                        continue
                    self._observe(ev)
                    kept.append(ev)
                if kept:
                    yield kept
        except EngineError as exc:
            self.engine_error = exc
            raise
        finally:
            await batches.aclose()

    def _observe(self, ev: Any) -> None:
        now = time.monotonic()
        if isinstance(ev, ProgressEvent) and self.t_admit is None:
            self.t_admit = now - ev.time_ms / 1000.0
        elif isinstance(ev, TokenEvent) and ev.token_ids:
            self.token_ids.extend(ev.token_ids)
            if self.t_first is None:
                self.t_first = now
                self.observer.figures.ttft.observe(now - self.t_begin)
        elif isinstance(ev, FinishEvent):
            self.fin = ev

    @contextmanager
    def generation(self):
        try:
            yield self
        except BaseException as exc:
            if self.settled:  # the outcome is recorded: this is a rendering or transport failure
                self.observer.figures.response_failures += 1
                log.warning("%s response failed after the outcome (%s)", self.http_id, type(exc).__name__)
            else:
                self._settle_without_finish(exc)
            raise
        self._settle_without_finish(None)

    def finish(self, decoded: ir.DecodedOutput | None = None, fin: FinishEvent | None = None) -> None:
        """The engine returned its outcome and the endpoint decoded it: the request's terminal.

        `fin` stands in when the endpoint ended the generation itself (Responses stops at the first
        call with parallel_tool_calls:false) and no engine FinishEvent was observed."""
        if self.fin is None and fin is not None:
            self.fin = fin
            # the endpoint stopped reading mid event list: tokens observed past its cutoff were never answered
            del self.token_ids[fin.usage.completion_tokens:]
        fin = self.fin
        if self.settled or fin is None:
            return
        if fin.reason is FinishReason.ERROR:
            self._error("error", "engine_failure", f"generation failed in the engine: {fin.error}")
            return
        self.settled = True
        now = time.monotonic()
        figures = self.observer.figures
        figures.count(fin.reason.value)
        figures.duration.observe(now - self.t_begin)
        if self.t_admit is not None and self.t_submit is not None:
            figures.queue.observe(max(self.t_admit - self.t_submit, 0.0))
        u, t = fin.usage, fin.timings
        rate = (u.completion_tokens - 1) / (t.predicted_ms / 1000.0) if t.predicted_ms > 0 else 0.0
        log.info("%s done %s: prompt %d (cached %d, %s), completion %d, ttft %s, decode %.1f tok/s, total %.2f s",
                 self.http_id, fin.reason.value, u.prompt_tokens, u.cached_tokens, fin.prefix_reuse_path,
                 u.completion_tokens, _ms(self._since_begin(self.t_first)), rate, now - self.t_begin)
        self._write("request_done", request=self._request_fields(), result=self._result(fin, decoded),
                    timings_seconds=self._timings(now, fin),
                    scheduling=fin.scheduling or {"preemptions": fin.preemptions},
                    engine_timing=fin.engine_timing, first_output_timing=fin.first_output_timing,
                    work=fin.work, context_transfers=fin.context_transfers)

    def _settle_without_finish(self, exc: BaseException | None) -> None:
        if self.settled or not self.started:
            return
        if self.engine_error is not None:
            code = self.engine_error.code
            outcome = "queue_timeout" if code == "request_queue_timeout" else "error"
            self._error(outcome, code, str(self.engine_error))
        elif self.fin is not None and self.fin.reason is FinishReason.ERROR:
            self._error("error", "engine_failure", f"generation failed in the engine: {self.fin.error}")
        elif self.fin is not None:  # an outcome the endpoint did not get to decode
            self.finish(None)
        elif exc is None or isinstance(exc, (GeneratorExit, asyncio.CancelledError)):
            self._cancelled_terminal_boundary()
            self._error("cancelled", "cancelled", "the client went away before the outcome")
        else:
            self._error("error", "internal_error", f"the response failed before the outcome ({type(exc).__name__})")

    def _error(self, outcome: str, code: str, message: str) -> None:
        self.settled = True
        now = time.monotonic()
        figures = self.observer.figures
        figures.count(outcome)
        if outcome == "cancelled":  # a settled outcome, unlike failures
            figures.duration.observe(now - self.t_begin)
            if self.t_admit is not None and self.t_submit is not None:
                figures.queue.observe(max(self.t_admit - self.t_submit, 0.0))
        level = logging.INFO if outcome == "cancelled" else logging.WARNING
        log.log(level, "%s %s: %s after %.2f s", self.http_id, outcome, code, now - self.t_begin)
        kind = {"cancelled": "cancellation"}.get(outcome, "generation")
        self._write("request_error", request=self._request_fields(),
                    error={"kind": kind, "code": code, "message": message},
                    timings_seconds={"prepare": self._prepare_seconds(), "ttft": self._since_begin(self.t_first),
                                     "total": now - self.t_begin})

    def __del__(self):
        # Safety net: a streaming body the server never started leaves no generation() exit behind.
        try:
            self._settle_without_finish(None)
        except Exception:
            pass

    # ---- scheduling events -------------------------------------------------------------------
    def _scheduling(self, ev: SchedulingEvent) -> None:
        log.debug("%s %s (pause %d, %s)", self.http_id, ev.kind, ev.preemption_index, ev.route or "-")
        self.last_boundary = (ev, time.monotonic_ns())
        self._write("request_scheduling", request={"request_id": self.id, "x_request_id": self.http_id},
                    scheduling={"kind": ev.kind, "preemption_index": ev.preemption_index, "route": ev.route,
                                "steady_ns": ev.steady_ns, "elapsed_ns": ev.elapsed_ns},
                    progress={"global": ev.global_tokens, "request": ev.request_tokens})

    def _cancelled_terminal_boundary(self) -> None:
        """A preempted request the client abandoned still ends its pause cycles with a terminal boundary (contract,
        "Structured request log"). The engine emits one when it drops the request, into the stream the client's
        departure closed, so the router writes it: dated on the engine's clock as the last boundary seen plus the
        time since it arrived, with that boundary's progress counters."""
        if self.last_boundary is None or self.last_boundary[0].kind == "terminal":
            return
        last, arrived_ns = self.last_boundary
        since = time.monotonic_ns() - arrived_ns
        self._scheduling(SchedulingEvent("terminal", last.preemption_index, None, last.steady_ns + since,
                                         last.elapsed_ns + since, last.global_tokens, last.request_tokens))

    # ---- record fields -----------------------------------------------------------------------
    def _write(self, event: str, **fields: Any) -> None:
        if self.observer.log is not None:
            self.observer.log.write(event, **fields)

    def _shape_fields(self) -> dict[str, Any]:
        s = self.shape
        client_set = s.requested_output_tokens is not None
        return {
            "request_id": self.id, "x_request_id": self.http_id, "protocol": s.protocol, "model": s.model,
            "stream": s.stream, "message_count": s.message_count, "media_item_count": s.media_item_count,
            "requested_output_tokens": s.requested_output_tokens if client_set else self.observer.cfg.default_max_tokens,
            "requested_output_tokens_source": "client" if client_set else "server_default",
            "tool_count": s.tool_count, "tool_choice": s.tool_choice, "has_tool_history": s.has_tool_history,
            "requested_reasoning_effort": s.requested_reasoning_effort,
        }

    def _media_fields(self) -> dict[str, Any]:
        """request_start.media: this request's items, cache outcomes and sizes (never process-global deltas)."""
        m = self.media_stats
        return {"items": m.items,
                "cache": {"hits": m.cache_hits, "misses": m.cache_misses, "single_flight_joins": m.single_flight_joins},
                "source_bytes": m.source_bytes, "decoded_pixels": m.decoded_pixels, "payload_bytes": m.payload_bytes,
                "raw_patches": m.raw_patches, "vision_tokens": m.vision_tokens}

    def _request_fields(self) -> dict[str, Any]:
        req = self.engine_request
        budget = None
        if self.thinking and req is not None:
            budget = req.thinking_budget if req.thinking_budget is not None else self.observer.cfg.default_thinking_budget
        return {**self._shape_fields(), "prompt_tokens": self.prompt_tokens, "enable_thinking": self.thinking,
                "thinking_budget": budget, "preserve_thinking": self.shape.preserve_thinking,
                "preserve_thinking_semantic_change": self.shape.preserve_thinking_semantic_change,
                "sampling": self.sampling}

    def _result(self, fin: FinishEvent, decoded: ir.DecodedOutput | None) -> dict[str, Any]:
        u = fin.usage
        parse = None
        if decoded is not None:
            stats = decoded.tool_parse
            parse = {"marker_seen": stats.marker_seen, "structured_call_count": len(decoded.tool_calls),
                     "empty_arguments_omitted": stats.empty_arguments_omitted,
                     "schema_mismatch_arguments": stats.schema_mismatch_arguments,
                     "fallback_reason": decoded.fallback_reason}
        return {
            "finish_reason": fin.reason.value, "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens, "reasoning_tokens": u.reasoning_tokens,
            "computed_prefill_tokens": u.prompt_tokens - u.cached_tokens, "prefix_cache_hit_tokens": u.cached_tokens,
            "prefix_reuse_path": fin.prefix_reuse_path, "stop_string_matched": fin.stop_string is not None,
            "thinking_budget": self._request_fields()["thinking_budget"],
            "thinking_control_applied": fin.thinking_budget_applied,
            "tool_call_count": len(decoded.tool_calls) if decoded is not None else None,
            "tool_call_parse": parse, "generated_token_ids": list(self.token_ids),
        }

    def _timings(self, now: float, fin: FinishEvent) -> dict[str, Any]:
        queue = None
        if self.t_admit is not None and self.t_submit is not None:
            queue = max(self.t_admit - self.t_submit, 0.0)
        return {"prepare": self._prepare_seconds(), "queue": queue, "ttft": self._since_begin(self.t_first),
                "vision": fin.vision_seconds, "prefill": fin.timings.prompt_ms / 1000.0, "decode": fin.timings.predicted_ms / 1000.0,
                "total": now - self.t_begin, "speculative": self._speculative(fin)}

    def _speculative(self, fin: FinishEvent) -> dict[str, Any]:
        """The request's speculative counts (contract: request log), with the process's backend and window."""
        cfg = self.observer.cfg
        if fin.speculative is None:
            return dict(NO_SPECULATION)
        return {"backend": cfg.spec, "draft_window": cfg.draft_tokens or DEFAULT_DRAFTS.get(cfg.spec),
                **fin.speculative}

    def _prepare_seconds(self) -> float | None:
        return None if self.t_submit is None else self.t_submit - self.t_begin

    def _since_begin(self, t: float | None) -> float | None:
        return None if t is None else t - self.t_begin


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def _as_protocol_error(exc: BaseException) -> ProtocolError:
    if isinstance(exc, ProtocolError):
        return exc
    if isinstance(exc, EngineError):
        return from_engine_error(exc)
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return ProtocolError("the client went away during preparation", code="cancelled", status=499)
    return ProtocolError("internal server error", code="internal_error", status=500)
