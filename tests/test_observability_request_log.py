"""--request-log-jsonl and the stderr records, end to end over the scripted model.

Two servers append to one campaign file (as successive model blocks would). Every line must
validate against ninfer/server/request_log.schema.json; every started generation gets exactly one
terminal (success, stream, tool call, cancellation, engine failure); preparation rejections have no
start; validation errors get nothing. A planted API key and planted prompt text must appear in no log.
A --vision server (tiny Qwen3.6 with its tower) logs each request's own media preparation in
request_start: cache miss, hit and single-flight join counts, sizes, and preparation seconds.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import re
import threading
import time
from collections import Counter
from dataclasses import replace

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import torch
from PIL import Image
from server_fixtures import (
                             MODEL,
                             OUTPUTS,
                             WEATHER_TOOL,
                             LiveServer,
                             base_context,
                             scripted_artifact,
                             start_server,
                             wait_until,
)

from ninfer.artifact.presets import write_preset
from ninfer.config import ServerConfig
from ninfer.engine.loader import load_engine
from ninfer.media import MediaPreprocessor
from ninfer.media import preprocessor as media_preprocessor
from ninfer.protocol.openai_chat import ChatDefaults
from ninfer.server.engine_client import LocalEngineClient
from ninfer.server.media_client import LocalMediaClient
from ninfer.server.oplog import RecordFormatter
from ninfer.server.request_log import SCHEMA_PATH
from ninfer.server.startup import engine_settings
from ninfer.server.stats import StatsReporter

KEY = "sk-PLANTED-KEY-9f8e7d"
AUTH = {"Authorization": f"Bearer {KEY}"}
PLANTED_PROMPT = "PLANTED-PROMPT-TEXT-do-not-log"
PLANTED_OUTPUT = "The answer is 4"  # the ALPHA script's answer
RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (TRACE|DEBUG|INFO|WARNING|ERROR|CRITICAL) \S")


def body(keyword: str, **extra) -> dict:
    messages = [{"role": "system", "content": PLANTED_PROMPT}, {"role": "user", "content": keyword}]
    return {"model": MODEL, "messages": messages, **extra}


@pytest.fixture(scope="module")
def stderr_records():
    """The `ninfer` logger's records at INFO, formatted as on stderr."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(RecordFormatter())
    logger = logging.getLogger("ninfer")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield stream
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture(scope="module")
def campaign(artifacts_dir, qwen_tokenizer, tmp_path_factory, stderr_records):
    """Drive both servers once; the tests below read what they wrote."""
    path = scripted_artifact(artifacts_dir, qwen_tokenizer)
    log_path = tmp_path_factory.mktemp("campaign") / "requests.jsonl"
    ids: dict[str, str] = {}

    live = start_server(path, qwen_tokenizer, api_key=KEY, request_log_jsonl=str(log_path))
    try:
        url = live.url + "/v1/chat/completions"
        before = live.engine.snapshot()
        r = httpx.post(url, json=body("ALPHA"), headers=AUTH, timeout=30)
        assert r.status_code == 200 and PLANTED_OUTPUT in r.text
        ids["done"] = r.headers["x-request-id"]
        with httpx.stream("POST", url, json=body("COUNT", stream=True), headers=AUTH, timeout=30) as s:
            assert s.read().endswith(b"data: [DONE]\n\n")
            ids["stream"] = s.headers["x-request-id"]
        r = httpx.post(url, json=body("WEATHER", tools=[WEATHER_TOOL]), headers=AUTH, timeout=30)
        assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
        ids["tool"] = r.headers["x-request-id"]
        r = httpx.post(url, json=body("ALPHA", top_k=99), headers=AUTH, timeout=30)
        assert r.status_code == 400
        ids["invalid"] = r.headers["x-request-id"]
        r = httpx.post(url, json=body("word " * 5000), headers=AUTH, timeout=30)
        assert r.json()["error"]["code"] == "context_length_exceeded"
        ids["rejected"] = r.headers["x-request-id"]
        with httpx.Client(timeout=30, headers=AUTH) as http:
            with http.stream("POST", url, json=body("LONG", stream=True, max_tokens=2500)) as s:
                ids["cancelled"] = s.headers["x-request-id"]
                lines = s.iter_lines()
                for _ in range(6):
                    next(lines)
        assert wait_until(lambda: live.engine.snapshot()["running"] == 0)
        # one throughput interval from the engine's snapshots, written where the engine lives
        reporter = StatsReporter(live.engine.snapshot, 5000, request_log=live.server.config.app.state.observer.log,
                                 replica="0")
        reporter.report(before, live.engine.snapshot(), 2.5)
        reporter.report(live.engine.snapshot(), live.engine.snapshot(), 5.0)  # idle: omitted
    finally:
        live.stop()

    # A second block in the same file: KV pressure (pause, replay, restore), then an engine failure.
    # (no prefix reuse: the twin request's retained endpoint must not stand in for the replay)
    tight = start_server(path, qwen_tokenizer, request_log_jsonl=str(log_path), kv_capacity=256, host_context_mib=0,
                         no_prefix_reuse=True)
    try:
        url = tight.url + "/v1/chat/completions"
        results = []

        def run() -> None:
            results.append(httpx.post(url, json=body("LONG", max_tokens=150), timeout=60))

        threads = [threading.Thread(target=run) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.status_code for r in results] == [200, 200]
        assert tight.engine.counters.replay_restores >= 1, tight.engine.snapshot()

        # the younger of two long streams pauses; its client goes away while it waits (steps slowed to 10 ms, so
        # the older one is still running when the younger arrives, however loaded the test machine)
        forward = tight.engine.runner.forward

        def slow(*args, **kwargs):
            time.sleep(0.01)
            return forward(*args, **kwargs)

        tight.engine.runner.forward = slow
        older = threading.Thread(target=run)
        older.start()
        assert wait_until(lambda: tight.engine.snapshot()["running"] == 1)
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", url, json=body("LONG", stream=True, max_tokens=150)) as s:
                ids["paused_cancelled"] = s.headers["x-request-id"]
                assert wait_until(lambda: tight.engine.snapshot()["paused"] == 1, timeout=30), tight.engine.snapshot()
        older.join()
        assert wait_until(lambda: tight.engine.snapshot()["running"] == 0)
        tight.engine.runner.forward = forward

        def broken(*args, **kwargs):
            raise RuntimeError("device lost")

        tight.engine.runner.forward = broken
        r = httpx.post(url, json=body("ALPHA"), timeout=30)
        assert r.status_code == 500
        ids["failed"] = r.headers["x-request-id"]
    finally:
        tight.stop()
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    return {"path": log_path, "records": records, "ids": ids, "stderr": stderr_records.getvalue()}


