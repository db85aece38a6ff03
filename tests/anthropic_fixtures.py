"""A scripted-Qwen server for the Anthropic tests.

It serves ninfer's maintained Qwen template (inline system messages, prefill, truncated histories)
and adds scripts the shared fixtures lack: answers with thinking off, a prefill continuation, two
calls in one turn, a reply to tool results, and a parameter named `-n`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from server_fixtures import EOS, OUTPUTS, THINKING_TAIL, VOCAB, LiveServer, base_context, scripted_artifact

from ninfer.chat import frontend_for
from ninfer.chat.thinking import thinking_control
from ninfer.config import ServerConfig
from ninfer.engine.engine import Engine
from ninfer.models.scripted import ScriptedModel
from ninfer.server.engine_client import LocalEngineClient
from ninfer.server.startup import engine_settings

MODEL = "claude-local"  # any label: Anthropic requests do not select the artifact
MAINTAINED = Path(__file__).resolve().parents[1] / "ninfer" / "chat" / "templates" / "qwen3_6_ninfer.jinja"
NO_THINKING_TAIL = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
TWO_CALLS = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n"
             "<tool_call>\n<function=get_time>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>")

# (prompt tail that triggers the script, scripted output, ends with EOS); control tokens written as text
EXTRA_SCRIPTS = [
    ("ALPHA" + NO_THINKING_TAIL, "The answer is 4.", True),
    ("PREFILL" + NO_THINKING_TAIL + "The answer is", " 4, as always.", True),
    ("TWO_CALLS" + THINKING_TAIL, "Two lookups.\n</think>\n\nChecking both.\n\n" + TWO_CALLS, True),
    ("</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n", "Read them.\n</think>\n\nSunny at noon.", True),
    ("DASH" + THINKING_TAIL, "Run it.\n</think>\n\n<tool_call>\n<function=run>\n<parameter=-n>\n3\n</parameter>\n"
     "</function>\n</tool_call>", True),
]

WEATHER = {"name": "get_weather", "description": "Current weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def _scripts(tokenizer) -> list[dict]:
    entries = [(k + THINKING_TAIL, text, eos) for k, (text, eos) in OUTPUTS.items()] + EXTRA_SCRIPTS
    return [{"trigger": tokenizer.encode(trigger, allow_special=True),
             "output": tokenizer.encode(text, allow_special=True) + ([EOS] if eos else [])}
            for trigger, text, eos in entries]


def start_anthropic_server(artifacts_dir, tokenizer, *, keepalive_s: float = 5.0, **options) -> LiveServer:
    """A live server over the shared scripted artifact's frontend, with the maintained template and the
    extra scripts; `options` are ServerConfig fields."""
    path = scripted_artifact(artifacts_dir, tokenizer)
    cfg = ServerConfig(artifact=str(path), **{"max_context": 4096, "page_size": 16, "max_concurrency": 2, **options})
    base = base_context(path)
    frontend = frontend_for(base.frontend.tokenizer, MAINTAINED.read_text(), base.frontend.eos_token_ids)
    model = ScriptedModel({"vocab_size": VOCAB, "eos": EOS, "scripts": _scripts(tokenizer)})
    engine = Engine(model, tokenizer, replace(engine_settings(cfg), eos_ids={EOS, 248044}), dtype=torch.float32, thinking=thinking_control(tokenizer)).start()
    ctx = replace(base, config=cfg, engine=LocalEngineClient(engine), frontend=frontend, keepalive_s=keepalive_s,
                  max_model_len=cfg.max_model_len)
    return LiveServer(ctx, engine)
