"""Shared pieces of the Responses tests: a scripted Qwen artifact with the Responses scenarios.

It extends the server tests' scripts (ALPHA, WEATHER, COUNT, LONG) with a namespaced call, two
parallel calls, answer text before a call, and a reply that follows a tool result, and it carries
the maintained Qwen template, which keeps developer turns (top-level instructions) in place.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from server_fixtures import EOS, MODEL, OUTPUTS, THINKING_TAIL, VOCAB, start_server

from ninfer.artifact.container import Manifest, write_artifact

TEMPLATE = Path(__file__).resolve().parents[1] / "ninfer" / "chat" / "templates" / "qwen3_6_ninfer.jinja"


def _call(name: str, city: str) -> str:
    return f"<tool_call>\n<function={name}>\n<parameter=city>\n{city}\n</parameter>\n</function>\n</tool_call>"


# trigger text (the prompt ends with it, thinking on) -> (scripted output, ends with EOS)
SCRIPTS = {
    **{keyword + THINKING_TAIL: output for keyword, output in OUTPUTS.items()},
    "NSWEATHER" + THINKING_TAIL: ("A namespaced tool.\n</think>\n\n" + _call("weather__get_current", "Paris"), True),
    "TWOCALLS" + THINKING_TAIL: ("Two cities.\n</think>\n\n" + _call("get_weather", "Paris") + "\n"
                                 + _call("get_weather", "Rome"), True),
    "PREAMBLE" + THINKING_TAIL: ("Plan.\n</think>\n\nLet me check the weather for you.\n\n"
                                 + _call("get_weather", "Paris"), True),
    "SUNNY\n</tool_response>" + THINKING_TAIL: ("The tool answered.\n</think>\n\nIt is sunny in Paris.", True),
}

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
NAMESPACE = {"type": "namespace", "name": "weather", "description": "Weather service",
             "tools": [{"type": "function", "name": "get_current",
                        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]}


def responses_artifact(folder: Path, tokenizer) -> Path:
    from ninfer.artifact.qwen_tokenizer import build_qwen_tokenizer_json

    path = Path(folder) / "scripted-qwen-responses.ninfer"
    if not path.exists():
        scripts = [{"trigger": tokenizer.encode(trigger, allow_special=True),
                    "output": tokenizer.encode(text, allow_special=True) + ([EOS] if eos else [])}
                   for trigger, (text, eos) in SCRIPTS.items()]
        manifest = Manifest(name=MODEL, architecture="scripted",
                            components={"text": {"vocab_size": VOCAB, "eos": EOS, "scripts": scripts}},
                            extra={"eos_token_ids": [EOS, 248044]})
        write_artifact(path, {}, manifest, build_qwen_tokenizer_json(), TEMPLATE.read_text())
    return path


def responses_server(folder: Path, tokenizer, **options):
    return start_server(responses_artifact(folder, tokenizer), tokenizer, **options)


def sse_events(text: str) -> list[tuple[str, dict]]:
    """(event name, JSON payload) of every frame; asserts the `event:` + `data:` framing."""
    assert text.endswith("\n\n")
    out = []
    for frame in text.split("\n\n"):
        if not frame or frame.startswith(":"):
            continue
        lines = frame.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), frame
        out.append((lines[0][len("event: "):], json.loads(lines[1][len("data: "):])))
    return out


def post(server, path: str, payload, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, json=payload, timeout=30, **kwargs)


def test_every_scenario_has_a_distinct_trigger(qwen_tokenizer):
    triggers = [tuple(qwen_tokenizer.encode(t, allow_special=True)) for t in SCRIPTS]
    assert len(set(triggers)) == len(SCRIPTS) and all(triggers)
