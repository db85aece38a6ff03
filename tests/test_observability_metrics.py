"""GET /metrics scraped over HTTP after real requests on the scripted model: counters move, gauges and
histograms are right, labels stay bounded, the API key applies, and a failed engine leaves the
endpoint readable with ninfer_engine_ready 0."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import MODEL, scripted_artifact, start_server, wait_until

from ninfer.server.metrics import DURATION_BUCKETS, EngineClientFeed, RequestFigures, ServerFacts, render
from ninfer.server.metrics_board import SnapshotBoard

KEY = "sk-metrics-PLANTED-0123"
AUTH = {"Authorization": f"Bearer {KEY}"}
ALLOWED_LABELS = {"replica", "outcome", "phase", "resource", "direction", "le", "model", "architecture", "kv_cache",
                  "speculative"}


@pytest.fixture(scope="module")
def path(artifacts_dir, qwen_tokenizer):
    return scripted_artifact(artifacts_dir, qwen_tokenizer)


@pytest.fixture(scope="module")
def server(path, qwen_tokenizer):
    live = start_server(path, qwen_tokenizer, api_key=KEY)
    yield live
    live.stop()


def scrape(url: str, headers=AUTH) -> dict[tuple[str, tuple], float]:
    r = httpx.get(url + "/metrics", headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def chat(url: str, keyword: str, **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": keyword}], **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=30)


def test_metrics_follow_the_api_key(server):
    assert httpx.get(server.url + "/metrics").status_code == 401
    assert httpx.get(server.url + "/metrics", headers={"x-api-key": KEY}).status_code == 200


def test_counters_gauges_and_histograms_move_with_requests(server):
    before = scrape(server.url)
    assert value(before, "ninfer_engine_ready") == 1.0
    assert value(before, "ninfer_max_concurrency") == 2.0 and value(before, "ninfer_max_context_tokens") == 4096.0
    assert value(before, "ninfer_model_info", model=MODEL, architecture="scripted", kv_cache="bf16",
                 speculative="off") == 1.0
    assert value(before, "ninfer_device_kv_capacity_pages", replica="0") == 4096 / 16

    done = chat(server.url, "ALPHA").json()
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers=AUTH, timeout=30,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "COUNT"}], "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.read().endswith(b"data: [DONE]\n\n")
    assert chat(server.url, "ALPHA", temperature=-1).status_code == 400  # validation: not a measured request
    too_long = chat(server.url, "word " * 5000)  # preparation rejects it: counted once as rejected
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"

    assert wait_until(lambda: server.engine.snapshot()["running"] == 0)
    after = scrape(server.url)

    def moved(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("ninfer_requests_total", outcome="stop") == 2
    assert moved("ninfer_requests_total", outcome="rejected") == 1
    assert sum(v for (n, _), v in after.items() if n == "ninfer_requests_total") - \
        sum(v for (n, _), v in before.items() if n == "ninfer_requests_total") == 3
    usage = done["usage"]
    assert moved("ninfer_prompt_tokens_total", replica="0") > usage["prompt_tokens"]  # both generations
    assert moved("ninfer_generation_tokens_total", replica="0") > usage["completion_tokens"]
    assert moved("ninfer_decode_tokens_total", replica="0") == moved("ninfer_generation_tokens_total", replica="0") - 2
    assert moved("ninfer_decode_rounds_total", replica="0") > 0
    for histogram in ("ninfer_time_to_first_token_seconds", "ninfer_request_duration_seconds",
                      "ninfer_request_queue_seconds"):
        assert moved(histogram + "_count") == 2, histogram
        assert moved(histogram + "_sum") > 0
        assert moved(histogram + "_bucket", le="+Inf") == 2
    assert value(after, "ninfer_request_duration_seconds_bucket", le=str(DURATION_BUCKETS[-1])) >= 2
    assert moved("ninfer_host_work_seconds_total", replica="0", phase="program_submit") > 0
    assert moved("ninfer_host_work_seconds_total", replica="0", phase="engine_commit_output") > 0
    assert value(after, "ninfer_requests_running", replica="0") == 0.0
    assert value(after, "ninfer_response_failures_total") == 0.0
    assert ("ninfer_context_transfer_bytes_total", (("direction", "d2h"), ("replica", "0"),
                                                    ("resource", "main_kv"))) in after


def test_labels_stay_bounded_and_carry_no_request_data(server):
    r = chat(server.url, "ALPHA")
    request_id = r.headers["x-request-id"]
    text = httpx.get(server.url + "/metrics", headers=AUTH).text
    assert request_id not in text and r.json()["id"] not in text and "ALPHA" not in text and KEY not in text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert set(sample.labels) <= ALLOWED_LABELS, sample
    outcomes = {s.labels["outcome"] for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "ninfer_requests_total"}
    assert outcomes <= {"stop", "stop_string", "length", "context", "cancelled", "error", "queue_timeout", "rejected"}


def test_failed_engine_leaves_metrics_readable_and_not_ready(path, qwen_tokenizer):
    live = start_server(path, qwen_tokenizer)
    try:
        def broken(*args, **kwargs):
            raise RuntimeError("device lost")

        live.engine.runner.forward = broken
        r = httpx.post(live.url + "/v1/chat/completions", timeout=30,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "ALPHA"}]})
        assert r.status_code == 500
        assert wait_until(lambda: not live.engine.healthy)
        samples = scrape(live.url, headers={})
        assert value(samples, "ninfer_engine_ready") == 0.0
        assert value(samples, "ninfer_engine_replica_ready", replica="0") == 0.0
        assert value(samples, "ninfer_requests_total", outcome="error") == 1.0
        assert httpx.get(live.url + "/health").status_code == 503
    finally:
        live.stop()


def test_unreachable_engine_reads_as_not_ready():
    class Gone:
        async def snapshot(self):
            raise ConnectionError("replica died")

    feed = EngineClientFeed(Gone(), RequestFigures())
    engines = asyncio.run(feed.engines())
    assert engines == {}
    facts = ServerFacts(MODEL, "scripted", "bf16", "off", 1, 4096)
    text = render(facts, engines, asyncio.run(feed.requests())).decode()
    assert "ninfer_engine_ready 0.0" in text and "ninfer_requests_running{" not in text


def test_replicas_stay_distinguishable_and_router_figures_sum():
    board = SnapshotBoard(ttl_s=60)
    board.publish("engine", "0", {"ready": True, "running": 1, "generation_tokens": 5})
    board.publish("engine", "1", {"ready": False, "running": 2, "generation_tokens": 7})
    one, two = RequestFigures(), RequestFigures()
    one.count("stop"), two.count("stop"), two.count("cancelled")
    one.ttft.observe(0.2), two.ttft.observe(3.0)
    board.publish("router", "a", one)
    board.publish("router", "b", two.copy())
    engines = board.collect("engine")
    summed = RequestFigures.summed(list(board.collect("router").values()))
    text = render(ServerFacts(MODEL, "scripted", "bf16", "off", 1, 4096), engines, summed).decode()
    assert 'ninfer_requests_running{replica="0"} 1.0' in text and 'ninfer_requests_running{replica="1"} 2.0' in text
    assert 'ninfer_generation_tokens_total{replica="1"} 7.0' in text
    assert "ninfer_engine_ready 0.0" in text  # one replica down: the server is not fully ready
    assert 'ninfer_requests_total{outcome="stop"} 2.0' in text
    assert "ninfer_time_to_first_token_seconds_count 2.0" in text
    stale = SnapshotBoard(ttl_s=0.0)
    stale.publish("engine", "0", {"ready": True})
    assert wait_until(lambda: stale.collect("engine") == {}, timeout=1)
