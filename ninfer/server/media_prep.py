"""The router's media step: a conversation's images and videos prepared before its prompt is built.

    ir.media_parts(conversation) -> MediaClient.prepare (fetch, decode, resize, pack; cached by digest)
        -> frontend.build_prompt(conversation, media=batch.items)  placeholders expanded to pads
        -> media_inputs(prompt, ...)  what EngineRequest.media carries

A generation holds its payloads under a lease until the engine is done with them; token counting
needs only the grids and releases at once (hold=False). Media errors become the protocol's error,
naming the request field of the item that failed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ninfer.chat import ir
from ninfer.engine.types import MediaInput, QueueTimeoutError
from ninfer.media import MediaError, MediaItem, MediaTimeoutError, PreparedBatch, PreparedMedia
from ninfer.protocol.errors import ProtocolError, from_engine_error, from_media_error
from ninfer.server.context import ServerContext

_DEADLINE_SLACK_S = 0.05  # a media timeout this close to the admission deadline is that deadline's


def vision_disabled(param: str | None) -> ProtocolError:
    return ProtocolError("media input needs the server started with --vision", param=param, code="vision_disabled")


@dataclass
class PromptMedia:
    """A conversation's prepared media, in ir.media_parts order, and the lease that keeps them live."""

    parts: list[ir.ImagePart | ir.VideoPart]
    batch: PreparedBatch
    ctx: ServerContext

    @property
    def items(self) -> list[PreparedMedia]:
        return self.batch.items

    async def release(self) -> None:
        """Idempotent: the first call returns the lease, later ones do nothing."""
        lease, self.batch.lease = self.batch.lease, None
        if lease is not None and self.ctx.media is not None:
            await self.ctx.media.release(lease)


async def prepare_media(ctx: ServerContext, conversation: ir.Conversation, *, hold: bool,
                        deadline: float | None = None) -> PromptMedia | None:
    """Prepare every image and video of `conversation`; None when it has none.

    `deadline` (time.monotonic) is a generation's admission deadline: media spends the same wait as the
    engine's queue (contract, "Execution behavior"), and running out of it is the queue timeout."""
    parts = ir.media_parts(conversation.messages)
    if not parts:
        return None
    if ctx.media is None:  # the protocols refuse media without --vision; this covers any other way in
        raise vision_disabled(parts[0].param)
    items = [MediaItem(part.type, part.source) for part in parts]
    timeout_s = ctx.config.pending_timeout_ms / 1000 if deadline is None else deadline - time.monotonic()
    try:
        if timeout_s <= 0:
            raise MediaTimeoutError("no time was left for the media")
        batch = await ctx.media.prepare(items, timeout_s=timeout_s, hold=hold)
    except MediaTimeoutError as exc:
        if deadline is not None and time.monotonic() >= deadline - _DEADLINE_SLACK_S:
            raise from_engine_error(QueueTimeoutError(
                f"request was not admitted within {ctx.config.pending_timeout_ms} ms (media preparation)")) from None
        raise from_media_error(exc, [part.param for part in parts]) from None
    except MediaError as exc:
        raise from_media_error(exc, [part.param for part in parts]) from None
    return PromptMedia(parts, batch, ctx)


def media_inputs(prompt: ir.Prompt, media: PromptMedia) -> list[MediaInput]:
    """One MediaInput per prompt media item (placeholder order), from its pad runs and its payload."""
    at = {id(part): k for k, part in enumerate(media.parts)}
    runs: dict[int, list[ir.MediaSpan]] = {}
    for span in prompt.media_spans:
        runs.setdefault(span.item, []).append(span)
    inputs = []
    for k, part in enumerate(prompt.media):
        prepared = media.items[at[id(part)]]
        starts = [span.start for span in runs.get(k, [])]
        inputs.append(MediaInput(start=starts[0], num_tokens=prepared.num_tokens, grid_thw=prepared.grid_thw,
                                 kind=prepared.modality, digest=prepared.digest,
                                 pixel_values=prepared.pixel_values, group_starts=starts))
    return inputs
