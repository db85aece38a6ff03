"""POST /v1/messages and /v1/messages/count_tokens: Anthropic request -> IR -> prompt -> engine -> Anthropic shapes.

Clients such as Claude Code add a query string (`?beta=true`); routing is by path, so it is ignored.
Errors are ProtocolErrors like everywhere else; the edge renders them in Anthropic's shape because
of the path (server.middleware).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ninfer.chat.errors import PromptError
from ninfer.chat.ir import Conversation, Prompt
from ninfer.engine.types import (
    EngineError,
    EngineRequest,
    FinishEvent,
    FinishReason,
    ProgressEvent,
    TokenEvent,
)
from ninfer.protocol.anthropic_errors import anthropic_error
from ninfer.protocol.anthropic_lowering import AnthropicDefaults, MessagesRequest, parse_messages_request
from ninfer.protocol.anthropic_output import Event, EventWriter, Identity, message_json
from ninfer.protocol.errors import ProtocolError, from_engine_error, from_prompt_error
from ninfer.server.chat_completions import checkpoints, read_json
from ninfer.server.context import ServerContext
from ninfer.server.engine_client import decode_to_finish
from ninfer.server.observer import RequestShape, RequestTrace
from ninfer.server.sse import SSE_HEADERS, named_event, with_keepalive

log = logging.getLogger("ninfer.server")


def _defaults(ctx: ServerContext) -> AnthropicDefaults:
    return AnthropicDefaults(vision=ctx.config.vision, default_max_tokens=ctx.config.default_max_tokens)


def _build_prompt(ctx: ServerContext, conversation: Conversation) -> Prompt:
    try:
        return ctx.frontend.build_prompt(conversation)
    except PromptError as exc:  # the conversation cannot become a prompt: the client must change it
        raise from_prompt_error(exc) from None


async def count_tokens(request: Request) -> JSONResponse:
    """The prompt a generation would see, tokenized; nothing reaches the engine."""
    ctx: ServerContext = request.app.state.ctx
    msg = parse_messages_request(await read_json(request), _defaults(ctx), counting=True)
    prompt = await asyncio.to_thread(_build_prompt, ctx, msg.conversation)
    return JSONResponse({"input_tokens": len(prompt.token_ids)})


async def create_message(request: Request):
    ctx: ServerContext = request.app.state.ctx
    request_id = request.state.request_id
    msg = parse_messages_request(await read_json(request), _defaults(ctx))
    shape = RequestShape.of("anthropic_messages", msg.conversation, model=msg.model, stream=msg.stream,
                            max_tokens=msg.max_tokens)
    trace = request.app.state.observer.begin(shape, request_id)  # validation passed: a measured request
    identity = Identity(model=msg.model)
    with trace.preparation():
        prompt = await asyncio.to_thread(_build_prompt, ctx, msg.conversation)  # template + tokenizer off the loop
        decoder = ctx.frontend.output_decoder(msg.conversation, prompt)
        # The engine id is the message id: unique even when a client reuses its request id.
        engine_request = EngineRequest(request_id=identity.id, prompt_ids=list(prompt.token_ids),
                                       sampling=msg.sampling, max_tokens=msg.max_tokens, stop=msg.stop,
                                       thinking=prompt.thinking,
                                       thinking_budget=_thinking_budget(ctx, msg, prompt, request_id),
                                       return_progress=True,  # the first progress event marks admission
                                       checkpoints=checkpoints(prompt))
        trace.submitting(engine_request, prompt)
        try:
            events = trace.watch(await ctx.engine.open(engine_request))
        except EngineError as exc:
            raise from_engine_error(exc) from None
    if not msg.stream:
        return await _aggregate(events, decoder, identity, msg, trace)
    writer = EventWriter(identity, sealed=msg.thinking.sealed)
    frames = with_keepalive(_stream(events, decoder, writer, trace), ctx.keepalive_s)
    return StreamingResponse(frames, media_type="text/event-stream", headers=SSE_HEADERS)


def _thinking_budget(ctx: ServerContext, msg: MessagesRequest, prompt: Prompt, request_id: str) -> int | None:
    """budget_tokens for the engine, lowered just enough when the output room past it cannot hold the
    close guidance, the close marker and one more token (Claude Code's default: 31999 of 32000).

    max_tokens stays the hard limit; only the point where thinking is closed moves.
    """
    budget = msg.thinking.budget
    if budget is None or not prompt.thinking:
        return budget
    max_tokens = msg.max_tokens if msg.max_tokens is not None else ctx.config.default_max_tokens
    room = min(max_tokens, ctx.max_model_len - len(prompt.token_ids))
    needed = _close_suffix_tokens(ctx) + 1
    if budget < room < budget + needed:
        fitted = room - needed
        log.info("%s messages: thinking budget %d lowered to %d so the close guidance fits in %d output tokens",
                 request_id, budget, fitted, room)
        return fitted
    return budget


_suffix_tokens: dict[int, int] = {}


def _close_suffix_tokens(ctx: ServerContext) -> int:
    """Tokens the engine commits to close thinking at the budget: its guidance text plus </think>."""
    tokenizer = ctx.frontend.tokenizer
    if id(tokenizer) not in _suffix_tokens:
        from ninfer.engine.engine import THINKING_GUIDANCE  # the engine's own text; imported only when needed

        _suffix_tokens[id(tokenizer)] = len(tokenizer.encode(THINKING_GUIDANCE)) + 1
    return _suffix_tokens[id(tokenizer)]


async def _aggregate(events: AsyncIterator[Any], decoder, identity: Identity, msg: MessagesRequest,
                     trace: RequestTrace) -> JSONResponse:
    with trace.generation():  # exactly one terminal record, whatever happens below
        fin = await decode_to_finish(events, decoder)
        if fin is None or fin.reason is FinishReason.ERROR:
            raise _engine_failure(fin)
        _, decoded = decoder.finish()
        trace.finish(decoded)
        return JSONResponse(message_json(identity, decoded, fin, sealed=msg.thinking.sealed))


async def _stream(events: AsyncIterator[Any], decoder, writer: EventWriter,
                  trace: RequestTrace) -> AsyncIterator[bytes]:
    with trace.generation():  # a client that goes away mid-stream ends here as a cancellation
        try:
            async for ev in events:
                out: list[Event] = []
                if isinstance(ev, ProgressEvent):
                    if not writer.started:
                        out = writer.start(ev.total, ev.cache)
                elif isinstance(ev, TokenEvent):
                    out = [e for d in decoder.feed(ev.text, ev.channel) for e in writer.delta(d)] if ev.text else []
                elif isinstance(ev, FinishEvent):
                    if ev.reason is FinishReason.ERROR:
                        yield _error_frame(_engine_failure(ev), trace.http_id)
                        return
                    if not writer.started:
                        out = writer.start(ev.usage.prompt_tokens, ev.usage.cached_tokens)
                    tail, decoded = decoder.finish()
                    trace.finish(decoded)  # the outcome is final; later send failures are transport failures
                    out += [e for d in tail for e in writer.delta(d)] + writer.finish(ev, bool(decoded.tool_calls))
                if out:
                    yield _frames(out)
        except EngineError as exc:  # after the stream opened, errors travel as an SSE error event
            yield _error_frame(from_engine_error(exc), trace.http_id)
        finally:
            await events.aclose()


def _frames(events: list[Event]) -> bytes:
    return b"".join(named_event(name, payload) for name, payload in events)


def _error_frame(err: ProtocolError, request_id: str) -> bytes:
    return named_event("error", anthropic_error(err, request_id)[1])


def _engine_failure(fin: FinishEvent | None) -> ProtocolError:
    return ProtocolError(f"generation failed in the engine: {fin and fin.error}", code="engine_failure", status=500)
