"""The OpenAI Responses routes: create (JSON or semantic SSE) and input_tokens here, the stored-Response
resources in stored_responses, and the explicit refusal to compact.

Create follows Chat Completions' path: request -> Item history (stored parent + input) -> IR
conversation -> prompt -> engine -> output decoder, then Response Items. A stored Response is
put in the ResponseStore before its terminal event, so a client that reads it back finds it.

Like the other generation endpoints, create is observed (server.observer): the request is measured
once its conversation is resolved (the stored parent found, the Items valid), the prompt build and
engine submission are its preparation, and the engine's outcome is its one terminal record, written
before the Response is stored, so a storage or transport failure after it is only a response failure.
input_tokens and the stored-Response resources are not measured.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ninfer.chat import ir
from ninfer.chat.errors import PromptError
from ninfer.engine.types import EngineError, EngineRequest
from ninfer.protocol.errors import ProtocolError, from_engine_error, from_prompt_error, unsupported
from ninfer.protocol.openai_responses import (
    ResponsesCreate,
    ResponsesPrompt,
    parse_create_request,
    parse_input_tokens_request,
)
from ninfer.protocol.responses_events import ResponseEvents
from ninfer.protocol.responses_items import Item, ItemRules, parse_items
from ninfer.protocol.responses_output import (
    OutputIds,
    ResponseFrame,
    history_items,
    output_items,
    response_status,
    usage_json,
)
from ninfer.server.chat_completions import checkpoints, model_not_found, read_json
from ninfer.server.context import ServerContext
from ninfer.server.observer import RequestShape, RequestTrace
from ninfer.server.responses_generation import Generation, GenerationFailed, Outcome
from ninfer.server.sse import SSE_HEADERS, named_event, with_keepalive
from ninfer.server.stored_responses import (
    cancel_response,
    delete_response,
    list_input_items,
    response_not_found,
    retrieve_response,
)
from ninfer.store import (
    Continuation,
    LocalResponseStore,
    NewResponse,
    PutResult,
    ResponseStore,
    ResponseStoreClient,
)

log = logging.getLogger("ninfer.server")

MIB = 1024 * 1024


def add_responses_routes(app: FastAPI, store: ResponseStoreClient | None = None) -> None:
    """Register the routes; without a store client (the in-process app) the store lives in this process."""
    cfg = app.state.ctx.config
    app.state.response_store = store or LocalResponseStore(
        ResponseStore(cfg.response_store_max_records, cfg.response_store_max_mib * MIB))
    app.add_api_route("/v1/responses", create_response, methods=["POST"])
    app.add_api_route("/v1/responses/input_tokens", count_input_tokens, methods=["POST"])
    app.add_api_route("/v1/responses/compact", compact_response, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", retrieve_response, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", delete_response, methods=["DELETE"])
    app.add_api_route("/v1/responses/{response_id}/input_items", list_input_items, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"])


# ---- create --------------------------------------------------------------------------------------


async def create_response(request: Request):
    ctx: ServerContext = request.app.state.ctx
    store: ResponseStoreClient = request.app.state.response_store
    create = parse_create_request(await read_json(request), ctx.chat_defaults)
    parent, conversation = await _resolve(ctx, store, create.prompt)
    shape = RequestShape.of("openai_responses", conversation, model=create.prompt.model, stream=create.stream,
                            max_tokens=create.max_output_tokens,
                            semantic_change=_branches_thinking(create.prompt, parent))
    trace = request.app.state.observer.begin(shape, request.state.request_id)  # validation passed: measured
    frame = ResponseFrame(create.echo)
    # A stored root starts a session its children inherit; a store:false child reads but keeps no endpoint.
    session_key = parent.session_key if parent else (f"responses:{frame.id}" if create.store else None)
    with trace.preparation():
        prompt = await asyncio.to_thread(_build_prompt, ctx, conversation)  # template + tokenizer off the loop
        decoder = ctx.frontend.output_decoder(conversation, prompt)
        engine_request = EngineRequest(request_id=frame.id, prompt_ids=list(prompt.token_ids),
                                       sampling=create.sampling, max_tokens=create.max_output_tokens,
                                       thinking=prompt.thinking,
                                       return_progress=True,  # the first progress event marks admission
                                       checkpoints=checkpoints(prompt), session_key=session_key,
                                       retain_endpoint=create.store or parent is None)
        trace.submitting(engine_request, prompt)
        try:
            events = trace.watch(await ctx.engine.open(engine_request))
        except EngineError as exc:
            raise from_engine_error(exc) from None
    pending = _PendingResponse(create, frame, OutputIds(), parent, session_key, prompt.preserve_thinking, store,
                               request.state.request_id)
    generation = Generation(events, decoder, prompt_tokens=len(prompt.token_ids), single_call=create.single_call)
    if not create.stream:
        return JSONResponse(await _aggregate(generation, pending, trace))
    frames = with_keepalive(_stream(generation, pending, trace), ctx.keepalive_s)
    return StreamingResponse(frames, media_type="text/event-stream", headers=SSE_HEADERS)


def _branches_thinking(request: ResponsesPrompt, parent: Continuation | None) -> bool:
    """A child that explicitly chooses another preserve_thinking than its parent's: a new semantic branch."""
    if parent is None or not request.chooses_preserve_thinking:
        return False
    options = request.options
    chosen = options.preserve_thinking
    if chosen is None:
        chosen = options.template_kwargs.get("preserve_thinking")
    return chosen != parent.preserve_thinking


