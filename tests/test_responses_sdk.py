"""The Responses API through the official `openai` SDK against a real HTTP server (no Ray).

The scripted model makes every answer deterministic (see test_responses_support.SCRIPTS): reasoning
then an answer, single, parallel and namespaced tool calls, and a reply to a tool result.
"""

from __future__ import annotations

import json

import openai
import pytest
from server_fixtures import MODEL
from test_responses_support import NAMESPACE, WEATHER, responses_server


@pytest.fixture(scope="module")
def server(artifacts_dir, qwen_tokenizer):
    live = responses_server(artifacts_dir, qwen_tokenizer)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_create_returns_typed_items_usage_and_echo(client):
    r = client.responses.create(model=MODEL, input="ALPHA", instructions="Answer briefly.", metadata={"k": "v"})
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == "completed" and r.completed_at is not None and r.incomplete_details is None
    assert [item.type for item in r.output] == ["reasoning", "message"]
    reasoning, message = r.output
    assert reasoning.id.startswith("rs_") and reasoning.summary == [] and reasoning.encrypted_content is None
    assert reasoning.content[0].type == "reasoning_text" and reasoning.content[0].text.strip() == "Two plus two is four."
    assert message.id.startswith("msg_") and message.role == "assistant" and message.status == "completed"
    assert r.output_text == "The answer is 4."  # the SDK helper over the output Items
    usage = r.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert 0 < usage.output_tokens_details.reasoning_tokens < usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0
    assert r.instructions == "Answer briefly." and r.metadata == {"k": "v"} and r.store is True
    assert r.max_output_tokens is None and r.tools == [] and r.tool_choice == "auto" and r.service_tier == "default"


def test_stream_with_the_sdk_helper(client):
    deltas = []
    with client.responses.stream(model=MODEL, input="ALPHA") as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "The answer is 4."
    assert final.status == "completed" and [item.type for item in final.output] == ["reasoning", "message"]
    events = list(client.responses.create(model=MODEL, input="ALPHA", stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert events[-1].response.output_text == "The answer is 4."


def test_retrieve_delete_and_input_items_paging(client):
    items = [user(f"note {i}") for i in range(4)] + [user("ALPHA")]
    r = client.responses.create(model=MODEL, input=items)
    again = client.responses.retrieve(r.id)
    assert again.model_dump() == r.model_dump()
    listed = list(client.responses.input_items.list(r.id, limit=2, order="asc"))  # the SDK follows `after`
    assert [i.content[0].text for i in listed] == [f"note {i}" for i in range(4)] + ["ALPHA"]
    assert all(i.id.startswith("msg_") and i.type == "message" for i in listed)
    page = client.responses.input_items.list(r.id, limit=2)
    assert [i.content[0].text for i in page.data] == ["ALPHA", "note 3"] and page.has_more
    assert client.responses.input_items.list(r.id).has_more is False
    assert client.responses.delete(r.id) is None
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(r.id)
    assert err.value.code == "response_not_found"


def test_tool_round_trip_through_previous_response_id(client):
    first = client.responses.create(model=MODEL, input="WEATHER", tools=[WEATHER])
    assert [item.type for item in first.output] == ["reasoning", "function_call"]
    call = first.output[1]
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.id != call.call_id
    assert call.name == "get_weather" and call.namespace is None and json.loads(call.arguments) == {"city": "Paris"}
    assert first.status == "completed" and first.output_text == ""
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER],
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "SUNNY"}])
    assert second.output_text == "It is sunny in Paris." and second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens > 0  # the chain reuses the retained endpoint
    third = client.responses.create(model=MODEL, previous_response_id=second.id, input="ALPHA")
    assert third.output_text == "The answer is 4."
    listed = client.responses.input_items.list(second.id)
    assert [i.type for i in listed.data] == ["function_call_output"] and listed.data[0].id.startswith("fco_")


def test_namespaced_tool_round_trip(client):
    first = client.responses.create(model=MODEL, input="NSWEATHER", tools=[WEATHER, NAMESPACE])
    call = first.output[-1]
    assert call.type == "function_call" and (call.namespace, call.name) == ("weather", "get_current")
    assert first.tools[1].type == "namespace" and first.tools[1].tools[0].name == "get_current"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "SUNNY", "namespace": "weather",
              "name": "get_current"}
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER, NAMESPACE],
                                     input=[result])
    assert second.output_text == "It is sunny in Paris."
    with client.responses.stream(model=MODEL, input="NSWEATHER", tools=[NAMESPACE]) as stream:
        streamed = stream.get_final_response().output[-1]
    assert (streamed.namespace, streamed.name) == ("weather", "get_current")
    # the same function name without the namespace is a different tool: the call stays text
    plain = client.responses.create(model=MODEL, input="NSWEATHER", tools=[WEATHER])
    assert "<function=weather__get_current>" in plain.output_text


