"""Everything a router needs to answer requests, built once per router (process or Ray replica)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ninfer.config import ServerConfig
from ninfer.protocol.openai_chat import ChatDefaults
from ninfer.server.engine_client import EngineClient

if TYPE_CHECKING:  # media/ pulls in torch, pillow and PyAV: only a --vision router needs them
    from ninfer.server.media_client import MediaClient


@dataclass
class ServerContext:
    config: ServerConfig
    model_id: str  # the public OpenAI model alias
    max_model_len: int  # effective per-request context: min(max_context, kv capacity)
    frontend: Any  # ninfer.chat frontend: build_prompt / output_decoder
    engine: EngineClient
    chat_defaults: ChatDefaults
    media: MediaClient | None = None  # set with --vision: where images and videos are prepared
    keepalive_s: float = 5.0
    created: int = field(default_factory=lambda: int(time.time()))
    capacity_resolved: bool = False  # max_model_len includes the engine's resolved pool (--kv-capacity auto)


async def effective_max_model_len(ctx: ServerContext) -> int:
    """The per-request ceiling. With --kv-capacity auto the engine sizes its pool from free device memory at
    startup, which the router cannot know from its options: it asks the engine once, and a pool smaller than
    --max-context lowers the ceiling from then on (/v1/models, output room, media prompts)."""
    if ctx.config.kv_capacity == "auto" and not ctx.capacity_resolved:
        tokens = (await ctx.engine.snapshot()).get("kv_capacity_tokens")
        if tokens:
            ctx.max_model_len = min(ctx.config.max_context, int(tokens))
            ctx.capacity_resolved = True
    return ctx.max_model_len


def build_context(cfg: ServerConfig, engine: EngineClient, *, keepalive_s: float = 5.0,
                  media: MediaClient | None = None) -> ServerContext:
    """Read the artifact's metadata (not its weights) and build the chat frontend for this router.

    With --vision and no `media` client (the in-process app), a MediaPreprocessor runs in this process.

    --chat-template FILE replaces the artifact's template (an unreadable file fails at startup);
    --no-thinking / --preserve-thinking become the frontend's defaults, which requests override.
    """
    from ninfer.artifact.container import Artifact
    from ninfer.chat import ServerPromptDefaults, frontend_for, load_chat_template
    from ninfer.tokenizer import Tokenizer

    artifact = Artifact(cfg.artifact)
    template = load_chat_template(cfg.chat_template) if cfg.chat_template else artifact.chat_template
    tokenizer = Tokenizer.from_json_str(artifact.tokenizer_json)
    defaults = ServerPromptDefaults(enable_thinking=False if cfg.no_thinking else None,
                                    preserve_thinking=True if cfg.preserve_thinking else None)
    eos_ids = list(artifact.manifest.extra.get("eos_token_ids", []))
    frontend = frontend_for(tokenizer, template, eos_ids, defaults=defaults)
    if cfg.vision and media is None:
        media = local_media(cfg)
    return ServerContext(config=cfg, model_id=cfg.model_id or artifact.public_name,
                         max_model_len=cfg.max_model_len, frontend=frontend, engine=engine,
                         chat_defaults=ChatDefaults(vision=cfg.vision), media=media if cfg.vision else None,
                         keepalive_s=keepalive_s)


def local_media(cfg: ServerConfig, limits=None) -> MediaClient:
    """A MediaPreprocessor in this process with the --media-* options (`limits`: ninfer.media.MediaLimits)."""
    from ninfer.media import MediaPreprocessor
    from ninfer.server.media_client import LocalMediaClient

    return LocalMediaClient(MediaPreprocessor(cfg.media_cache_mib, cfg.media_live_mib, cfg.media_preprocess_threads,
                                              limits=limits))
