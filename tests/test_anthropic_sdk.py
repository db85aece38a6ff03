"""Anthropic Messages through the official `anthropic` SDK against a real HTTP server (no Ray).

The scripted model makes every answer deterministic: thinking then text, tool calls, a prefill
continuation, a reply to tool results.
"""

from __future__ import annotations

import anthropic
import pytest
from anthropic_fixtures import MODEL, TIME, WEATHER, start_anthropic_server

from ninfer.protocol.reasoning_seal import unseal


@pytest.fixture(scope="module")
def server(artifacts_dir, qwen_tokenizer):
    live = start_anthropic_server(artifacts_dir, qwen_tokenizer)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=30)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_create_returns_thinking_text_usage_and_the_model_label(client):
    message = client.messages.create(model=MODEL, max_tokens=100, messages=user("ALPHA"))
    thinking, text = message.content
    assert message.id.startswith("msg_") and message.model == MODEL and message.role == "assistant"
    assert message._request_id and message._request_id.startswith("req_")
    assert thinking.type == "thinking" and thinking.thinking == "Two plus two is four.\n"
    assert unseal(thinking.signature) == thinking.thinking
    assert text.type == "text" and text.text == "The answer is 4."
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    usage = message.usage
    assert usage.input_tokens > 0 and usage.output_tokens > 0 and usage.cache_creation_input_tokens is None
    count = client.messages.count_tokens(model=MODEL, messages=user("ALPHA"))
    assert count.input_tokens == usage.input_tokens + usage.cache_read_input_tokens


def test_thinking_disabled_answers_without_a_thinking_block(client):
    message = client.messages.create(model=MODEL, max_tokens=100, messages=user("ALPHA"),
                                      thinking={"type": "disabled"})
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == "The answer is 4."
    with_thinking = client.messages.count_tokens(model=MODEL, messages=user("ALPHA"))
    without = client.messages.count_tokens(model=MODEL, messages=user("ALPHA"), thinking={"type": "disabled"})
    assert without.input_tokens == with_thinking.input_tokens + 2  # the closed empty think block


def test_stream_thinking_with_signature_then_text(client):
    with client.messages.stream(model=MODEL, max_tokens=2000, messages=user("ALPHA"),
                                thinking={"type": "enabled", "budget_tokens": 1024, "display": "summarized"},
                                ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "thinking" in kinds and "signature" in kinds and "text" in kinds
    assert kinds.index("signature") < kinds.index("text")
    thinking, text = final.content
    assert thinking.thinking == "Two plus two is four.\n" and unseal(thinking.signature) == thinking.thinking
    assert text.text == "The answer is 4." and final.stop_reason == "end_turn"
    again = client.messages.create(model=MODEL, max_tokens=100, messages=user("ALPHA"))
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == (
        again.usage.input_tokens + again.usage.cache_read_input_tokens)


def test_stream_tool_use_with_partial_json(client):
    with client.messages.stream(model=MODEL, max_tokens=300, messages=user("TWO_CALLS"), tools=[WEATHER, TIME],
                                ) as stream:
        partial = [event.partial_json for event in stream if event.type == "input_json"]
        final = stream.get_final_message()
    assert partial == ['{"city": "Paris"}', '{"city": "Paris"}']
    kinds = [b.type for b in final.content]
    assert kinds == ["thinking", "text", "tool_use", "tool_use"] and final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content[2:]] == [("get_weather", {"city": "Paris"}),
                                                              ("get_time", {"city": "Paris"})]
    assert all(b.id.startswith("toolu_") for b in final.content[2:]) and final.content[2].id != final.content[3].id


def test_tool_loop_with_results_out_of_order(client):
    first = client.messages.create(model=MODEL, max_tokens=300, messages=user("TWO_CALLS"), tools=[WEATHER, TIME])
    calls = [b for b in first.content if b.type == "tool_use"]
    results = [{"type": "tool_result", "tool_use_id": calls[1].id, "content": "noon"},
               {"type": "tool_result", "tool_use_id": calls[0].id, "content": [{"type": "text", "text": "sunny"}]}]
    history = [*user("TWO_CALLS"), {"role": "assistant", "content": first.content},
               {"role": "user", "content": results}]
    second = client.messages.create(model=MODEL, max_tokens=300, messages=history, tools=[WEATHER, TIME])
    assert [b.type for b in second.content] == ["thinking", "text"] and second.content[1].text == "Sunny at noon."
    # the history up to the first answer was retained: the follow-up reads it back
    assert second.usage.cache_read_input_tokens >= first.usage.input_tokens // 2


