"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic edges of the generation pipeline.

Lowering: the request's conversation, sampling and thinking budget; rendering: the message object,
or named SSE events in the block lifecycle with errors as an `error` event (server.generation runs
everything between). Clients such as Claude Code add a query string (`?beta=true`); routing is by
path, so it is ignored. Errors are ProtocolErrors like everywhere else; the edge renders them in
Anthropic's shape because of the path (server.middleware).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from ninfer.chat import ir
from ninfer.chat.ir import Prompt
from ninfer.chat.thinking import THINKING_GUIDANCE
from ninfer.engine.types import ProgressEvent
from ninfer.protocol.anthropic_errors import anthropic_error
from ninfer.protocol.anthropic_lowering import AnthropicDefaults, MessagesRequest, parse_messages_request
from ninfer.protocol.anthropic_output import Event, EventWriter, Identity, message_json
from ninfer.protocol.errors import ProtocolError
from ninfer.server.context import ServerContext
from ninfer.server.decoding import Outcome
from ninfer.server.generation import GenerationSpec, count_prompt_tokens, engine_request, generate
from ninfer.server.observer import RequestShape
from ninfer.server.request_body import read_json
from ninfer.server.sse import named_event

log = logging.getLogger("ninfer.server")


def _defaults(ctx: ServerContext) -> AnthropicDefaults:
    return AnthropicDefaults(vision=ctx.config.vision, default_max_tokens=ctx.config.default_max_tokens)


async def count_tokens(request: Request) -> JSONResponse:
    """The prompt a generation would see, tokenized; nothing reaches the engine."""
    ctx: ServerContext = request.app.state.ctx
    return JSONResponse({"input_tokens": await count_message_tokens(ctx, await read_json(request))})


async def count_message_tokens(ctx: ServerContext, body: Any) -> int:
    """count_tokens on a decoded body: also the Router deployment's handle method (notebooks)."""
    msg = parse_messages_request(body, _defaults(ctx), counting=True)
    return await count_prompt_tokens(ctx, msg.conversation)


async def create_message(request: Request):
    ctx: ServerContext = request.app.state.ctx
    request_id = request.state.request_id
    msg = parse_messages_request(await read_json(request), _defaults(ctx))
    identity = Identity(model=msg.model)
    shape = RequestShape.of("anthropic_messages", msg.conversation, model=msg.model, stream=msg.stream,
                            max_tokens=msg.max_tokens)

    def ask(prompt: Prompt):
        return engine_request(identity.id, prompt, sampling=msg.sampling, max_tokens=msg.max_tokens, stop=msg.stop,
                              thinking_budget=_thinking_budget(ctx, msg, prompt, request_id))

    return await generate(request, GenerationSpec(
        shape, identity.id, msg.conversation, engine_request=ask,
        renderer=lambda generation: MessagesRenderer(identity, msg, request_id)))


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
    """Tokens the engine commits to close thinking at the budget: the guidance text plus </think>."""
    tokenizer = ctx.frontend.tokenizer
    if id(tokenizer) not in _suffix_tokens:
        _suffix_tokens[id(tokenizer)] = len(tokenizer.encode(THINKING_GUIDANCE)) + 1
    return _suffix_tokens[id(tokenizer)]


class MessagesRenderer:
    """Anthropic output: message_start once admitted, one open content block at a time, then the stop."""

    def __init__(self, identity: Identity, msg: MessagesRequest, request_id: str):
        self.identity = identity
        self.sealed = msg.thinking.sealed
        self.request_id = request_id  # error events name it, as error bodies do
        self.writer = EventWriter(identity, sealed=self.sealed)

    async def body(self, outcome: Outcome) -> dict[str, Any]:
        return message_json(self.identity, outcome.decoded, outcome.finish, sealed=self.sealed)

    def opening(self) -> list[bytes]:
        return []  # message_start waits for admission, which tells the reused prefix

    def progress(self, ev: ProgressEvent) -> list[bytes]:
        return [] if self.writer.started else _frames(self.writer.start(ev.total, ev.cache))

    def delta(self, d: ir.OutputDelta) -> list[bytes]:
        return _frames(self.writer.delta(d))

    async def closing(self, outcome: Outcome) -> list[bytes]:
        fin = outcome.finish
        out: list[Event] = []
        if not self.writer.started:
            out = self.writer.start(fin.usage.prompt_tokens, fin.usage.cached_tokens)
        out += [e for d in outcome.tail for e in self.writer.delta(d)]
        return _frames(out + self.writer.finish(fin, bool(outcome.decoded.tool_calls)))

    def failure(self, err: ProtocolError) -> list[bytes]:
        return [named_event("error", anthropic_error(err, self.request_id)[1])]


def _frames(events: list[Event]) -> list[bytes]:
    return [named_event(name, payload) for name, payload in events]
