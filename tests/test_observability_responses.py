"""/v1/responses in the request log and on /metrics, end to end over the scripted model.

Every Create that passes validation is measured like a Chat Completion: request_start with protocol
openai_responses and exactly one terminal (JSON, stream, parallel_tool_calls:false cut, continuation,
client disconnect, engine failure after the stream started), request_rejected for a preparation
failure, nothing for validation errors, input_tokens or the stored-Response resources. A storage
failure after the outcome is a response failure, never a second terminal.
"""

from __future__ import annotations

import json
from collections import Counter

import httpx
import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import MODEL, wait_until
from test_responses_support import WEATHER, post, responses_server, sse_events

from ninfer.server.request_log import SCHEMA_PATH

TERMINALS = ("request_done", "request_error")


def scrape(server) -> dict[tuple[str, tuple], float]:
    r = httpx.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200, r.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def moved(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def read_log(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def by_http_id(records: list[dict], http_id: str) -> list[dict]:
    return [r for r in records if r.get("request", {}).get("x_request_id") == http_id]


@pytest.fixture(scope="module")
def campaign(artifacts_dir, qwen_tokenizer, tmp_path_factory):
    """Drive one server through every outcome (the engine failure last), then a server whose store holds nothing."""
    log_path = tmp_path_factory.mktemp("responses-log") / "requests.jsonl"
    ids: dict[str, str] = {}
    live = responses_server(artifacts_dir, qwen_tokenizer, request_log_jsonl=str(log_path))
    try:
        url = live.url + "/v1/responses"
        before = scrape(live)
        r = post(live, "/v1/responses", {"model": MODEL, "input": "ALPHA", "preserve_thinking": True})
        assert r.status_code == 200 and r.json()["status"] == "completed", r.text
        ids["done"], root = r.headers["x-request-id"], r.json()["id"]
        r = post(live, "/v1/responses", {"model": MODEL, "input": "COUNT", "stream": True})
        assert sse_events(r.text)[-1][0] == "response.completed"
        ids["stream"] = r.headers["x-request-id"]
        r = post(live, "/v1/responses", {"model": MODEL, "input": "COUNT", "previous_response_id": root,
                                         "preserve_thinking": False})
        assert r.status_code == 200, r.text
        ids["child"] = r.headers["x-request-id"]
        r = post(live, "/v1/responses", {"model": MODEL, "input": "TWOCALLS", "tools": [WEATHER],
                                         "parallel_tool_calls": False})
        assert [i["type"] for i in r.json()["output"]].count("function_call") == 1
        ids["single_call"] = r.headers["x-request-id"]

        r = post(live, "/v1/responses", {"model": MODEL, "input": "word " * 5000})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        ids["rejected"] = r.headers["x-request-id"]
        r = post(live, "/v1/responses", {"model": MODEL, "input": "ALPHA", "temperature": -1})
        assert r.status_code == 400
        ids["invalid"] = r.headers["x-request-id"]
        r = post(live, "/v1/responses", {"model": MODEL, "input": "ALPHA", "previous_response_id": "resp_nope"})
        assert r.status_code == 404
        ids["no_parent"] = r.headers["x-request-id"]
        r = post(live, "/v1/responses/input_tokens", {"model": MODEL, "input": "ALPHA"})
        assert r.status_code == 200 and r.json()["input_tokens"] > 0
        ids["input_tokens"] = r.headers["x-request-id"]
        for method, path in (("GET", f"/{root}"), ("GET", f"/{root}/input_items"), ("DELETE", f"/{root}")):
            assert httpx.request(method, url + path, timeout=10).status_code == 200

        with httpx.Client(timeout=30) as http:
            with http.stream("POST", url, json={"model": MODEL, "input": "LONG", "stream": True,
                                                "max_output_tokens": 2500}) as s:
                ids["cancelled"] = s.headers["x-request-id"]
                lines = s.iter_lines()
                for _ in range(12):
                    next(lines)
        assert wait_until(lambda: live.engine.snapshot()["running"] == 0)
        assert wait_until(lambda: any(r["event"] in TERMINALS for r in by_http_id(read_log(log_path),
                                                                                    ids["cancelled"])))

        def broken(*args, **kwargs):
            raise RuntimeError("device lost")

        live.engine.runner.forward = broken
        r = post(live, "/v1/responses", {"model": MODEL, "input": "ALPHA", "stream": True})
        events = sse_events(r.text)
        assert events[0][0] == "response.created" and events[-1][0] == "response.failed"
        ids["failed"] = r.headers["x-request-id"]
        after = scrape(live)
    finally:
        live.stop()

    full = responses_server(artifacts_dir, qwen_tokenizer, request_log_jsonl=str(log_path),
                            response_store_max_mib=0)  # nothing fits: storing fails after the outcome
    try:
        store_before = scrape(full)
        r = post(full, "/v1/responses", {"model": MODEL, "input": "ALPHA", "stream": True})
        failed = sse_events(r.text)[-1]
        assert failed[0] == "response.failed"
        assert failed[1]["response"]["error"]["code"] == "response_store_capacity_exceeded"
        ids["store_stream"] = r.headers["x-request-id"]
        r = post(full, "/v1/responses", {"model": MODEL, "input": "ALPHA"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "response_store_capacity_exceeded"
        ids["store_json"] = r.headers["x-request-id"]
        store_after = scrape(full)
    finally:
        full.stop()
    return {"records": read_log(log_path), "ids": ids, "metrics": (before, after),
            "store_metrics": (store_before, store_after)}


def test_every_line_validates_against_the_schema(campaign):
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text()))
    for record in campaign["records"]:
        errors = sorted(validator.iter_errors(record), key=str)
        assert not errors, (record["event"], [e.message for e in errors[:3]])


def test_exactly_one_terminal_per_started_generation(campaign):
    records = campaign["records"]
    for instance in {r["server_instance_id"] for r in records}:
        mine = [r for r in records if r["server_instance_id"] == instance]
        starts = [r["request"] for r in mine if r["event"] == "request_start"]
        assert starts and {s["protocol"] for s in starts} == {"openai_responses"}
        terminals = Counter(r["request"]["request_id"] for r in mine if r["event"] in TERMINALS)
        assert sorted(terminals) == sorted(s["request_id"] for s in starts) and set(terminals.values()) == {1}
        rejected = [r["request"]["request_id"] for r in mine if r["event"] == "request_rejected"]
        assert not set(rejected) & set(terminals)
        numbered = [r["request"]["request_id"] for r in mine if r["event"] in ("request_start", "request_rejected")]
        assert numbered == list(range(1, len(numbered) + 1))  # every measured request, and nothing else


def test_outcomes_per_request(campaign):
    records, ids = campaign["records"], campaign["ids"]
    for unmeasured in ("invalid", "no_parent", "input_tokens"):
        assert by_http_id(records, ids[unmeasured]) == [], unmeasured

    start, done = by_http_id(records, ids["done"])
    assert (start["event"], done["event"]) == ("request_start", "request_done")
    request = start["request"]
    assert request["protocol"] == "openai_responses" and request["stream"] is False
    assert request["requested_output_tokens_source"] == "server_default" and request["enable_thinking"] is True
    assert request["preserve_thinking"] is True and request["preserve_thinking_semantic_change"] is False
    assert isinstance(request["sampling"]["seed"], int)
    result = done["result"]
    assert result["finish_reason"] == "stop" and result["completion_tokens"] == len(result["generated_token_ids"])
    assert 0 < done["timings_seconds"]["prepare"] <= done["timings_seconds"]["ttft"] <= done["timings_seconds"]["total"]

    start, done = by_http_id(records, ids["stream"])
    assert start["request"]["stream"] is True and done["event"] == "request_done"
    assert done["result"]["finish_reason"] == "stop"

    start, done = by_http_id(records, ids["child"])  # the stored history is part of the measured conversation
    assert start["request"]["message_count"] > 1 and start["request"]["preserve_thinking_semantic_change"] is True
    assert done["event"] == "request_done"

    start, done = by_http_id(records, ids["single_call"])  # the router ended it at the first call: still done
    assert start["request"]["tool_count"] == 1 and done["event"] == "request_done"
    result = done["result"]
    assert result["finish_reason"] == "stop" and result["tool_call_count"] == 1
    assert result["tool_call_parse"]["structured_call_count"] == 1
    assert result["completion_tokens"] == len(result["generated_token_ids"]) > 0
    assert done["timings_seconds"]["ttft"] <= done["timings_seconds"]["total"]

    (rejected,) = by_http_id(records, ids["rejected"])
    assert rejected["event"] == "request_rejected" and rejected["phase"] == "prepare"
    assert rejected["request"]["protocol"] == "openai_responses"
    assert (rejected["error"]["status"], rejected["error"]["code"]) == (400, "context_length_exceeded")

    start, cancelled = by_http_id(records, ids["cancelled"])
    assert start["request"]["requested_output_tokens"] == 2500
    assert cancelled["event"] == "request_error" and cancelled["error"]["kind"] == "cancellation"
    start, failed = by_http_id(records, ids["failed"])
    assert failed["event"] == "request_error" and failed["error"]["kind"] == "generation"

    for stored in ("store_stream", "store_json"):  # the outcome came before the store refused it
        start, done = by_http_id(records, ids[stored])
        assert done["event"] == "request_done" and done["result"]["finish_reason"] == "stop"


def test_metrics_count_responses_generations(campaign):
    before, after = campaign["metrics"]
    assert moved(before, after, "ninfer_requests_total", outcome="stop") == 4
    assert moved(before, after, "ninfer_requests_total", outcome="rejected") == 1
    assert moved(before, after, "ninfer_requests_total", outcome="cancelled") == 1
    assert moved(before, after, "ninfer_requests_total", outcome="error") == 1
    total = sum(v for (n, _), v in after.items() if n == "ninfer_requests_total")
    assert total - sum(v for (n, _), v in before.items() if n == "ninfer_requests_total") == 7
    assert moved(before, after, "ninfer_time_to_first_token_seconds_count") == 5  # all but the engine failure
    assert moved(before, after, "ninfer_request_duration_seconds_count") == 5  # settled: 4 done + 1 cancelled
    assert moved(before, after, "ninfer_response_failures_total") == 0

    before, after = campaign["store_metrics"]
    assert moved(before, after, "ninfer_requests_total", outcome="stop") == 2
    assert moved(before, after, "ninfer_response_failures_total") == 2  # storage failed after each outcome


def test_a_cut_answer_logs_only_the_tokens_it_answered():
    """parallel_tool_calls:false ends the answer inside an engine event list: the tokens after the cut in that
    list were observed on the way through but never answered, so generated_token_ids leaves them out."""
    import asyncio

    from ninfer.chat.qwen_tool_parser import TOOL_CLOSE, TOOL_OPEN
    from ninfer.config import ServerConfig
    from ninfer.engine.types import Channel, ProgressEvent, TokenEvent
    from ninfer.server.decoding import Generation
    from ninfer.server.observer import RequestObserver, RequestShape
    from ninfer.server.request_log import ModelIdentity

    class Echo:  # the decoder is below the layer under test: it passes text through
        def feed(self, text, channel):
            return [text]

        def finish(self):
            return [], None

    async def one_list():
        yield [ProgressEvent(total=3, cache=0, processed=3, time_ms=1.0),
               TokenEvent([11, 12], Channel.ANSWER, f"{TOOL_OPEN}x{TOOL_CLOSE}"),
               TokenEvent([13], Channel.ANSWER, TOOL_OPEN)]

    observer = RequestObserver(ServerConfig(artifact="unused.ninfer"), ModelIdentity("m", "m", "qwen3", {}), None)
    shape = RequestShape("openai_responses", "m", False, 1, 0, 1, "auto", False, None, None, None)
    trace = observer.begin(shape, "req_cut")
    trace.started = True

    async def run():
        generation = Generation(trace.watch(one_list()), Echo(), type("P", (), {"token_ids": [1, 2, 3]})(),
                                single_call=True)
        async for _ in generation.steps():
            pass
        return generation.outcome

    outcome = asyncio.run(run())
    assert outcome.usage.completion_tokens == 2
    trace.finish(outcome.decoded, fin=outcome.finish)
    assert trace.token_ids == [11, 12] and trace.settled
