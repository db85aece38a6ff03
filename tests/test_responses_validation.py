"""Malformed and unsupported Responses requests: each gets its status, error code and param.

From the contract's create-field table and Item contract: unknown top-level fields fail with
unknown_parameter, recognized features this server cannot honour fail naming their field, Item
errors name the Item path, neutral values and client hints pass, and nothing is answered with 500.
"""

from __future__ import annotations

import httpx
import pytest
from server_fixtures import MODEL
from test_responses_support import NAMESPACE, WEATHER, post, responses_server

FN = {"type": "function", "name": "f"}
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
CALL2 = {**CALL, "call_id": "call_2"}
RESULT = {"type": "function_call_output", "call_id": "call_1", "output": "SUNNY"}
RESULT2 = {**RESULT, "call_id": "call_2"}
USER = {"role": "user", "content": "ALPHA"}
REASONING = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]}
ANSWER = {"role": "assistant", "content": "ok"}


def part(p, role="user"):
    return {"input": [{"role": role, "content": [p, {"type": "input_text", "text": "ALPHA"}]}]}


def items(*values):
    return {"input": [USER, *values]}


def allowed(mode="auto", *entries):
    return {"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": mode, "tools": list(entries)}}


IMAGE = {"type": "input_image", "image_url": "https://example.com/a.png"}