def test_store_false_replays_sealed_reasoning_without_the_store(client):
    first = client.responses.create(model=MODEL, input="WEATHER", tools=[WEATHER], store=False,
                                    include=["reasoning.encrypted_content"])
    reasoning, call = first.output
    assert reasoning.encrypted_content and first.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, previous_response_id=first.id, input="ALPHA")
    assert err.value.body["param"] == "previous_response_id"
    # Codex's replay: ids we generated, reasoning with only the sealed text, the call with its namespace field
    replay = [user("WEATHER"),
              {"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": reasoning.encrypted_content},
              {"type": "function_call", "id": call.id, "call_id": call.call_id, "name": call.name, "namespace": None,
               "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id,
               "output": [{"type": "input_text", "text": "SUNNY"}]}]
    second = client.responses.create(model=MODEL, input=replay, tools=[WEATHER], store=False,
                                     include=["reasoning.encrypted_content"])
    assert second.output_text == "It is sunny in Paris."
    # the restored text renders the same prompt as the raw one, so it reuses the first turn's endpoint
    assert second.usage.input_tokens_details.cached_tokens > first.usage.input_tokens
    raw = [replay[0], {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text",
                                                                         "text": reasoning.content[0].text}]},
           *replay[2:]]
    sealed_count = client.responses.input_tokens.count(model=MODEL, input=replay, tools=[WEATHER]).input_tokens
    assert client.responses.input_tokens.count(model=MODEL, input=raw, tools=[WEATHER]).input_tokens == sealed_count


def test_a_store_false_child_continues_a_stored_chain_without_joining_it(client):
    root = client.responses.create(model=MODEL, input="ALPHA")
    child = client.responses.create(model=MODEL, previous_response_id=root.id, input="COUNT", store=False)
    assert child.output_text == "one two three four five" and child.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(child.id)
    sibling = client.responses.create(model=MODEL, previous_response_id=root.id, input="COUNT")
    assert sibling.output_text == child.output_text


def test_parallel_tool_calls_false_stops_after_the_first_call(client):
    both = client.responses.create(model=MODEL, input="TWOCALLS", tools=[WEATHER])
    assert [json.loads(i.arguments)["city"] for i in both.output if i.type == "function_call"] == ["Paris", "Rome"]
    one = client.responses.create(model=MODEL, input="TWOCALLS", tools=[WEATHER], parallel_tool_calls=False)
    calls = [i for i in one.output if i.type == "function_call"]
    assert len(calls) == 1 and json.loads(calls[0].arguments) == {"city": "Paris"}
    assert one.status == "completed" and one.parallel_tool_calls is False
    assert one.usage.output_tokens < both.usage.output_tokens


def test_results_are_matched_by_call_id_and_put_in_call_order(client):
    first = client.responses.create(model=MODEL, input="TWOCALLS", tools=[WEATHER])
    paris, rome = [i.call_id for i in first.output if i.type == "function_call"]

    def count(order):
        outputs = [{"type": "function_call_output", "call_id": c, "output": f"result {c}"} for c in order]
        return client.responses.input_tokens.count(model=MODEL, previous_response_id=first.id, tools=[WEATHER],
                                                   input=outputs).input_tokens

    assert count([rome, paris]) == count([paris, rome])
    with pytest.raises(openai.BadRequestError) as err:
        count([rome])  # a result for the second call while the first has none
    assert err.value.code == "invalid_tool_history"


def test_incomplete_output_and_reasoning_only_output(client):
    r = client.responses.create(model=MODEL, input="LONG", max_output_tokens=8)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.completed_at is None and r.usage.output_tokens == 8 and r.max_output_tokens == 8
    assert r.output[-1].type == "message" and r.output[-1].status == "incomplete"
    r = client.responses.create(model=MODEL, input="LONG", max_output_tokens=1)
    assert [item.type for item in r.output] == ["reasoning"]  # no invented empty message
    assert r.output[0].status == "incomplete"


def test_input_tokens_counts_the_create_prompt(client):
    kwargs = {"input": "ALPHA", "instructions": "Answer briefly.", "tools": [WEATHER, NAMESPACE]}
    created = client.responses.create(model=MODEL, **kwargs)
    counted = client.responses.input_tokens.count(model=MODEL, **kwargs)
    assert counted.object == "response.input_tokens" and counted.input_tokens == created.usage.input_tokens
    # no new input: the stored history alone is continued
    same = {"instructions": kwargs["instructions"], "tools": kwargs["tools"], "previous_response_id": created.id}
    continued = client.responses.input_tokens.count(model=MODEL, **same).input_tokens
    assert continued > created.usage.input_tokens
    assert client.responses.input_tokens.count(model=MODEL, input="", **same).input_tokens == continued
    assert client.responses.create(model=MODEL, previous_response_id=created.id).status == "completed"


def test_instructions_apply_to_one_request_only(client):
    first = client.responses.create(model=MODEL, input="ALPHA", instructions="Answer briefly.")
    assert [i.type for i in client.responses.input_items.list(first.id).data] == ["message"]

    def count(**extra):
        return client.responses.input_tokens.count(model=MODEL, previous_response_id=first.id, input="COUNT",
                                                   **extra).input_tokens

    assert count(instructions="Answer briefly.") > count()


def test_children_inherit_preserve_thinking(client):
    root = client.responses.create(model=MODEL, input="ALPHA", extra_body={"preserve_thinking": True})

    def count(**extra):
        return client.responses.input_tokens.count(model=MODEL, previous_response_id=root.id, input="COUNT",
                                                   extra_body=extra).input_tokens

    inherited, dropped = count(), count(preserve_thinking=False)
    assert inherited == count(preserve_thinking=True) > dropped  # the root's reasoning stays in the prompt


def test_reasoning_effort_none_disables_thinking(client):
    r = client.responses.create(model=MODEL, input="ALPHA", reasoning={"effort": "none", "summary": "auto"})
    assert r.reasoning.effort == "none" and r.reasoning.summary == "auto"
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert [item.type for item in r.output] == ["message"]  # the script only answers thinking prompts
