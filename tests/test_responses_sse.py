"""Responses SSE with raw httpx: framing, the semantic event lifecycle, stable ids and indices,
deltas that add up to the terminal Items, response.failed after the stream started, and
cancellation when the client disconnects."""

from __future__ import annotations

import httpx
import pytest
from server_fixtures import MODEL, wait_until
from test_responses_support import NAMESPACE, WEATHER, post, responses_server, sse_events

TERMINALS = {"response.completed", "response.incomplete", "response.failed"}


@pytest.fixture(scope="module")
def server(artifacts_dir, qwen_tokenizer):
    live = responses_server(artifacts_dir, qwen_tokenizer)
    yield live
    live.stop()


def stream(server, **fields) -> list[tuple[str, dict]]:
    r = post(server, "/v1/responses", {"model": MODEL, "stream": True, **fields})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    assert r.headers["x-request-id"].startswith("req_") and "[DONE]" not in r.text
    return sse_events(r.text)


def check_lifecycle(events: list[tuple[str, dict]]) -> dict:
    """The contract's invariants for any stream; returns the terminal Response."""
    names = [name for name, _ in events]
    assert all(name == payload["type"] for name, payload in events)
    assert [payload["sequence_number"] for _, payload in events] == list(range(len(events)))
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] in TERMINALS and sum(name in TERMINALS for name in names) == 1
    response = events[-1][1]["response"]
    assert {p["response"]["id"] for n, p in events if "response" in p} == {response["id"]}
    output = response["output"]
    added = [p for n, p in events if n == "response.output_item.added"]
    done = [p for n, p in events if n == "response.output_item.done"]
    assert [p["output_index"] for p in added] == [p["output_index"] for p in done] == list(range(len(output)))
    assert [p["item"]["id"] for p in added] == [p["item"]["id"] for p in done] == [i["id"] for i in output]
    assert [p["item"] for p in done] == output
    for index, item in enumerate(output):
        mine = [p for n, p in events if p.get("output_index") == index]
        assert all(p.get("item_id", item["id"]) == item["id"] for p in mine)
        deltas = "".join(p["delta"] for p in mine if p["type"].endswith(".delta"))
        if item["type"] == "function_call":
            assert deltas == item["arguments"]
        else:
            assert deltas == (item["content"][0]["text"] if item["content"] else "")
            assert [p["type"] for p in mine if "content_part" in p["type"]] == [
                "response.content_part.added", "response.content_part.done"]
    return response


def test_text_stream_lifecycle(server):
    events = stream(server, input="ALPHA")
    response = check_lifecycle(events)
    assert events[-1][0] == "response.completed" and response["status"] == "completed"
    names = [name for name, _ in events]
    assert names.index("response.reasoning_text.done") < names.index("response.output_text.delta")
    assert response["output"][1]["content"][0]["text"] == "The answer is 4."
    created = events[0][1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
    assert response["usage"]["output_tokens"] > 0


def test_text_before_a_tool_call_streams_at_once(server):
    events = stream(server, input="PREAMBLE", tools=[WEATHER])
    response = check_lifecycle(events)
    assert [i["type"] for i in response["output"]] == ["reasoning", "message", "function_call"]
    names = [name for name, _ in events]
    text = [p["delta"] for n, p in events if n == "response.output_text.delta"]
    assert "".join(text) == "Let me check the weather for you." and len(text) > 3  # token by token, not at the end
    assert names.index("response.output_text.done") < names.index("response.function_call_arguments.delta")
    call = response["output"][2]
    args_done = next(p for n, p in events if n == "response.function_call_arguments.done")
    assert args_done["arguments"] == call["arguments"] and args_done["name"] == "get_weather"
    added = next(p["item"] for n, p in events if n == "response.output_item.added" and p["output_index"] == 2)
    assert added["status"] == "in_progress" and added["arguments"] == "" and added["call_id"] == call["call_id"]


def test_parallel_and_namespaced_calls_stream(server):
    response = check_lifecycle(stream(server, input="TWOCALLS", tools=[WEATHER]))
    assert [i["type"] for i in response["output"]] == ["reasoning", "function_call", "function_call"]
    response = check_lifecycle(stream(server, input="NSWEATHER", tools=[NAMESPACE]))
    call = response["output"][-1]
    assert (call["namespace"], call["name"]) == ("weather", "get_current")


def test_incomplete_stream_and_sealed_reasoning(server):
    events = stream(server, input="LONG", max_output_tokens=6, include=["reasoning.encrypted_content"])
    response = check_lifecycle(events)
    assert events[-1][0] == "response.incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    added = next(p["item"] for n, p in events if n == "response.output_item.added")
    assert "encrypted_content" not in added and response["output"][0]["encrypted_content"]


def test_errors_before_the_stream_are_http_errors(server):
    r = post(server, "/v1/responses", {"model": MODEL, "stream": True, "input": "ALPHA", "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "logprobs_not_supported"


def test_failure_after_the_stream_started_is_response_failed(artifacts_dir, qwen_tokenizer):
    live = responses_server(artifacts_dir, qwen_tokenizer, response_store_max_mib=0)  # nothing fits
    try:
        events = stream(live, input="ALPHA")
        assert events[-1][0] == "response.failed" and [n for n, _ in events].count("response.failed") == 1
        failed = events[-1][1]["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "response_store_capacity_exceeded"
        assert [p["sequence_number"] for _, p in events] == list(range(len(events)))
        r = post(live, "/v1/responses", {"model": MODEL, "input": "ALPHA"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "response_store_capacity_exceeded"
        r = post(live, "/v1/responses", {"model": MODEL, "input": "ALPHA", "store": False})
        assert r.status_code == 200 and r.json()["status"] == "completed"
    finally:
        live.stop()


def test_client_disconnect_cancels_the_request(server):
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/responses",
                         json={"model": MODEL, "input": "LONG", "stream": True, "max_output_tokens": 2500}) as r:
            lines = r.iter_lines()
            for _ in range(12):
                next(lines)
            assert server.engine.snapshot()["running"] == 1
    engine = server.engine
    assert wait_until(lambda: engine.snapshot()["running"] == 0), engine.snapshot()
    assert engine.snapshot()["kv_pages_used"] == engine.cache.held_pages
