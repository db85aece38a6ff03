"""The one server pipeline behind the generation endpoints (Chat Completions, Responses, Messages).

An endpoint lowers its request to a GenerationSpec and supplies an OutputRenderer; everything in
between is here and the same for all three:

    measured (observer) -> media prepared (media_prep) -> prompt built off the loop -> engine request submitted
        -> engine events through the output decoder (decoding.Generation)
        -> one JSON body, or SSE frames behind the keep-alive

Failures are typed where they happen and rendered by the protocol: before the answer starts they
are ProtocolErrors (HTTP status and body); once a stream is open they become the renderer's failure
frames. Closing the engine stream, whatever happens, cancels the request in the engine, which is
how a client disconnect frees its pages.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ninfer.chat import ir
from ninfer.chat.errors import PromptError
from ninfer.engine.types import ContextLengthExceededError, EngineError, EngineRequest, ProgressEvent
from ninfer.protocol.errors import ProtocolError, from_engine_error, from_prompt_error
from ninfer.server.context import ServerContext, effective_max_model_len
from ninfer.server.decoding import Generation, GenerationFailed, Outcome, prepended
from ninfer.server.media_prep import PromptMedia, media_inputs, prepare_media
from ninfer.server.observer import RequestShape, RequestTrace
from ninfer.server.sse import SSE_HEADERS, with_keepalive


class OutputRenderer(Protocol):
    """One protocol's view of a generation: its aggregate body and its stream's SSE frames."""

    async def body(self, outcome: Outcome) -> dict[str, Any]: ...

    def opening(self) -> list[bytes]: ...  # before the first engine event

    def progress(self, ev: ProgressEvent) -> list[bytes]: ...

    def delta(self, d: ir.OutputDelta) -> list[bytes]: ...

    async def closing(self, outcome: Outcome) -> list[bytes]: ...  # after the outcome is recorded

    def failure(self, err: ProtocolError) -> list[bytes]: ...  # ends a stream that cannot finish


@dataclass
class GenerationSpec:
    """A lowered request: what the pipeline needs from the protocol before it meets the engine."""

    shape: RequestShape
    request_id: str  # the engine request's id (the protocol's object id): its lifetime slot is held under it
    conversation: ir.Conversation
    engine_request: Callable[[ir.Prompt], EngineRequest]  # the protocol's engine fields, once the prompt is built
    renderer: Callable[[Generation], OutputRenderer]  # made once the engine accepted the request
    single_call: bool = False  # end the answer at its first tool call (Responses' parallel_tool_calls:false)


def engine_request(request_id: str, prompt: ir.Prompt, **fields: Any) -> EngineRequest:
    """The engine request every protocol sends for `prompt`, plus its own `fields`.

    `request_id` is the protocol's object id: unique even when a client reuses its request id."""
    return EngineRequest(request_id=request_id, prompt_ids=list(prompt.token_ids), thinking=prompt.thinking,
                         return_progress=True,  # the first progress event marks admission
                         checkpoints=checkpoints(prompt), **fields)


def checkpoints(prompt: ir.Prompt) -> list[int]:
    """Prompt boundaries worth retaining for reuse: the input boundary and the cache-hint candidates."""
    marks = set(prompt.cache_candidates)
    if prompt.input_boundary is not None:
        marks.add(prompt.input_boundary)
    return sorted(marks)


def build_prompt(ctx: ServerContext, conversation: ir.Conversation, media: PromptMedia | None = None) -> ir.Prompt:
    """Template + tokenizer (+ media placeholders expanded to pads); call it in a thread to keep the
    event loop free."""
    try:
        return ctx.frontend.build_prompt(conversation, media.items if media is not None else None)
    except PromptError as exc:  # the conversation cannot become a prompt: the client must change it
        raise from_prompt_error(exc) from None


def _timed_build_prompt(ctx: ServerContext, conversation: ir.Conversation,
                        media: PromptMedia | None) -> tuple[ir.Prompt, float]:
    """build_prompt and its seconds, measured in the worker thread (the thread hop is not tokenizer time)."""
    start = time.perf_counter()
    prompt = build_prompt(ctx, conversation, media)
    return prompt, time.perf_counter() - start


async def count_prompt_tokens(ctx: ServerContext, conversation: ir.Conversation) -> int:
    """The token count endpoints: the prompt a generation would see, media expanded; nothing runs."""
    media = await prepare_media(ctx, conversation, hold=False)  # only the grids are needed
    prompt = await asyncio.to_thread(build_prompt, ctx, conversation, media)
    return len(prompt.token_ids)


def check_media_context(ctx: ServerContext, prompt: ir.Prompt) -> None:
    """An expanded media prompt must fit the context (the engine checks text prompts itself)."""
    if prompt.media_spans and len(prompt.token_ids) > ctx.max_model_len:
        raise from_engine_error(ContextLengthExceededError(len(prompt.token_ids), ctx.max_model_len))


