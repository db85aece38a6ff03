"""POST /v1/chat/completions: the OpenAI Chat edges of the generation pipeline (server.generation).

Lowering: the request's conversation and sampling; rendering: the chat.completion object, or
`data:` chunks ending in `[DONE]` with errors as an OpenAI error body in a data event.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from ninfer.chat import ir
from ninfer.engine.types import ProgressEvent
from ninfer.protocol.errors import ProtocolError, model_not_found
from ninfer.protocol.openai_chat import ChatRequest, parse_chat_request
from ninfer.protocol.openai_chat_output import ChunkWriter, Identity, aggregate
from ninfer.server.context import ServerContext
from ninfer.server.decoding import Outcome
from ninfer.server.generation import GenerationSpec, engine_request, generate
from ninfer.server.live_tally import LiveTally
from ninfer.server.observer import RequestShape
from ninfer.server.request_body import read_json
from ninfer.server.sse import DONE, data_event


async def chat_completions(request: Request):
    ctx: ServerContext = request.app.state.ctx
    chat = parse_chat_request(await read_json(request), ctx.chat_defaults)
    if chat.model != ctx.model_id:
        raise model_not_found(chat.model)
    identity = Identity(model=ctx.model_id)
    shape = RequestShape.of("openai_chat", chat.conversation, model=chat.model, stream=chat.stream,
                            max_tokens=chat.max_tokens)
    return await generate(request, GenerationSpec(
        shape, identity.id, chat.conversation,
        engine_request=lambda prompt: engine_request(identity.id, prompt, sampling=chat.sampling,
                                                     max_tokens=chat.max_tokens, stop=chat.stop),
        renderer=lambda generation: ChatRenderer(identity, chat, generation.tally)))


class ChatRenderer:
    """Chat Completions output: one chunk per decoder delta, in the contract's order."""

    def __init__(self, identity: Identity, chat: ChatRequest, tally: LiveTally):
        self.identity = identity
        self.chat = chat
        self.tally = tally  # what timings_per_token shows
        self.writer = ChunkWriter(identity, include_usage=chat.include_usage)

    async def body(self, outcome: Outcome) -> dict[str, Any]:
        return aggregate(self.identity, outcome.decoded, outcome.finish)

    def opening(self) -> list[bytes]:
        return [data_event(self.writer.role())]

    def progress(self, ev: ProgressEvent) -> list[bytes]:
        return [data_event(self.writer.progress(ev))] if self.chat.return_progress else []

    def delta(self, d: ir.OutputDelta) -> list[bytes]:
        payload = self.writer.delta(d, self.tally.timings() if self.chat.timings_per_token else None)
        return [] if payload is None else [data_event(payload)]

    async def closing(self, outcome: Outcome) -> list[bytes]:
        frames = [frame for d in outcome.tail for frame in self.delta(d)]
        return frames + [data_event(p) for p in self.writer.finish(outcome.decoded, outcome.finish)] + [DONE]

    def failure(self, err: ProtocolError) -> list[bytes]:
        return [data_event(err.openai_body())]