async def _resolve(ctx: ServerContext, store: ResponseStoreClient,
                   request: ResponsesPrompt) -> tuple[Continuation | None, ir.Conversation]:
    """The stored parent and the conversation it continues into: the last of create's validation."""
    if request.model != ctx.model_id:
        raise model_not_found(request.model)
    parent = None
    history: list[Item] = []
    if request.previous_response_id is not None:
        parent = await store.continuation(request.previous_response_id)
        if parent is None:
            raise response_not_found(request.previous_response_id, "previous_response_id")
        history = parse_items(parent.history, {"previous_response_id": parent.history},
                              ItemRules(ctx.chat_defaults.vision), ("previous_response_id",), unique_ids=False)
    return parent, request.conversation(history, parent.preserve_thinking if parent else None)


def _build_prompt(ctx: ServerContext, conversation: ir.Conversation) -> ir.Prompt:
    try:
        return ctx.frontend.build_prompt(conversation)
    except PromptError as exc:
        raise from_prompt_error(exc) from None


@dataclass
class _PendingResponse:
    """What finishing a Response needs: its identity, the request, and where it is stored."""

    create: ResponsesCreate
    frame: ResponseFrame
    ids: OutputIds
    parent: Continuation | None
    session_key: str | None
    preserve_thinking: bool | None  # the value the template saw, inherited by children
    store: ResponseStoreClient
    request_id: str

    async def finish(self, outcome: Outcome) -> dict[str, Any]:
        """The terminal Response, stored when asked; a Response too large to store is an error."""
        status = response_status(outcome.reason)
        output = output_items(outcome.decoded, status, self.ids, sealed=self.create.seal_reasoning)
        response = self.frame.object(status, output, usage_json(outcome.usage))
        log.debug("%s responses %s: %d output items, store %s", self.request_id, status, len(output),
                  self.create.store)
        if self.create.store:
            await self._store(response, output)
        return response

    async def _store(self, response: dict[str, Any], output: list[dict[str, Any]]) -> None:
        assert self.session_key is not None
        new = NewResponse(id=self.frame.id, response=response,
                          input_items=[item.wire for item in self.create.prompt.items],
                          output_items=history_items(output), session_key=self.session_key,
                          preserve_thinking=self.preserve_thinking, parent_id=self.create.prompt.previous_response_id)
        result = await self.store.put(new)
        if result is PutResult.PARENT_GONE:  # the parent left the store while this Response generated
            assert self.parent is not None
            new.parent_history = self.parent.history
            result = await self.store.put(new)
        if result is PutResult.TOO_LARGE:
            raise ProtocolError("this Response with its conversation exceeds the response store capacity "
                                "(--response-store-max-mib / --response-store-max-records); send store:false or "
                                "raise the limit", param="store", code="response_store_capacity_exceeded")


async def _aggregate(generation: Generation, pending: _PendingResponse, trace: RequestTrace) -> dict[str, Any]:
    with trace.generation():  # exactly one terminal record, whatever happens below
        try:
            async for _ in generation.deltas():
                pass
        except EngineError as exc:  # e.g. the queue deadline passed before admission
            raise from_engine_error(exc) from None
        except GenerationFailed as exc:
            raise ProtocolError(str(exc), code="engine_failure", status=500) from None
        finally:
            await generation.events.aclose()
        assert generation.outcome is not None
        trace.finish(generation.outcome.decoded, fin=generation.outcome.finish)
        return await pending.finish(generation.outcome)  # a storage failure now is a response failure


async def _stream(generation: Generation, pending: _PendingResponse, trace: RequestTrace) -> AsyncIterator[bytes]:
    writer = ResponseEvents(pending.frame, pending.ids, sealed=pending.create.seal_reasoning)
    try:
        with trace.generation():  # a client that goes away mid-stream ends here as a cancellation
            for event in writer.start():
                yield _frame(event)
            async for delta in generation.deltas():
                for event in writer.delta(delta):
                    yield _frame(event)
            assert generation.outcome is not None
            # final: a later storage or send failure is a response failure
            trace.finish(generation.outcome.decoded, fin=generation.outcome.finish)
            response = await pending.finish(generation.outcome)
            for event in writer.finish(response):
                yield _frame(event)
    except EngineError as exc:  # after the stream started, failures end it with response.failed
        err = from_engine_error(exc)
        yield _frame(writer.failed(err.code, err.message))
    except GenerationFailed as exc:
        yield _frame(writer.failed("engine_failure", str(exc)))
    except ProtocolError as err:
        yield _frame(writer.failed(err.code, err.message))
    finally:
        await generation.events.aclose()


def _frame(event: dict[str, Any]) -> bytes:
    return named_event(event["type"], event)


# ---- input_tokens ------------------------------------------------------------------------------


async def count_input_tokens(request: Request) -> JSONResponse:
    """The prompt token count of the same request sent to create, without generating."""
    ctx: ServerContext = request.app.state.ctx
    prompt_request = parse_input_tokens_request(await read_json(request), ctx.chat_defaults)
    _, conversation = await _resolve(ctx, request.app.state.response_store, prompt_request)
    prompt = await asyncio.to_thread(_build_prompt, ctx, conversation)  # not a generation: not measured
    return JSONResponse({"object": "response.input_tokens", "input_tokens": len(prompt.token_ids)})


async def compact_response(request: Request):
    raise unsupported("input", "compaction_not_supported", "server-side compaction is not available")