def by_http_id(records: list[dict], http_id: str) -> list[dict]:
    return [r for r in records if r.get("request", {}).get("x_request_id") == http_id]


def test_every_line_validates_against_the_schema(campaign):
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text()))
    for record in campaign["records"]:
        errors = sorted(validator.iter_errors(record), key=str)
        assert not errors, (record["event"], [e.message for e in errors[:3]])
    events = Counter(r["event"] for r in campaign["records"])
    assert events["server_start"] == 2 and events["throughput"] == 1
    assert events["request_scheduling"] >= 3


def test_exactly_one_terminal_per_started_generation(campaign):
    records = campaign["records"]
    instances = list(dict.fromkeys(r["server_instance_id"] for r in records))
    for instance in instances:
        mine = [r for r in records if r["server_instance_id"] == instance]
        assert mine[0]["event"] == "server_start"
        started = [r["request"]["request_id"] for r in mine if r["event"] == "request_start"]
        terminals = Counter(r["request"]["request_id"] for r in mine if r["event"] in ("request_done", "request_error"))
        assert sorted(terminals) == sorted(started) and set(terminals.values()) == {1}
        rejected = [r["request"]["request_id"] for r in mine if r["event"] == "request_rejected"]
        assert not set(rejected) & set(started)
        numbered = [r["request"]["request_id"] for r in mine if r["event"] in ("request_start", "request_rejected")]
        # ids are handed out in arrival order, one each; concurrent requests may write their records in either
        # order (the second block runs two at once), so the file order is not the id order
        assert sorted(numbered) == list(range(1, len(numbered) + 1))
        if instance == instances[0]:  # the first block's requests are sequential: file order is id order
            assert numbered == sorted(numbered)


