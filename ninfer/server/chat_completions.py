"""POST /v1/chat/completions: request -> conversation IR -> prompt -> engine -> decoder -> OpenAI shapes."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ninfer.chat.errors import PromptError
from ninfer.engine.types import (
    EngineError,
    EngineRequest,
    FinishEvent,
    FinishReason,
    ProgressEvent,
    TokenEvent,
)
from ninfer.protocol.errors import ProtocolError, from_engine_error, from_prompt_error
from ninfer.protocol.openai_chat import ChatRequest, parse_chat_request
from ninfer.protocol.openai_chat_output import ChunkWriter, Identity, aggregate, new_call_id
from ninfer.server.context import ServerContext
from ninfer.server.engine_client import decode_to_finish
from ninfer.server.observer import RequestShape, RequestTrace
from ninfer.server.sse import DONE, SSE_HEADERS, data_event, with_keepalive


async def read_json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"the request body is not valid JSON ({exc})", code="invalid_json") from None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def model_not_found(model: str) -> ProtocolError:
    return ProtocolError(f"model {model!r} not found", param="model", code="model_not_found", status=404)


async def chat_completions(request: Request):
    ctx: ServerContext = request.app.state.ctx
    request_id = request.state.request_id
    chat = parse_chat_request(await read_json(request), ctx.chat_defaults)
    if chat.model != ctx.model_id:
        raise model_not_found(chat.model)
    shape = RequestShape.of("openai_chat", chat.conversation, model=chat.model, stream=chat.stream,
                            max_tokens=chat.max_tokens)
    trace = request.app.state.observer.begin(shape, request_id)  # validation passed: a measured request
    identity = Identity(model=ctx.model_id)
    with trace.preparation():
        prompt = await asyncio.to_thread(_build_prompt, ctx, chat)  # template + tokenizer: keep the loop free
        decoder = ctx.frontend.output_decoder(chat.conversation, prompt)
        # The engine id is the completion id: unique even when a client reuses its x-request-id (Serve adopts it).
        engine_request = EngineRequest(request_id=identity.id, prompt_ids=list(prompt.token_ids),
                                       sampling=chat.sampling, max_tokens=chat.max_tokens, stop=chat.stop,
                                       thinking=prompt.thinking,
                                       return_progress=True,  # the first progress event marks admission
                                       checkpoints=checkpoints(prompt))
        trace.submitting(engine_request, prompt)
        try:
            events = trace.watch(await ctx.engine.open(engine_request))
        except EngineError as exc:
            raise from_engine_error(exc) from None
    if not chat.stream:
        return await _aggregate(events, decoder, identity, trace)
    frames = with_keepalive(_stream(events, decoder, identity, chat, trace), ctx.keepalive_s)
    return StreamingResponse(frames, media_type="text/event-stream", headers=SSE_HEADERS)


def checkpoints(prompt) -> list[int]:
    """Prompt boundaries worth retaining for reuse: the input boundary and the cache-hint candidates."""
    marks = set(prompt.cache_candidates)
    if prompt.input_boundary is not None:
        marks.add(prompt.input_boundary)
    return sorted(marks)


def _build_prompt(ctx: ServerContext, chat: ChatRequest):
    try:
        return ctx.frontend.build_prompt(chat.conversation)
    except PromptError as exc:  # the conversation cannot become a prompt: the client must change it
        raise from_prompt_error(exc) from None


async def _aggregate(events: AsyncIterator[Any], decoder, identity: Identity, trace: RequestTrace) -> JSONResponse:
    with trace.generation():  # exactly one terminal record, whatever happens below
        fin = await decode_to_finish(events, decoder)
        if fin is None or fin.reason is FinishReason.ERROR:
            raise ProtocolError(f"generation failed in the engine: {fin and fin.error}", code="engine_failure",
                                status=500)
        _, decoded = decoder.finish()
        for call in decoded.tool_calls:
            call.call_id = call.call_id or new_call_id()
        trace.finish(decoded)
        return JSONResponse(aggregate(identity, decoded, fin))


async def _stream(events: AsyncIterator[Any], decoder, identity: Identity, chat: ChatRequest,
                  trace: RequestTrace) -> AsyncIterator[bytes]:
    writer = ChunkWriter(identity, include_usage=chat.include_usage, timings_per_token=chat.timings_per_token)
    with trace.generation():  # a client that goes away mid-stream ends here as a cancellation
        try:
            yield data_event(writer.role())
            async for ev in events:
                writer.live.observe(ev)
                if isinstance(ev, ProgressEvent):
                    if chat.return_progress:
                        yield data_event(writer.progress(ev))
                elif isinstance(ev, TokenEvent):
                    for frame in _frames(writer, decoder.feed(ev.text, ev.channel) if ev.text else []):
                        yield frame
                elif isinstance(ev, FinishEvent):
                    if ev.reason is FinishReason.ERROR:
                        err = ProtocolError(f"generation failed in the engine: {ev.error}", code="engine_failure",
                                            status=500)
                        yield data_event(err.openai_body())
                        return
                    tail, decoded = decoder.finish()
                    trace.finish(decoded)  # the outcome is final; later send failures are transport failures
                    for frame in _frames(writer, tail):
                        yield frame
                    for payload in writer.finish(decoded, ev):
                        yield data_event(payload)
                    yield DONE
        except EngineError as exc:  # after the stream opened, errors travel as an SSE error event
            yield data_event(from_engine_error(exc).openai_body())
        finally:
            await events.aclose()


def _frames(writer: ChunkWriter, deltas) -> list[bytes]:
    out = []
    for d in deltas:
        if d.tool_call_start is not None and not d.tool_call_start.call_id:
            d.tool_call_start.call_id = new_call_id()
        payload = writer.delta(d)
        if payload is not None:
            out.append(data_event(payload))
    return out

