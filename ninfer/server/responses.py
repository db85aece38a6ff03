"""The OpenAI Responses routes: create (JSON or semantic SSE) and input_tokens here, the stored-Response
resources in stored_responses, and the explicit refusal to compact.

Create supplies the Responses edges of the generation pipeline (server.generation): lowering is the
Item history (stored parent + input) resolved into an IR conversation; rendering is the Response
object or its semantic SSE events. A stored Response is put in the ResponseStore before its
terminal event, so a client that reads it back finds it.

The request is measured once its conversation is resolved (the stored parent found, the Items
valid); the engine's outcome is its one terminal record, written before the Response is stored, so
a storage or transport failure after it is only a response failure. input_tokens and the
stored-Response resources are not measured.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ninfer.chat import ir
from ninfer.engine.types import ProgressEvent
from ninfer.protocol.errors import ProtocolError, model_not_found, unsupported
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
from ninfer.server.context import ServerContext
from ninfer.server.decoding import Generation, Outcome
from ninfer.server.generation import GenerationSpec, count_prompt_tokens, engine_request, generate
from ninfer.server.observer import RequestShape
from ninfer.server.request_body import read_json
from ninfer.server.sse import named_event
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
    frame = ResponseFrame(create.echo)
    # A stored root starts a session its children inherit; a store:false child reads but keeps no endpoint.
    session_key = parent.session_key if parent else (f"responses:{frame.id}" if create.store else None)

    def ask(prompt: ir.Prompt):
        return engine_request(frame.id, prompt, sampling=create.sampling, max_tokens=create.max_output_tokens,
                              session_key=session_key, retain_endpoint=create.store or parent is None)

    def renderer(generation: Generation) -> ResponsesRenderer:
        return ResponsesRenderer(_PendingResponse(create, frame, OutputIds(), parent, session_key,
                                                  generation.prompt.preserve_thinking, store,
                                                  request.state.request_id))

    return await generate(request, GenerationSpec(shape, frame.id, conversation, engine_request=ask, renderer=renderer,
                                                  single_call=create.single_call))


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


class ResponsesRenderer:
    """Responses output: the semantic events of a streamed Response around its stored terminal object."""

    def __init__(self, pending: _PendingResponse):
        self.pending = pending
        self.writer = ResponseEvents(pending.frame, pending.ids, sealed=pending.create.seal_reasoning)

    async def body(self, outcome: Outcome) -> dict[str, Any]:
        return await self.pending.finish(outcome)

    def opening(self) -> list[bytes]:
        return [_frame(event) for event in self.writer.start()]

    def progress(self, ev: ProgressEvent) -> list[bytes]:
        return []

    def delta(self, d: ir.OutputDelta) -> list[bytes]:
        return [_frame(event) for event in self.writer.delta(d)]

    async def closing(self, outcome: Outcome) -> list[bytes]:
        response = await self.pending.finish(outcome)
        return [_frame(event) for event in self.writer.finish(response)]

    def failure(self, err: ProtocolError) -> list[bytes]:
        return [_frame(self.writer.failed(err.code, err.message))]


def _frame(event: dict[str, Any]) -> bytes:
    return named_event(event["type"], event)


# ---- input_tokens ------------------------------------------------------------------------------


async def count_input_tokens(request: Request) -> JSONResponse:
    """The prompt token count of the same request sent to create, without generating."""
    ctx: ServerContext = request.app.state.ctx
    prompt_request = parse_input_tokens_request(await read_json(request), ctx.chat_defaults)
    _, conversation = await _resolve(ctx, request.app.state.response_store, prompt_request)
    count = await count_prompt_tokens(ctx, conversation)  # not a generation: not measured
    return JSONResponse({"object": "response.input_tokens", "input_tokens": count})


async def compact_response(request: Request):
    raise unsupported("input", "compaction_not_supported", "server-side compaction is not available")