def test_outcomes_per_request(campaign):
    records, ids = campaign["records"], campaign["ids"]
    assert by_http_id(records, ids["invalid"]) == []  # validation errors are not measurement requests
    (rejected,) = by_http_id(records, ids["rejected"])
    assert rejected["event"] == "request_rejected" and rejected["phase"] == "prepare"
    assert (rejected["error"]["status"], rejected["error"]["code"]) == (400, "context_length_exceeded")

    start, done = by_http_id(records, ids["done"])
    assert (start["event"], done["event"]) == ("request_start", "request_done")
    assert start["request"]["protocol"] == "openai_chat" and start["request"]["enable_thinking"] is True
    assert start["request"]["requested_output_tokens_source"] == "server_default"
    assert isinstance(start["request"]["sampling"]["seed"], int)
    result, timings = done["result"], done["timings_seconds"]
    assert result["finish_reason"] == "stop" and result["completion_tokens"] == len(result["generated_token_ids"])
    assert result["computed_prefill_tokens"] + result["prefix_cache_hit_tokens"] == result["prompt_tokens"]
    assert result["prefix_reuse_path"] in ("root", "checkpoint") and result["tool_call_parse"]["marker_seen"] is False
    assert 0 < timings["prepare"] <= timings["ttft"] <= timings["total"] and timings["queue"] >= 0
    assert any(not float(v).is_integer() for v in timings.values() if v)  # full precision, not rounded ms
    # engine_timing: the request's share of the engine's time ("Structured request log"); total is the sum of the
    # five host phases, device wait apart; a decode round per committed token after the first (one per step)
    engine = done["engine_timing"]
    host = engine["host_exposed_seconds"]
    assert host["total"] == pytest.approx(sum(v for k, v in host.items() if k != "total"))
    assert host["total"] > 0 and engine["queue_wait_seconds"] >= 0
    assert engine["decode"]["rounds"] == result["completion_tokens"] - 1
    assert engine["units"]["prefill"] >= 1 and engine["units"]["control"] == 0
    assert engine["decode"]["host_exposed_seconds"] <= host["total"]
    first = done["first_output_timing"]  # frozen at the first committed token: the prefill, no decode yet
    assert first["prefill"]["computed_tokens"] == result["computed_prefill_tokens"]
    assert first["prefill"]["units"] == engine["units"]["prefill"]
    assert 0 < first["elapsed_seconds"] <= timings["total"] and first["replay"]["units"] == 0
    assert first["elapsed_seconds"] == pytest.approx(first["initial_queue_seconds"] + first["resident_seconds"])
    # work: the device time of its prompt chunks (one interval each without a drafter; on the CPU, wall time)
    assert done["work"]["prefill_intervals"] == engine["units"]["prefill"] and done["work"]["gpu_seconds"] > 0
    assert set(done["context_transfers"]) == {"d2h", "h2d", "d2d"}

    tool_done = by_http_id(records, ids["tool"])[-1]
    assert tool_done["request"]["tool_count"] == 1
    assert tool_done["result"]["tool_call_count"] == 1
    assert tool_done["result"]["tool_call_parse"]["structured_call_count"] == 1
    assert by_http_id(records, ids["stream"])[-1]["request"]["stream"] is True

    cancelled = by_http_id(records, ids["cancelled"])[-1]
    assert cancelled["event"] == "request_error" and cancelled["error"]["kind"] == "cancellation"
    failed = by_http_id(records, ids["failed"])[-1]
    assert failed["event"] == "request_error" and failed["error"]["code"] == "engine_failure"


