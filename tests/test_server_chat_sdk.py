"""Chat Completions through the official `openai` SDK against a real HTTP server (no Ray).

The scripted model makes every answer deterministic: reasoning then answer, a tool call, plain text.
"""

from __future__ import annotations

import json

import openai
import pytest
from server_fixtures import MODEL, WEATHER_TOOL, scripted_artifact, start_server


@pytest.fixture(scope="module")
def server(artifacts_dir, qwen_tokenizer):
    live = start_server(scripted_artifact(artifacts_dir, qwen_tokenizer), qwen_tokenizer)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def ask(client, keyword: str, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": keyword}], **kwargs)


def test_aggregate_splits_reasoning_from_content_with_usage_and_timings(client):
    resp = ask(client, "ALPHA", max_tokens=100)
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and resp.model == MODEL and resp.id.startswith("chatcmpl-")
    assert choice.message.content == "The answer is 4."
    assert choice.message.model_extra["reasoning_content"].strip() == "Two plus two is four."
    assert choice.message.refusal is None and choice.logprobs is None
    assert choice.finish_reason == "stop"
    usage = resp.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < usage.completion_tokens_details.reasoning_tokens < usage.completion_tokens
    timings = resp.model_extra["timings"]
    assert timings["cache_n"] + timings["prompt_n"] == usage.prompt_tokens
    assert timings["predicted_n"] == usage.completion_tokens


def test_stream_with_include_usage(client):
    chunks = list(ask(client, "ALPHA", max_tokens=100, stream=True, stream_options={"include_usage": True}))
    first, finish, last = chunks[0], chunks[-2], chunks[-1]
    assert first.choices[0].delta.role == "assistant"
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert reasoning.strip() == "Two plus two is four." and content == "The answer is 4."
    assert finish.choices[0].finish_reason == "stop"
    assert last.choices == [] and last.usage.completion_tokens > 0
    assert "timings" in last.model_extra and "timings" not in finish.model_extra
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_tool_call_aggregate_and_stream(client):
    resp = ask(client, "WEATHER", tools=[WEATHER_TOOL], max_tokens=200)
    call = resp.choices[0].message.tool_calls[0]
    assert resp.choices[0].finish_reason == "tool_calls"
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert resp.choices[0].message.content is None

    with client.chat.completions.stream(model=MODEL, messages=[{"role": "user", "content": "WEATHER"}],
                                        tools=[WEATHER_TOOL], max_tokens=200) as stream:
        final = stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls[0]
    assert final.choices[0].finish_reason == "tool_calls"
    assert streamed.function.name == "get_weather" and json.loads(streamed.function.arguments) == {"city": "Paris"}


def test_tool_history_round_trip(client):
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
        {"role": "user", "content": "ALPHA"},
    ]
    resp = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], max_tokens=100)
    assert resp.choices[0].message.content == "The answer is 4."


def test_stop_string_and_max_tokens(client):
    resp = ask(client, "COUNT", stop=["three"], max_tokens=100)
    assert resp.choices[0].message.content == "one two " and resp.choices[0].finish_reason == "stop"
    resp = ask(client, "LONG", max_tokens=8)
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 8


def test_sdk_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    assert err.value.code == "model_not_found" and err.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, "ALPHA", logprobs=True)
    assert err.value.code == "logprobs_not_supported" and err.value.body["param"] == "logprobs"


def test_models_endpoint(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].model_extra["max_model_len"] == 4096
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_tool_choice_none_and_allowed_tools_keep_markup_as_text(client):
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    for extra in ({"tool_choice": "none"},
                  {"tool_choice": {"type": "allowed_tools", "allowed_tools": {
                      "mode": "auto", "tools": [{"type": "function", "function": {"name": "get_time"}}]}}}):
        resp = ask(client, "WEATHER", tools=[WEATHER_TOOL, other], max_tokens=200, **extra)
        message = resp.choices[0].message
        assert not message.tool_calls and resp.choices[0].finish_reason == "stop"
        assert "<function=get_weather>" in message.content


def test_repeated_prefix_reports_cached_tokens(client):
    messages = [{"role": "system", "content": "You are a careful assistant. " * 12}, {"role": "user", "content": "ALPHA"}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=50)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=50)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 and again.model_extra["timings"]["cache_n"] == cached
    assert again.choices[0].message.content == "The answer is 4."