@dataclass
class _Held:
    """What a request holds until its answer is written: its lifetime slot in the engine (contract, "Execution
    behavior": requests in preparation and results not yet released count against capacity) and its media."""

    ctx: ServerContext
    request_id: str
    media: PromptMedia | None = None

    async def release(self) -> None:
        try:
            if self.media is not None:
                await self.media.release()
        finally:
            await self.ctx.engine.release(self.request_id)


async def generate(request: Request, spec: GenerationSpec) -> Response:
    """Run a validated request through the engine and answer it as JSON or as an SSE stream."""
    ctx: ServerContext = request.app.state.ctx
    trace = request.app.state.observer.begin(spec.shape, request.state.request_id)  # validated: measured
    held: _Held | None = None
    try:
        with trace.preparation():
            # the slot first (429 before any preparation); the admission deadline counts from here
            deadline = time.monotonic() + ctx.config.pending_timeout_ms / 1000.0
            await _engine_call(ctx.engine.reserve(spec.request_id))
            held = _Held(ctx, spec.request_id)
            await effective_max_model_len(ctx)  # once per router: the engine's pool may lower the ceiling
            media = held.media = await prepare_media(ctx, spec.conversation, hold=True, deadline=deadline)
            trace.media_prepared(media.batch.stats if media is not None else None)
            prompt, seconds = await asyncio.to_thread(_timed_build_prompt, ctx, spec.conversation, media)
            trace.prompt_built(seconds)
            decoder = ctx.frontend.output_decoder(spec.conversation, prompt)
            submitted = spec.engine_request(prompt)
            assert submitted.request_id == spec.request_id
            if media is not None:
                check_media_context(ctx, prompt)
                submitted.media = media_inputs(prompt, media)
            trace.submitting(submitted, prompt)
            events = trace.watch(await _engine_call(ctx.engine.open(submitted)))
    except BaseException:
        if held is not None:
            await held.release()
        raise
    generation = Generation(events, decoder, prompt, single_call=spec.single_call)
    renderer = spec.renderer(generation)
    if not spec.shape.stream:
        return await _aggregate(generation, renderer, trace, held)
    frames = _stream(generation, renderer, trace, held)
    # the stream's headers wait for admission, so a queue timeout is still an HTTP 503 (contract, "Execution
    # behavior"), not a failure frame after a 200
    opening = await anext(frames)
    return StreamingResponse(with_keepalive(prepended([opening], frames), ctx.keepalive_s),
                             media_type="text/event-stream", headers=SSE_HEADERS)


async def _engine_call(call):
    """Await an engine client call; its typed refusal becomes the protocol's error (overload 429, ...)."""
    try:
        return await call
    except EngineError as exc:
        raise from_engine_error(exc) from None


async def _aggregate(generation: Generation, renderer: OutputRenderer, trace: RequestTrace,
                     held: _Held) -> JSONResponse:
    with trace.generation():  # exactly one terminal record, whatever happens below
        try:
            async for _ in generation.steps():
                pass
        except EngineError as exc:  # e.g. the queue deadline passed before admission
            raise from_engine_error(exc) from None
        except GenerationFailed as exc:
            raise _engine_failure(exc) from None
        finally:
            try:
                await generation.events.aclose()  # the engine is done with the media now
            finally:
                await held.release()
        outcome = _recorded(generation, trace)
        return JSONResponse(await renderer.body(outcome))  # a failure now is a response failure


async def _stream(generation: Generation, renderer: OutputRenderer, trace: RequestTrace,
                  held: _Held) -> AsyncIterator[bytes]:
    """The SSE frames. Its first frame comes once the engine admitted the request; an engine refusal before
    that is raised as the protocol's error (the HTTP answer has not started), later ones are failure frames."""
    opened = False
    try:
        with trace.generation():  # a client that goes away mid-stream ends here as a cancellation
            try:
                await generation.admitted()
            except EngineError as exc:
                raise from_engine_error(exc) from None
            opened = True
            for frame in renderer.opening():
                yield frame
            async for steps in generation.steps():  # one write per engine event list
                frames = [frame for step in steps for frame in
                          (renderer.progress(step) if isinstance(step, ProgressEvent) else renderer.delta(step))]
                if frames:
                    yield b"".join(frames)
            outcome = _recorded(generation, trace)
            yield b"".join(await renderer.closing(outcome))  # a failure now is a response failure
    except EngineError as exc:  # after the stream opened, errors travel as the protocol's failure frames
        yield b"".join(renderer.failure(from_engine_error(exc)))
    except GenerationFailed as exc:
        yield b"".join(renderer.failure(_engine_failure(exc)))
    except ProtocolError as err:
        if not opened:
            raise
        yield b"".join(renderer.failure(err))
    finally:
        try:
            await generation.events.aclose()
        finally:
            await held.release()


def _recorded(generation: Generation, trace: RequestTrace) -> Outcome:
    """The outcome, written as the request's terminal: later send or storage failures are response failures."""
    outcome = generation.outcome
    assert outcome is not None
    trace.finish(outcome.decoded, fin=outcome.finish)
    return outcome


def _engine_failure(exc: GenerationFailed) -> ProtocolError:
    return ProtocolError(str(exc), code="engine_failure", status=500)