def test_scheduling_events_trace_pause_and_replay(campaign):
    events = [r for r in campaign["records"] if r["event"] == "request_scheduling"]
    kinds = [e["scheduling"]["kind"] for e in events]
    for kind in ("pause_started", "paused", "restore_started", "restored", "replay_complete", "terminal"):
        assert kind in kinds, kinds
    for request_id in {e["request"]["request_id"] for e in events}:  # each cycle's boundaries in order
        mine = [e["scheduling"] for e in events if e["request"]["request_id"] == request_id]
        cycle = [e["kind"] for e in mine if e["preemption_index"] == 1]
        cancelled_while_paused = ["pause_started", "paused", "terminal"]  # campaign["ids"]["paused_cancelled"]
        assert cycle[:4] == ["pause_started", "paused", "restore_started", "restored"] or \
            cycle == cancelled_while_paused, cycle
        assert [e["steady_ns"] for e in mine] == sorted(e["steady_ns"] for e in mine)
    for e in events:  # the request's share of each global counter ("global minus request": the others' work)
        own, total = e["progress"]["request"], e["progress"]["global"]
        assert all(0 <= own[k] <= total[k] for k in ("prefill", "decode", "replay")), e["progress"]
        assert own["decode"] == max(own["generated"] - 1, 0)
    replayed = next(e for e in events if e["scheduling"]["kind"] == "replay_complete")
    assert replayed["progress"]["request"]["replay"] > 0 and replayed["progress"]["request"]["prefill"] > 0
    paused = next(e for e in events if e["scheduling"]["kind"] == "paused")
    assert paused["scheduling"]["route"] == "replay" and paused["scheduling"]["preemption_index"] == 1
    done = [r for r in campaign["records"] if r["event"] == "request_done" and r["result"]["finish_reason"] == "length"]
    assert sum(r["scheduling"]["preemptions"] for r in done) >= 1
    # the preempted request's own pause work ("generation.scheduling"): replayed by rebuilding its committed state
    preempted = next(r for r in done if r["scheduling"]["preemptions"])
    scheduling = preempted["scheduling"]
    assert scheduling["replay_restores"] >= 1 and scheduling["replayed_tokens"] > 0 and scheduling["paused_seconds"] > 0
    assert preempted["engine_timing"]["units"]["control"] >= 1  # the replay chunks


def test_a_preempted_request_cancelled_while_paused_ends_with_a_terminal_boundary(campaign):
    """Contract, "Structured request log": request_scheduling records a terminal boundary for preempted
    requests; cancellation excuses only recovery_complete. The engine's own terminal goes to a stream the client
    closed, so the router writes it, before request_error, dated after the last boundary on the engine's clock."""
    mine = by_http_id(campaign["records"], campaign["ids"]["paused_cancelled"])
    kinds = [r["scheduling"]["kind"] if r["event"] == "request_scheduling" else r["event"] for r in mine]
    assert "pause_started" in kinds and kinds[-2:] == ["terminal", "request_error"], kinds
    assert mine[-1]["error"]["code"] == "cancelled"
    boundaries = [r["scheduling"] for r in mine if r["event"] == "request_scheduling"]
    assert boundaries[-1]["steady_ns"] >= boundaries[-2]["steady_ns"] and boundaries[-1]["route"] is None
    assert boundaries[-1]["preemption_index"] == max(b["preemption_index"] for b in boundaries)