def test_property_names_like_dash_n_survive_rendering_and_parsing(client):
    tool = {"name": "run", "input_schema": {"$schema": "https://json-schema.org/draft/2020-12/schema",
                                            "type": "object", "properties": {"-n": {"type": "integer"}},
                                            "additionalProperties": False}}
    message = client.messages.create(model=MODEL, max_tokens=200, messages=user("DASH"), tools=[tool])
    call = message.content[-1]
    assert call.type == "tool_use" and call.name == "run" and call.input == {"-n": 3}


def test_a_changing_billing_block_does_not_break_prefix_reuse(client):
    def system(version: str) -> list[dict]:
        return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version={version}; cc_entrypoint=cli;"},
                {"type": "text", "text": "You are a coding agent with a long, stable prompt. " * 8}]

    first = client.messages.create(model=MODEL, max_tokens=50, system=system("2.0.1.aaa"), messages=user("ALPHA"))
    again = client.messages.create(model=MODEL, max_tokens=50, system=system("2.0.1.bbb"), messages=user("ALPHA"))
    assert again.usage.cache_read_input_tokens >= 64
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == first.usage.input_tokens


def test_prefill_is_continued(client):
    message = client.messages.create(model=MODEL, max_tokens=50, messages=[
        *user("PREFILL"), {"role": "assistant", "content": "The answer is"}])
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == " 4, as always."


def test_stop_sequence_and_max_tokens(client):
    message = client.messages.create(model=MODEL, max_tokens=100, messages=user("COUNT"), stop_sequences=["three"])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "three"
    assert message.content[-1].text == "one two "
    message = client.messages.create(model=MODEL, max_tokens=8, messages=user("LONG"))
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 8


def test_cache_control_on_a_repeated_prompt_is_read_back(client):
    system = [{"type": "text", "text": "You are a careful assistant. " * 12, "cache_control": {"type": "ephemeral"}}]
    first = client.messages.create(model=MODEL, max_tokens=50, system=system, messages=user("ALPHA"))
    again = client.messages.create(model=MODEL, max_tokens=50, system=system, messages=user("ALPHA"))
    assert first.usage.cache_read_input_tokens == 0
    assert again.usage.cache_read_input_tokens >= 16
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == first.usage.input_tokens
    assert again.content[-1].text == "The answer is 4."


def test_omitted_thinking_is_sealed_and_restored_on_replay(client):
    thinking = {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}
    first = client.beta.messages.create(model=MODEL, max_tokens=2000, messages=user("ALPHA"), thinking=thinking,
                                        betas=["interleaved-thinking-2025-05-14"])
    block = first.content[0]
    assert block.type == "thinking" and block.thinking == "" and unseal(block.signature) == "Two plus two is four.\n"
    with client.messages.stream(model=MODEL, max_tokens=2000, messages=user("ALPHA"), thinking=thinking) as stream:
        deltas = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert "thinking" not in deltas and streamed.content[0].thinking == ""
    assert unseal(streamed.content[0].signature) == "Two plus two is four.\n"

    def replay(content):
        return [*user("ALPHA"), {"role": "assistant", "content": content}, *user("COUNT")]

    visible = [{"type": "thinking", "thinking": "Two plus two is four.\n", "signature": "x"}, first.content[1]]
    extra = {"extra_body": {"preserve_thinking": True}}
    hidden = client.messages.count_tokens(model=MODEL, messages=replay(first.content), **extra)
    shown = client.messages.count_tokens(model=MODEL, messages=replay(visible), **extra)
    assert hidden.input_tokens == shown.input_tokens
    follow = client.messages.create(model=MODEL, max_tokens=2000, messages=replay(first.content), thinking=thinking)
    assert follow.content[-1].text == "one two three four five"


def test_sdk_sees_typed_errors(client):
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, max_tokens=100, messages=user("ALPHA"), tool_choice={"type": "any"},
                               tools=[WEATHER])
    body = err.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["request_id"] == err.value.response.headers["request-id"]
    assert "tool_choice.type" in body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.batches.list()
    assert err.value.body["error"]["type"] == "not_found_error"
