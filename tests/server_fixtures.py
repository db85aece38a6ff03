"""Shared pieces of the server tests: a scripted Qwen artifact and a real HTTP server in a thread.

The scripted model answers a user message that is exactly one of the KEYWORDS below with a fixed
token sequence (reasoning, answer, tool call, long text), so the protocol tests are deterministic
while every layer (template, tokenizer, engine, decoder, HTTP) is real.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import torch
import uvicorn

from ninfer.artifact.container import Manifest, write_artifact
from ninfer.chat.thinking import thinking_control
from ninfer.config import ServerConfig
from ninfer.engine.engine import Engine
from ninfer.models.scripted import ScriptedModel
from ninfer.server.app import create_app
from ninfer.server.context import ServerContext, build_context
from ninfer.server.engine_client import LocalEngineClient
from ninfer.server.startup import engine_settings

MODEL = "scripted-qwen"
EOS = 248046  # <|im_end|>
VOCAB = 248320
TEMPLATE = Path(__file__).resolve().parents[1] / "ninfer" / "chat" / "templates" / "qwen3_6.jinja"
THINKING_TAIL = "<|im_end|>\n<|im_start|>assistant\n<think>\n"
LONG_WORDS = 3000

# keyword -> (scripted output, ends with EOS). Outputs are written with control tokens as text.
OUTPUTS = {
    "ALPHA": ("Two plus two is four.\n</think>\n\nThe answer is 4.", True),
    "WEATHER": ("The user wants the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
                "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>", True),
    "COUNT": ("Counting.\n</think>\n\none two three four five", True),
    "LONG": ("Thinking.\n</think>\n\n" + " word" * LONG_WORDS, False),
}

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def scripts_for(tokenizer) -> list[dict]:
    """Each keyword's trigger is the end of its rendered prompt (thinking on), so output starts at once."""
    scripts = []
    for keyword, (text, eos) in OUTPUTS.items():
        trigger = tokenizer.encode(keyword + THINKING_TAIL, allow_special=True)
        output = tokenizer.encode(text, allow_special=True) + ([EOS] if eos else [])
        scripts.append({"trigger": trigger, "output": output})
    return scripts


def scripted_artifact(folder: Path, tokenizer) -> Path:
    """The scripted Qwen artifact (the script is the model; its only tensors are a tiny vision tower),
    written once per session folder."""
    from ninfer.artifact.qwen_tokenizer import build_qwen_tokenizer_json

    path = Path(folder) / "scripted-qwen.ninfer"
    if not path.exists():
        from ninfer.artifact.presets import TINY_VISION_CONFIG
        from ninfer.models.vision import build_vision_tower

        # a tiny random vision tower too, so a server started with --vision loads one (the scripted model
        # never reads its embeddings: media tests through it check preparation and counting)
        vision = dict(TINY_VISION_CONFIG)
        tower = build_vision_tower(vision)
        tower.init_random_(0)
        tensors = {f"vision.{k}": v.contiguous() for k, v in tower.state_dict().items()}
        manifest = Manifest(name=MODEL, architecture="scripted",
                            components={"text": {"vocab_size": VOCAB, "eos": EOS, "scripts": scripts_for(tokenizer)},
                                        "vision": vision},
                            extra={"eos_token_ids": [EOS, 248044]})
        write_artifact(path, tensors, manifest, build_qwen_tokenizer_json(), TEMPLATE.read_text())
    return path


@lru_cache(maxsize=None)
def base_context(path: Path) -> ServerContext:
    """Frontend and metadata of the artifact, loaded once per session; servers swap in engine and config."""
    return build_context(ServerConfig(artifact=str(path)), engine=None)  # type: ignore[arg-type]


def scripted_engine(path: Path, tokenizer, cfg: ServerConfig) -> Engine:
    """The engine of a scripted artifact, sharing an already-loaded tokenizer (saves seconds per server)."""
    from ninfer.artifact.container import Artifact

    config = Artifact(path).config("text")
    settings = replace(engine_settings(cfg), eos_ids={EOS, 248044})
    return Engine(ScriptedModel(config), tokenizer, settings, dtype=torch.float32, thinking=thinking_control(tokenizer)).start()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    """create_app served by uvicorn on a real socket, in a background thread."""

    ctx: ServerContext
    engine: Engine | None = None
    port: int = 0

    def __post_init__(self):
        # bound here and handed to uvicorn, so a port picked by the kernel stays ours (xdist's two workers start
        # servers side by side; free_port's probe could race)
        sock = socket.socket()
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(create_app(self.ctx), host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("test server did not start")
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        if self.engine is not None:
            self.engine.shutdown()


def start_server(path: Path, tokenizer, *, keepalive_s: float = 5.0, **options) -> LiveServer:
    """A server with its own engine and options over the session's shared frontend."""
    cfg = ServerConfig(artifact=str(path), **{"max_context": 4096, "page_size": 16, "max_concurrency": 2, **options})
    engine = scripted_engine(path, tokenizer, cfg)
    base = base_context(path)
    ctx = replace(base, config=cfg, engine=LocalEngineClient(engine), keepalive_s=keepalive_s,
                  model_id=cfg.model_id or base.model_id, max_model_len=cfg.max_model_len)
    return LiveServer(ctx, engine)


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