def test_server_start_and_throughput(campaign):
    start = campaign["records"][0]
    assert start["event"] == "server_start" and start["process"]["role"] == "server"
    assert start["server"]["api_key_configured"] is True and start["artifact"]["architecture"] == "scripted"
    assert "--api-key" in start["argv"] and "<redacted>" in start["argv"]
    # the engine in this process: its arenas (server_start "Device arenas"), formats and environment
    memory = start["memory"]
    assert memory["device"] == "cpu" and memory["workspace"] is None and memory["vision_workspace"] is None
    arenas = memory["arenas_bytes"]
    assert arenas["main_kv"] > 0 and arenas["drafter_weights"] == arenas["vision_weights"] == arenas["backend_kv"] == 0
    kv_bytes = start["resources"]["kv_pages_capacity"] * start["engine"]["page_size"]  # bytes a token, over layers
    assert arenas["main_kv"] % kv_bytes == 0
    assert start["formats"]["kv_cache"] == "bf16" and start["formats"]["prefill"]["chunk_tokens"] > 0
    assert start["environment"]["torch"] == torch.__version__ and start["environment"]["gpu"] is None
    costs = start["context_cost"]  # no --context-cost-presets: the generic coefficients, named as such
    assert costs["transfer_source"] == costs["prefill_source"] == "generic" and costs["prefill_tokens_per_s"] > 0
    (throughput,) = [r for r in campaign["records"] if r["event"] == "throughput"]
    assert throughput["tokens"]["committed_decode"] > 0 and throughput["interval_seconds"] == 2.5
    work = throughput["host_work"]
    assert work["elapsed_seconds"]["total"] == pytest.approx(
        sum(v for k, v in work["elapsed_seconds"].items() if k != "total"))
    # the request log's own bookkeeping on the engine thread, a subset of the phases (never in total)
    assert 0 < work["detail_subset_seconds"]["request_observation"] < work["elapsed_seconds"]["total"]
    assert work["per_row_round_seconds"]["host"] == pytest.approx(
        work["elapsed_seconds"]["total"] / throughput["decode_batch"]["row_rounds"])
    assert throughput["scheduler"]["terminal_pending"] == 0  # every answer was written
    assert throughput["context_cache"]["last_selection"]["outcome"] in ("hit", "miss")


def test_no_secrets_prompts_or_outputs_in_any_log(campaign):
    jsonl = campaign["path"].read_text()
    stderr = campaign["stderr"]
    for text in (jsonl, stderr):
        assert KEY not in text and PLANTED_PROMPT not in text and PLANTED_OUTPUT not in text
        assert "word word" not in text and OUTPUTS["COUNT"][0] not in text


def test_stderr_records_cover_the_lifecycle(campaign):
    lines = campaign["stderr"].splitlines()
    assert lines and all(RECORD.match(line) for line in lines), lines[:5]
    assert "\x1b" not in campaign["stderr"]
    ids = campaign["ids"]
    text = campaign["stderr"]
    assert f"{ids['done']} openai_chat start:" in text and f"{ids['done']} done stop:" in text
    assert f"{ids['rejected']} openai_chat rejected: 400 context_length_exceeded" in text
    assert f"{ids['cancelled']} cancelled:" in text and f"{ids['failed']} error: engine_failure" in text
    assert ids["invalid"] not in text
    assert "throughput: prefill" in text and "engine step failed" in text


# ---- media preparation in request_start ------------------------------------------------------------
#
# serving.md, "Structured request log": "Successful request-start records include request-scoped
# acquisition, media-preprocessing wall/work, tokenizer, cache hit/miss/single-flight, and payload-size
# fields; they do not infer request behavior from process-global counter deltas." And "Multimodal request":
# prepared payloads are keyed by SHA-256 of the acquired bytes plus modality, so repeated media in later
# requests reuses the prepared input, and concurrent identical misses use one single-flight build.


def png(seed: int, size: int = 256) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def png_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


IMAGE, TWIN = png(1), png(2)  # 256x256: grid (1, 16, 16), 256 raw patches, 64 Vision tokens
IMAGE_PAYLOAD = {"items": 1, "source_bytes": len(IMAGE), "decoded_pixels": 256 * 256,
                 "payload_bytes": 256 * 1536 * 2, "raw_patches": 256, "vision_tokens": 64}
