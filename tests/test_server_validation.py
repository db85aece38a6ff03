"""Malformed and unsupported Chat Completions requests: each gets its status, error code and param.

Taken from the contract's "OpenAI Chat Completions" section: capability rejections name the field,
malformed values are field-specific 400s, neutral values and unknown fields pass, and no client
mistake is ever answered with a 500.
"""

from __future__ import annotations

import httpx
import pytest
from server_fixtures import MODEL, WEATHER_TOOL, scripted_artifact, start_server

from ninfer.chat import ir
from ninfer.protocol.openai_chat import ChatDefaults, parse_chat_request

USER = {"role": "user", "content": "ALPHA"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


def msgs(*extra):
    return {"messages": [*extra, USER]}


def part(p):
    return {"messages": [{"role": "user", "content": [p, {"type": "text", "text": "ALPHA"}]}]}


IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}

# (name, request fields replacing the base request's, status, code, param)
CASES = [
    ("body not an object", [], 400, "invalid_type", None),
    ("missing model", {"model": None}, 400, "missing_required_parameter", "model"),
    ("empty model", {"model": ""}, 400, "invalid_value", "model"),
    ("model not a string", {"model": 5}, 400, "invalid_type", "model"),
    ("unknown model", {"model": "gpt-4o"}, 404, "model_not_found", "model"),
    ("missing messages", {"messages": None}, 400, "missing_required_parameter", "messages"),
    ("empty messages", {"messages": []}, 400, "invalid_value", "messages"),
    ("messages not an array", {"messages": "hi"}, 400, "invalid_type", "messages"),
    ("message without role", {"messages": [{"content": "x"}]}, 400, "missing_required_parameter", "messages[0].role"),
    ("unknown role", {"messages": [{"role": "bot", "content": "x"}]}, 400, "unsupported_role", "messages[0]"),
    ("content not string or array", {"messages": [{"role": "user", "content": 5}]}, 400, "invalid_type",
     "messages[0].content"),
    ("text part without string text", part({"type": "text", "text": 3}), 400, "invalid_type",
     "messages[0].content[0].text"),
    ("unknown part type", part({"type": "hologram"}), 400, "invalid_value", "messages[0].content[0]"),
    ("audio input", part({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}), 400,
     "modality_not_supported", "messages[0].content[0].type"),
    ("file input", part({"type": "file", "file": {"file_id": "f"}}), 400, "modality_not_supported",
     "messages[0].content[0].type"),
    ("image without --vision", part(IMAGE), 400, "vision_disabled", "messages[0].content[0]"),
    ("video without --vision", part({"type": "video_url", "video_url": "https://example.com/v.mp4"}), 400,
     "vision_disabled", "messages[0].content[0]"),
    ("image detail high", part({"type": "image_url", "image_url": {"url": "https://e.com/a.png", "detail": "high"}}),
     400, "image_detail_not_supported", "messages[0].content[0].image_url.detail"),
    ("image url scheme", part({"type": "image_url", "image_url": "ftp://e.com/a.png"}), 400, "invalid_media",
     "messages[0].content[0]"),
    ("image on a system message", {"messages": [{"role": "system", "content": [IMAGE]}, USER]}, 400,
     "modality_not_supported", "messages[0].content[0].type"),
    ("refusal part on a user message", part({"type": "refusal", "refusal": "no"}), 400, "invalid_value",
     "messages[0].content[0].type"),
    ("participant name", {"messages": [{"role": "user", "content": "ALPHA", "name": "bob"}]}, 400,
     "message_name_not_supported", "messages[0].name"),
    ("tool name not a string", msgs({"role": "assistant", "tool_calls": [CALL]},
                                    {"role": "tool", "tool_call_id": "call_1", "content": "x", "name": 5}), 400,
     "invalid_type", "messages[1].name"),
    ("tool result without call id", msgs({"role": "tool", "content": "x"}), 400, "missing_required_parameter",
     "messages[0].tool_call_id"),
    # tool results are matched to the calls of the assistant message they follow, as Responses' Items are
    ("logit_bias key not a token id", {"logit_bias": {"abc": 0}}, 400, "invalid_value", "logit_bias"),
    ("logit_bias key negative", {"logit_bias": {"-1": 0}}, 400, "invalid_value", "logit_bias"),
    ("logit_bias value out of range", {"logit_bias": {"5": 101}}, 400, "invalid_value", "logit_bias"),
    ("tool result after no call", {"messages": [USER, {"role": "tool", "tool_call_id": "call_1", "content": "x"}]},
     400, "invalid_tool_history", "messages[1].tool_call_id"),
    ("tool result answering no call", msgs({"role": "assistant", "tool_calls": [CALL]},
                                           {"role": "tool", "tool_call_id": "zzz", "content": "x"}), 400,
     "invalid_tool_history", "messages[1].tool_call_id"),
    ("two results for one call", msgs({"role": "assistant", "tool_calls": [CALL]},
                                      {"role": "tool", "tool_call_id": "call_1", "content": "a"},
                                      {"role": "tool", "tool_call_id": "call_1", "content": "b"}), 400,
     "invalid_tool_history", "messages[2].tool_call_id"),
    ("a later call answered, an earlier not", msgs({"role": "assistant", "tool_calls": [CALL, {**CALL, "id": "c2"}]},
                                                   {"role": "tool", "tool_call_id": "c2", "content": "b"}), 400,
     "invalid_tool_history", "messages[0]"),
    ("one call id twice in a message", msgs({"role": "assistant", "tool_calls": [CALL, CALL]}), 400,
     "invalid_tool_history", "messages[0].tool_calls"),
    ("tool_calls on a user message", {"messages": [{**USER, "tool_calls": [CALL]}]}, 400, "invalid_value",
     "messages[0]"),
    ("assistant audio history", msgs({"role": "assistant", "audio": {"id": "a1"}}), 400,
     "assistant_history_not_supported", "messages[0].audio"),
    ("conflicting reasoning aliases", msgs({"role": "assistant", "content": "x", "reasoning_content": "a",
                                            "reasoning": "b"}), 400, "conflicting_template_option",
     "messages[0].reasoning"),
    ("non-function tool call history", msgs({"role": "assistant", "tool_calls": [{**CALL, "type": "custom"}]}), 400,
     "tool_type_not_supported", "messages[0].tool_calls[0].type"),
    ("tool call history without id", msgs({"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{}"}}]}), 400, "missing_required_parameter", "messages[0].tool_calls[0].id"),
    ("negative max_tokens", {"max_tokens": -1}, 400, "invalid_value", "max_tokens"),
    ("max_completion_tokens as text", {"max_completion_tokens": "5"}, 400, "invalid_type", "max_completion_tokens"),
    ("temperature above 2", {"temperature": 3}, 400, "invalid_value", "temperature"),
    ("temperature as text", {"temperature": "hot"}, 400, "invalid_type", "temperature"),
    ("top_p above 1", {"top_p": 1.5}, 400, "invalid_value", "top_p"),
    ("top_k above 20", {"top_k": 21}, 400, "invalid_value", "top_k"),
    ("negative min_p", {"min_p": -0.1}, 400, "invalid_value", "min_p"),
    ("fractional seed", {"seed": 1.5}, 400, "invalid_type", "seed"),
    ("seed past a signed 64-bit integer", {"seed": 2**63}, 400, "invalid_value", "seed"),
    ("seed below a signed 64-bit integer", {"seed": -(2**63) - 1}, 400, "invalid_value", "seed"),
    ("stream as text", {"stream": "yes"}, 400, "invalid_type", "stream"),
    ("include_usage as text", {"stream": True, "stream_options": {"include_usage": "x"}}, 400, "invalid_type",
     "stream_options.include_usage"),
    ("two completions", {"n": 2}, 400, "n_not_supported", "n"),
    ("five stop strings", {"stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_value", "stop"),
    ("empty stop string", {"stop": ["a", ""]}, 400, "invalid_value", "stop[1]"),
    ("logprobs", {"logprobs": True}, 400, "logprobs_not_supported", "logprobs"),
    ("top_logprobs", {"top_logprobs": 3}, 400, "logprobs_not_supported", "top_logprobs"),
    ("nonzero logit_bias", {"logit_bias": {"50": 5}}, 400, "logit_bias_not_supported", "logit_bias"),
    ("json mode", {"response_format": {"type": "json_object"}}, 400, "response_format_not_supported",
     "response_format"),
    ("json schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, 400,
     "response_format_not_supported", "response_format"),
    ("audio output", {"modalities": ["text", "audio"]}, 400, "modality_not_supported", "modalities"),
    ("web search", {"web_search_options": {}}, 400, "web_search_not_supported", "web_search_options"),
    ("moderation", {"moderation": {"model": "omni"}}, 400, "moderation_not_supported", "moderation"),
    ("low verbosity", {"verbosity": "low"}, 400, "verbosity_not_supported", "verbosity"),
    ("unknown verbosity", {"verbosity": "loud"}, 400, "invalid_value", "verbosity"),
    ("stored completion", {"store": True}, 400, "store_not_supported", "store"),
    ("legacy functions", {"functions": [{"name": "f"}]}, 400, "legacy_tools_not_supported", "functions"),
    ("named legacy function_call", {"function_call": {"name": "f"}}, 400, "legacy_tools_not_supported",
     "function_call"),
    ("strict tool", {"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]}, 400,
     "strict_tools_not_supported", "tools[0].function.strict"),
    ("hosted tool", {"tools": [{"type": "web_search"}]}, 400, "tool_type_not_supported", "tools[0].type"),
    ("bad tool name", {"tools": [{"type": "function", "function": {"name": "get weather"}}]}, 400, "invalid_value",
     "tools[0].function.name"),
    ("required tool choice", {"tools": [WEATHER_TOOL], "tool_choice": "required"}, 400, "tool_choice_not_supported",
     "tool_choice"),
    ("named tool choice", {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {
        "name": "get_weather"}}}, 400, "tool_choice_not_supported", "tool_choice"),
    ("allowed_tools required", {"tools": [WEATHER_TOOL], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": []}}}, 400, "tool_choice_not_supported", "tool_choice.allowed_tools.mode"),
    ("allowed_tools undeclared", {"tools": [WEATHER_TOOL], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": {"name": "nope"}}]}}}, 400, "invalid_value",
     "tool_choice.allowed_tools.tools[0]"),
    ("single call with tools", {"tools": [WEATHER_TOOL], "parallel_tool_calls": False}, 400,
     "parallel_tool_calls_not_supported", "parallel_tool_calls"),
    ("grammar", {"grammar": "root ::= \"x\""}, 400, "constrained_decoding_not_supported", "grammar"),
    ("guided_json", {"guided_json": {"type": "object"}}, 400, "constrained_decoding_not_supported", "guided_json"),
    ("structured_outputs", {"structured_outputs": {"regex": "a+"}}, 400, "constrained_decoding_not_supported",
     "structured_outputs"),
    ("repetition penalty", {"repetition_penalty": 1.1}, 400, "repetition_penalty_not_supported",
     "repetition_penalty"),
    ("media processor override", {"mm_processor_kwargs": {"fps": 2}}, 400, "mm_processor_kwargs_not_supported",
     "mm_processor_kwargs"),
    ("unknown reasoning effort", {"reasoning_effort": "huge"}, 400, "invalid_value", "reasoning_effort"),
    ("thinking aliases disagree", {"enable_thinking": True, "chat_template_kwargs": {"enable_thinking": False}}, 400,
     "conflicting_template_option", "enable_thinking"),
    ("effort none with thinking on", {"reasoning_effort": "none", "enable_thinking": True}, 400,
     "conflicting_template_option", "reasoning_effort"),
    ("kwargs override the server", {"chat_template_kwargs": {"add_generation_prompt": False}}, 400,
     "chat_template_option_not_supported", "chat_template_kwargs.add_generation_prompt"),
    ("bad cache breakpoint", part({"type": "text", "text": "x", "prompt_cache_breakpoint": {"mode": "auto"}}), 400,
     "invalid_cache_breakpoint", "messages[0].content[0].prompt_cache_breakpoint"),
    ("long prompt_cache_key", {"prompt_cache_key": "k" * 65}, 400, "invalid_value", "prompt_cache_key"),
    ("unknown cache retention", {"prompt_cache_retention": "forever"}, 400, "invalid_value",
     "prompt_cache_retention"),
    ("metadata value not a string", {"metadata": {"a": 1}}, 400, "invalid_type", "metadata.a"),
    ("prompt beyond max_context", {"messages": [{"role": "user", "content": "word " * 5000}]}, 400,
     "context_length_exceeded", None),
]

NEUTRAL = {
    "logit_bias": {"50": 0}, "logprobs": False, "top_logprobs": 0, "verbosity": "medium", "functions": [],
    "function_call": "none", "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text"],
    "prediction": {"type": "content", "content": "x"}, "metadata": {"k": "v"}, "user": "u1", "service_tier": "auto",
    "safety_identifier": "s1", "prompt_cache_key": "conv-1", "prompt_cache_retention": "in_memory",
    "prompt_cache_options": {"mode": "implicit"}, "repetition_penalty": 1, "mm_processor_kwargs": {"fps": None},
    "grammar": "", "response_format": {"type": "text"}, "n": 1, "reasoning_effort": "auto", "seed": -7, "top_k": 0,
    "parallel_tool_calls": False, "store": False, "some_future_field": {"x": 1},
}


@pytest.fixture(scope="module")
def server(artifacts_dir, qwen_tokenizer):
    live = start_server(scripted_artifact(artifacts_dir, qwen_tokenizer), qwen_tokenizer)
    yield live
    live.stop()


def post(server, payload):
    return httpx.post(server.url + "/v1/chat/completions", json=payload, timeout=30)


def request_with(fields):
    if isinstance(fields, list):
        return fields
    base = {"model": MODEL, "messages": [USER], "max_tokens": 20}
    base.update(fields)
    return {k: v for k, v in base.items() if v is not None}


def test_the_table_is_large_enough():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name,fields,status,code,param", CASES, ids=[c[0] for c in CASES])
def test_rejected(server, name, fields, status, code, param):
    r = post(server, request_with(fields))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error
    assert error["type"] == "invalid_request_error" and error["message"]
    assert r.headers["x-request-id"].startswith("req_")


def test_neutral_values_and_unknown_fields_are_accepted(server):
    r = post(server, request_with(NEUTRAL))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "The answer is 4."


def test_single_call_is_fine_when_no_tool_is_callable(server):
    r = post(server, request_with({"tools": [WEATHER_TOOL], "tool_choice": "none", "parallel_tool_calls": False}))
    assert r.status_code == 200, r.text


def test_malformed_json_is_a_400(server):
    for raw in (b"{", b'{"model": NaN}', b"\xff\xfe"):
        r = httpx.post(server.url + "/v1/chat/completions", content=raw, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def tool_results_as_lowered(messages: list[dict]) -> list[str]:
    conversation = parse_chat_request({"model": MODEL, "messages": messages}, ChatDefaults()).conversation
    return [p.call_id for m in conversation.messages for p in m.parts if isinstance(p, ir.ToolResultPart)]


def test_tool_results_are_put_in_call_order():
    """The Qwen prompt shows results without ids, paired with calls by position: results sent out of order are
    matched by tool_call_id and rendered in the order of the calls (as Responses' Items are, Input Item contract)."""
    calls = [CALL, {**CALL, "id": "c2"}, {**CALL, "id": "c3"}]
    messages = [USER, {"role": "assistant", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c2", "content": "b"},
                {"role": "tool", "tool_call_id": "call_1", "content": "a"}, USER]
    assert tool_results_as_lowered(messages) == ["call_1", "c2"]  # c3 unanswered, after the answered ones


def test_a_history_may_begin_with_tool_results():
    """A truncated or imported history (the contract keeps one for Anthropic Messages) starts with results whose
    calls were cut away: they stand as sent, after the system prompt."""
    messages = [{"role": "system", "content": "s"}, {"role": "tool", "tool_call_id": "gone2", "content": "b"},
                {"role": "tool", "tool_call_id": "gone1", "content": "a"}, USER]
    assert tool_results_as_lowered(messages) == ["gone2", "gone1"]