# (name, request fields replacing the base request's, status, code, param)
CASES = [
    ("body not an object", [], 400, "invalid_type", None),
    ("unknown top-level field", {"frequency_penalty": 1}, 400, "unknown_parameter", "frequency_penalty"),
    ("chat messages field", {"messages": [USER]}, 400, "unknown_parameter", "messages"),
    ("missing model", {"model": None}, 400, "missing_required_parameter", "model"),
    ("unknown model", {"model": "gpt-4o"}, 404, "model_not_found", "model"),
    ("missing input", {"input": None}, 400, "missing_required_parameter", "input"),
    ("input not a string or array", {"input": 5}, 400, "invalid_type", "input"),
    ("Item not an object", {"input": ["hi"]}, 400, "invalid_type", "input[0]"),
    ("Item without type or role", {"input": [{"content": "x"}]}, 400, "missing_required_parameter", "input[0].type"),
    ("unknown Item type", {"input": [{"type": "item_reference", "id": "x"}]}, 400, "item_type_not_supported",
     "input[0].type"),
    ("tool role message", {"input": [{"role": "tool", "content": "x"}]}, 400, "unsupported_role", "input[0].role"),
    ("unknown content part", part({"type": "hologram"}), 400, "modality_not_supported", "input[0].content[0]"),
    ("file input", part({"type": "input_file", "file_id": "f"}), 400, "file_inputs_not_supported",
     "input[0].content[0].type"),
    ("audio input", part({"type": "input_audio"}), 400, "audio_inputs_not_supported", "input[0].content[0].type"),
    ("image without --vision", part(IMAGE), 400, "vision_disabled", "input[0].content[0]"),
    ("image file id", part({"type": "input_image", "file_id": "f"}), 400, "file_inputs_not_supported",
     "input[0].content[0].file_id"),
    ("image detail high", part({**IMAGE, "detail": "high"}), 400, "image_detail_not_supported",
     "input[0].content[0].detail"),
    ("output_text on a user message", part({"type": "output_text", "text": "x"}), 400, "invalid_value",
     "input[0].content[0].type"),
    ("text part without text", part({"type": "input_text"}), 400, "missing_required_parameter",
     "input[0].content[0].text"),
    ("summary without raw reasoning", items({"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]}),
     400, "reasoning_content_not_supported", "input[1].content"),
    ("damaged sealed reasoning", items({"type": "reasoning", "summary": [], "encrypted_content": "gAAAA-opaque"}),
     400, "invalid_encrypted_content", "input[1].encrypted_content"),
    ("arguments not a JSON object", items({**CALL, "arguments": "[1]"}), 400, "invalid_value", "input[1].arguments"),
    ("call without call_id", items({k: v for k, v in CALL.items() if k != "call_id"}), 400,
     "missing_required_parameter", "input[1].call_id"),
    ("partial call", items({**CALL, "status": "in_progress"}), 400, "partial_tool_call_not_supported",
     "input[1].status"),
    ("call made by a program", items({**CALL, "caller": {"type": "program", "caller_id": "x"}}), 400,
     "tool_relationship_not_supported", "input[1].caller"),
    ("message after a call in one turn", items(CALL, ANSWER, RESULT), 400, "invalid_assistant_history", "input[2]"),
    ("reasoning after message content", items(ANSWER, REASONING), 400, "invalid_assistant_history", "input[2]"),
    ("result without a call", items(RESULT), 400, "invalid_tool_history", "input[1].call_id"),
    ("result after a user turn", items(CALL, USER, RESULT), 400, "invalid_tool_history", "input[3].call_id"),
    ("two results for one call", items(CALL, RESULT, RESULT), 400, "invalid_tool_history", "input[3].call_id"),
    ("result names another function", items(CALL, {**RESULT, "name": "get_time"}), 400, "invalid_tool_history",
     "input[2].name"),
    ("result namespace without name", items(CALL, {**RESULT, "namespace": "weather"}), 400, "invalid_tool_history",
     "input[2].namespace"),
    ("results skip the first call", items(CALL, CALL2, RESULT2), 400, "invalid_tool_history", "input[1]"),
    ("call id used twice", items(CALL, RESULT, {**CALL, "id": "fc_x"}), 400, "invalid_tool_history",
     "input[3].call_id"),
    ("duplicate Item ids", {"input": [{**USER, "id": "msg_1"}, {**USER, "id": "msg_1"}]}, 400, "duplicate_item_id",
     "input[1].id"),
    ("empty result array", items(CALL, {**RESULT, "output": []}), 400, "invalid_value", "input[2].output"),
    ("only a developer message", {"input": [{"role": "developer", "content": "x"}]}, 400, "invalid_value", "input"),
    ("hosted tool", {"tools": [WEATHER, {"type": "web_search"}]}, 400, "tool_type_not_supported", "tools[1].type"),
    ("custom tool", {"tools": [{"type": "custom", "name": "apply_patch"}]}, 400, "tool_type_not_supported",
     "tools[0].type"),
    ("custom tool in a namespace", {"tools": [{**NAMESPACE, "tools": [{"type": "custom", "name": "x"}]}]}, 400,
     "tool_type_not_supported", "tools[0].tools[0].type"),
    ("strict tool", {"tools": [{**FN, "strict": True}]}, 400, "strict_tools_not_supported", "tools[0].strict"),
    ("deferred tool", {"tools": [{**FN, "defer_loading": True}]}, 400, "deferred_tools_not_supported",
     "tools[0].defer_loading"),
    ("tool that excludes direct calls", {"tools": [{**FN, "allowed_callers": ["programmatic"]}]}, 400,
     "tool_caller_not_supported", "tools[0].allowed_callers"),
    ("tool output schema", {"tools": [{**FN, "output_schema": {"type": "string"}}]}, 400,
     "tool_output_schema_not_supported", "tools[0].output_schema"),
    ("bad tool name", {"tools": [{**FN, "name": "get weather"}]}, 400, "invalid_value", "tools[0].name"),
    ("tool declared twice", {"tools": [FN, FN]}, 400, "duplicate_tool_name", "tools[1]"),
    ("required tool choice", {"tools": [WEATHER], "tool_choice": "required"}, 400, "tool_choice_not_supported",
     "tool_choice"),
    ("named tool choice", {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}, 400,
     "tool_choice_not_supported", "tool_choice"),
    ("allowed_tools required", allowed("required", {"type": "function", "name": "get_weather"}), 400,
     "tool_choice_not_supported", "tool_choice.mode"),
    ("allowed_tools undeclared", allowed("auto", {"type": "function", "name": "nope"}), 400, "invalid_tool_choice",
     "tool_choice.tools[0]"),
    ("structured output", {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, 400,
     "structured_outputs_not_supported", "text.format"),
    ("low verbosity", {"text": {"verbosity": "low"}}, 400, "verbosity_not_supported", "text.verbosity"),
    ("truncation auto", {"truncation": "auto"}, 400, "truncation_not_supported", "truncation"),
    ("top_logprobs", {"top_logprobs": 3}, 400, "logprobs_not_supported", "top_logprobs"),
    ("flex service tier", {"service_tier": "flex"}, 400, "service_tier_not_supported", "service_tier"),
    ("background", {"background": True}, 400, "background_not_supported", "background"),
    ("other include", {"include": ["reasoning.encrypted_content", "file_search_call.results"]}, 400,
     "include_not_supported", "include[1]"),
    ("conversation", {"conversation": "conv_1"}, 400, "conversations_not_supported", "conversation"),
    ("prompt template", {"prompt": {"id": "pmpt_1"}}, 400, "prompt_templates_not_supported", "prompt"),
    ("context management", {"context_management": [{"type": "compaction"}]}, 400, "context_management_not_supported",
     "context_management"),
    ("negative max_output_tokens", {"max_output_tokens": -1}, 400, "invalid_value", "max_output_tokens"),
    ("temperature above 2", {"temperature": 2.5}, 400, "invalid_value", "temperature"),
    ("top_p above 1", {"top_p": 1.5}, 400, "invalid_value", "top_p"),
    ("stream as text", {"stream": "yes"}, 400, "invalid_type", "stream"),
    ("obfuscation flag as text", {"stream_options": {"include_obfuscation": "no"}}, 400, "invalid_type",
     "stream_options.include_obfuscation"),
    ("seventeen metadata pairs", {"metadata": {str(i): "v" for i in range(17)}}, 400, "invalid_value", "metadata"),
    ("long metadata value", {"metadata": {"k": "v" * 513}}, 400, "invalid_value", "metadata.k"),
    ("metadata value not a string", {"metadata": {"k": 1}}, 400, "invalid_type", "metadata.k"),
    ("client_metadata not an object", {"client_metadata": "x"}, 400, "invalid_type", "client_metadata"),
    ("unknown reasoning effort", {"reasoning": {"effort": "huge"}}, 400, "invalid_value", "reasoning.effort"),
    ("unknown reasoning summary", {"reasoning": {"summary": "long"}}, 400, "invalid_value", "reasoning.summary"),
    ("preserve_thinking aliases disagree", {"preserve_thinking": True,
                                            "chat_template_kwargs": {"preserve_thinking": False}}, 400,
     "conflicting_template_option", "preserve_thinking"),
    # the Responses field names the conflict, not Chat's reasoning_effort
    ("effort disagrees with kwargs", {"reasoning": {"effort": "high"}, "chat_template_kwargs": {"reasoning_effort": "low"}},
     400, "conflicting_template_option", "reasoning.effort"),
    ("effort none with thinking on", {"reasoning": {"effort": "none"}, "chat_template_kwargs": {"enable_thinking": True}},
     400, "conflicting_template_option", "reasoning.effort"),
    ("kwargs override the server", {"chat_template_kwargs": {"add_generation_prompt": False}}, 400,
     "chat_template_option_not_supported", "chat_template_kwargs.add_generation_prompt"),
    ("bad cache breakpoint", part({"type": "input_text", "text": "x", "prompt_cache_breakpoint": {"mode": "auto"}}),
     400, "invalid_cache_breakpoint", "input[0].content[0].prompt_cache_breakpoint"),
    ("long prompt_cache_key", {"prompt_cache_key": "k" * 65}, 400, "invalid_value", "prompt_cache_key"),
    ("unknown previous response", {"previous_response_id": "resp_nope"}, 404, "response_not_found",
     "previous_response_id"),
    ("prompt beyond max_context", {"input": "word " * 5000}, 400, "context_length_exceeded", None),
]

NEUTRAL = {
    "client_metadata": {"x-codex-turn-metadata": "t" * 2000, "session": {"id": 1}}, "prompt_cache_key": "conv-1",
    "prompt_cache_retention": "in_memory", "prompt_cache_options": {"mode": "implicit"}, "safety_identifier": "s1",
    "user": "u1", "service_tier": "auto", "metadata": {"k": "v"}, "max_tool_calls": 3, "top_logprobs": 0,
    "truncation": "disabled", "text": {"format": {"type": "text"}, "verbosity": "medium"},
    "include": ["reasoning.encrypted_content"], "stream_options": {"include_obfuscation": False},
    "reasoning": {"effort": "high", "summary": "detailed"}, "background": False, "parallel_tool_calls": False,
    "tools": [WEATHER], "tool_choice": "none", "store": False, "temperature": 0.7, "top_p": 0.9,
    "chat_template_kwargs": {"enable_thinking": True}, "instructions": "Be brief.",
}


@pytest.fixture(scope="module")
def server(artifacts_dir, qwen_tokenizer):
    live = responses_server(artifacts_dir, qwen_tokenizer)
    yield live
    live.stop()


def request_with(fields):
    if isinstance(fields, list):
        return fields
    base = {"model": MODEL, "input": "ALPHA", "max_output_tokens": 20}
    base.update(fields)
    return {k: v for k, v in base.items() if v is not None}


def test_the_table_is_large_enough():
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name,fields,status,code,param", CASES, ids=[c[0] for c in CASES])
def test_rejected(server, name, fields, status, code, param):
    r = post(server, "/v1/responses", request_with(fields))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error
    assert error["type"] == "invalid_request_error" and error["message"]
    assert r.headers["x-request-id"].startswith("req_")


def test_neutral_values_and_client_hints_are_accepted(server):
    r = post(server, "/v1/responses", request_with(NEUTRAL), headers={"session-id": "s", "x-codex-beta": "1"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["output"][-1]["content"][0]["text"] == "The answer is 4."
    assert body["reasoning"] == {"effort": "high", "summary": "detailed"} and body["max_tool_calls"] == 3
    assert body["output"][0]["summary"] == [] and body["output"][0]["encrypted_content"]


def test_input_tokens_takes_only_prompt_fields(server):
    r = post(server, "/v1/responses/input_tokens", {"model": MODEL, "input": "ALPHA", "stream": True})
    assert r.status_code == 400 and (r.json()["error"]["code"], r.json()["error"]["param"]) == (
        "unknown_parameter", "stream")
    r = post(server, "/v1/responses/input_tokens", {"model": MODEL, "input": "ALPHA", "personality": "friendly"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "personality_not_supported"
    r = post(server, "/v1/responses/input_tokens", {"model": MODEL, "input": "ALPHA", "parallel_tool_calls": False,
                                                   "tools": [WEATHER], "reasoning": {"effort": "low"}})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0


def test_resource_endpoints_refuse_what_they_cannot_do(server):
    url = server.url + "/v1/responses"
    stored = post(server, "/v1/responses", {"model": MODEL, "input": "ALPHA"}).json()["id"]
    cases = [
        ("GET", f"/{stored}?stream=true", 400, "stream_recovery_not_supported"),
        ("GET", f"/{stored}?include[]=reasoning.encrypted_content", 400, "include_not_supported"),
        ("GET", f"/{stored}/input_items?limit=0", 400, "invalid_value"),
        ("GET", f"/{stored}/input_items?limit=101", 400, "invalid_value"),
        ("GET", f"/{stored}/input_items?limit=many", 400, "invalid_type"),
        ("GET", f"/{stored}/input_items?order=up", 400, "invalid_value"),
        ("GET", f"/{stored}/input_items?after=msg_nope", 400, "invalid_value"),
        ("POST", f"/{stored}/cancel", 400, "background_not_supported"),
        ("POST", "/compact", 400, "compaction_not_supported"),
        ("GET", "/resp_nope", 404, "response_not_found"),
        ("GET", "/resp_nope/input_items", 404, "response_not_found"),
        ("DELETE", "/resp_nope", 404, "response_not_found"),
        ("POST", "/resp_nope/cancel", 404, "response_not_found"),
    ]
    for method, path, status, code in cases:
        r = httpx.request(method, url + path, timeout=10)
        assert (r.status_code, r.json()["error"]["code"]) == (status, code), (method, path, r.text)
    r = httpx.delete(f"{url}/{stored}", timeout=10)
    assert r.json() == {"id": stored, "object": "response.deleted", "deleted": True}


def test_models_tolerate_client_query_strings(server):
    r = httpx.get(server.url + "/v1/models?client_version=0.50.0", timeout=10)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