NO_MEDIA = {"items": 0, "cache": {"hits": 0, "misses": 0, "single_flight_joins": 0}, "source_bytes": 0,
            "decoded_pixels": 0, "payload_bytes": 0, "raw_patches": 0, "vision_tokens": 0}
BUILD_DELAY_S = 1.0  # a miss's build held open long enough for an identical item to join it


def image_message(*images: bytes, text: str = "What is this?") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": png_uri(data)}} for data in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def media_campaign(artifacts_dir, tmp_path_factory):
    """A --vision server (tiny Qwen3.6 with its tower, CPU fp32) logging to JSONL: an image (a miss), the
    same image again through Responses (a hit), a text-only request, then one request carrying a new
    image twice while the first build is held open (a miss and a single-flight join)."""
    path = artifacts_dir / "tiny-qwen3.6-vision.ninfer"
    if not path.exists():
        write_preset("tiny-qwen3.6", path, vision=True)
    log_path = tmp_path_factory.mktemp("media") / "requests.jsonl"
    cfg = ServerConfig(artifact=str(path), max_context=1024, page_size=16, vision=True, greedy=True, dtype="fp32",
                       request_log_jsonl=str(log_path))
    engine = load_engine(path, engine_settings(cfg), device=torch.device("cpu"), dtype="fp32")
    media = MediaPreprocessor(64, 256, 2)
    ctx = replace(base_context(path), config=cfg, engine=LocalEngineClient(engine), max_model_len=cfg.max_model_len,
                  chat_defaults=ChatDefaults(vision=True), media=LocalMediaClient(media))
    live = LiveServer(ctx, engine)
    ids: dict[str, str] = {}
    try:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)

        def chat(name: str, messages: list[dict]) -> None:
            raw = client.chat.completions.with_raw_response.create(model=ctx.model_id, max_tokens=4, messages=messages)
            assert raw.parse().usage.completion_tokens == 4
            ids[name] = raw.headers["x-request-id"]

        chat("miss", image_message(IMAGE))
        raw = client.responses.with_raw_response.create(model=ctx.model_id, max_output_tokens=16, input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": png_uri(IMAGE), "detail": "auto"},
                                         {"type": "input_text", "text": "And now?"}]}])
        assert raw.parse().usage.input_tokens > 64
        ids["hit"] = raw.headers["x-request-id"]
        chat("text", [{"role": "user", "content": "Hello there"}])

        build = media_preprocessor.prepare_image

        def slow_build(*args, **kwargs):
            time.sleep(BUILD_DELAY_S)
            return build(*args, **kwargs)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(media_preprocessor, "prepare_image", slow_build)
            chat("joined", image_message(TWIN, TWIN))
        assert media.snapshot()["leases"] == 0
    finally:
        live.stop()
        media.close()
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    return {"records": records, "ids": ids}


def start_of(records: list[dict], http_id: str) -> dict:
    (start,) = [r for r in by_http_id(records, http_id) if r["event"] == "request_start"]
    return start


def test_media_records_validate_against_the_schema(media_campaign):
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text()))
    for record in media_campaign["records"]:
        errors = sorted(validator.iter_errors(record), key=str)
        assert not errors, (record["event"], [e.message for e in errors[:3]])
    events = Counter(r["event"] for r in media_campaign["records"])
    assert events["request_start"] == events["request_done"] == 4 and events["request_rejected"] == 0


def test_a_first_image_is_a_cache_miss_with_its_preparation_seconds(media_campaign):
    start = start_of(media_campaign["records"], media_campaign["ids"]["miss"])
    assert start["request"]["media_item_count"] == 1
    assert start["media"] == {**IMAGE_PAYLOAD, "cache": {"hits": 0, "misses": 1, "single_flight_joins": 0}}
    prep = start["preparation_seconds"]
    for name, seconds in prep.items():
        assert isinstance(seconds, float) and math.isfinite(seconds), (name, seconds)
    for name in ("total", "media_acquisition", "media_preprocess_wall", "media_preprocess_work", "tokenizer"):
        assert prep[name] > 0, (name, prep)
    # one item: the preprocessor's wall covers its acquisition and decode/resize/pack work; the router's
    # preparation total covers the preprocessor's wall and the prompt build
    assert prep["media_acquisition"] + prep["media_preprocess_work"] <= prep["media_preprocess_wall"]
    assert prep["media_preprocess_wall"] + prep["tokenizer"] <= prep["total"]


def test_the_same_image_again_is_a_cache_hit_without_preprocessing_work(media_campaign):
    start = start_of(media_campaign["records"], media_campaign["ids"]["hit"])
    assert start["request"]["protocol"] == "openai_responses"  # every generation protocol logs media
    assert start["media"] == {**IMAGE_PAYLOAD, "cache": {"hits": 1, "misses": 0, "single_flight_joins": 0}}
    prep = start["preparation_seconds"]
    assert prep["media_preprocess_work"] == 0.0  # the prepared payload was reused, nothing decoded
    assert math.isfinite(prep["media_preprocess_wall"]) and prep["media_preprocess_wall"] > 0
    assert prep["media_acquisition"] > 0 and prep["tokenizer"] > 0  # the bytes are still acquired and hashed


def test_a_text_only_request_logs_zero_media(media_campaign):
    start = start_of(media_campaign["records"], media_campaign["ids"]["text"])
    assert start["request"]["media_item_count"] == 0 and start["media"] == NO_MEDIA
    prep = start["preparation_seconds"]
    assert {k: v for k, v in prep.items() if k.startswith("media_")} == {
        "media_acquisition": 0.0, "media_gate_wait": 0.0, "media_preprocess_wall": 0.0, "media_preprocess_work": 0.0}
    assert prep["total"] > 0 and prep["tokenizer"] > 0


def test_an_identical_item_during_a_build_joins_it(media_campaign):
    """Two copies of one new image in one request: one build (a miss), and the copy waits on it."""
    start = start_of(media_campaign["records"], media_campaign["ids"]["joined"])
    assert start["media"]["items"] == 2 and start["media"]["payload_bytes"] == 2 * IMAGE_PAYLOAD["payload_bytes"]
    assert start["media"]["cache"] == {"hits": 0, "misses": 1, "single_flight_joins": 1}
    prep = start["preparation_seconds"]
    # work counts the one build; the joined copy waited on it and did none
    assert BUILD_DELAY_S <= prep["media_preprocess_work"] < 2 * BUILD_DELAY_S
    assert prep["media_preprocess_wall"] >= BUILD_DELAY_S


def test_the_text_campaign_logs_zero_media(campaign):
    """The scripted server has no --vision: every request_start still carries the media fields, all zero."""
    starts = [r for r in campaign["records"] if r["event"] == "request_start"]
    assert starts and all(r["media"] == NO_MEDIA for r in starts)
    assert all(r["preparation_seconds"]["tokenizer"] > 0 for r in starts)


def test_request_done_times_the_vision_encode(media_campaign):
    """Contract (structured request log): request_done.timings_seconds.vision is the request's own vision
    encode time: positive where the engine encoded its image, zero for a text-only request."""
    def done(name):
        (rec,) = [r for r in by_http_id(media_campaign["records"], media_campaign["ids"][name])
                  if r["event"] == "request_done"]
        return rec["timings_seconds"]

    miss, text = done("miss"), done("text")
    assert 0 < miss["vision"] < miss["total"]
    assert text["vision"] == 0.0
    assert text["speculative"]["backend"] is None and text["speculative"]["rounds"] == 0


def test_a_vision_server_logs_its_tower_and_vision_bounds(media_campaign):
    (start,) = [r for r in media_campaign["records"] if r["event"] == "server_start"]
    memory = start["memory"]
    assert memory["arenas_bytes"]["vision_weights"] > 0 and memory["arenas_bytes"]["weights"] > 0
    assert memory["vision_workspace"]["request_token_bound"] > 0
    assert memory["vision_workspace"]["prompt_token_bound"] == start["engine"]["max_context"]
