"""The Anthropic edge with raw httpx: SSE framing and block lifecycle, request ids, error bodies, auth,
admission errors (529, 504), keep-alive, context exhaustion, Claude Code's default request shape, and
cancellation when the client disconnects."""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import pytest
from anthropic_fixtures import MODEL, TIME, WEATHER, start_anthropic_server
from server_fixtures import wait_until

from ninfer.protocol.anthropic_errors import anthropic_error
from ninfer.protocol.errors import ProtocolError
from ninfer.protocol.reasoning_seal import unseal


@pytest.fixture(scope="module")
def server(artifacts_dir, qwen_tokenizer):
    live = start_anthropic_server(artifacts_dir, qwen_tokenizer)
    yield live
    live.stop()


def body(keyword: str, **extra) -> dict:
    return {"model": MODEL, "max_tokens": 300, "messages": [{"role": "user", "content": keyword}], **extra}


def sse_events(text: str) -> list[tuple[str, dict]]:
    """(event, data) of an Anthropic SSE body; asserts the framing and that each data names its event."""
    assert text.endswith("\n\n")
    events = []
    for frame in text.split("\n\n"):
        if not frame or frame.startswith(":"):
            continue
        name, data = frame.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), frame
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == name[len("event: "):]
        events.append((payload["type"], payload))
    return events


def check_lifecycle(events: list[tuple[str, dict]]) -> list[dict]:
    """Asserts the block lifecycle and returns the blocks as a client would assemble them."""
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    blocks: list[dict] = []
    open_index = None
    for name, ev in events[1:-2]:
        if name == "content_block_start":
            assert open_index is None and ev["index"] == len(blocks)
            open_index = ev["index"]
            blocks.append({**ev["content_block"], "json": ""})
        elif name == "content_block_delta":
            assert ev["index"] == open_index
            block, delta = blocks[open_index], ev["delta"]
            assert not block.get("signature"), "nothing follows a thinking block's signature"
            key = {"thinking_delta": "thinking", "signature_delta": "signature", "text_delta": "text",
                   "input_json_delta": "json"}[delta["type"]]
            field = {"json": "partial_json"}.get(key, key)
            block[key] = block.get(key, "") + delta[field]
        else:
            assert name == "content_block_stop" and ev["index"] == open_index
            if blocks[open_index]["type"] == "thinking":
                assert blocks[open_index]["signature"], "a thinking block closes after its signature"
            open_index = None
    assert open_index is None
    return blocks


def test_stream_framing_and_block_lifecycle(server):
    r = httpx.post(server.url + "/v1/messages", json=body("TWO_CALLS", stream=True, tools=[WEATHER, TIME]),
                   timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["request-id"].startswith("req_") and r.headers["cache-control"] == "no-cache"
    assert "x-request-id" not in r.headers
    events = sse_events(r.text)
    blocks = check_lifecycle(events)
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use", "tool_use"]
    assert unseal(blocks[0]["signature"]) == blocks[0]["thinking"] == "Two lookups.\n"
    assert blocks[1]["text"] == "Checking both."
    assert [(b["name"], json.loads(b["json"])) for b in blocks[2:]] == [("get_weather", {"city": "Paris"}),
                                                                        ("get_time", {"city": "Paris"})]
    start, delta = events[0][1]["message"], events[-2][1]
    assert start["content"] == [] and start["stop_reason"] is None and start["model"] == MODEL
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    aggregate = httpx.post(server.url + "/v1/messages", json=body("TWO_CALLS", tools=[WEATHER, TIME]),
                           timeout=30).json()
    assert [b.get("text") for b in aggregate["content"]][:2] == [None, "Checking both."]
    assert aggregate["usage"]["output_tokens"] == delta["usage"]["output_tokens"]


def test_message_start_carries_the_exact_cached_split(server):
    request = body("ALPHA", system="A long and stable system prompt. " * 10)
    httpx.post(server.url + "/v1/messages", json=request, timeout=30)
    r = httpx.post(server.url + "/v1/messages", json={**request, "stream": True}, timeout=30)
    events = sse_events(r.text)
    start, final = events[0][1]["message"]["usage"], events[-2][1]["usage"]
    assert start["cache_read_input_tokens"] >= 16 and start["output_tokens"] == 0
    for key in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"):
        assert start[key] == final[key], key


def test_every_response_has_a_request_id_and_errors_carry_it(server):
    url = server.url
    seen = set()
    for method, path, kwargs, status, kind in [
        ("POST", "/v1/messages", {"json": body("ALPHA")}, 200, None),
        ("POST", "/v1/messages?beta=true", {"json": body("ALPHA", stream=True)}, 200, None),
        ("POST", "/v1/messages/count_tokens?beta=true", {"json": body("ALPHA")}, 200, None),
        ("POST", "/v1/messages", {"content": b"{oops"}, 400, "invalid_request_error"),
        ("POST", "/v1/messages", {"json": body("ALPHA", max_tokens=0)}, 400, "invalid_request_error"),
        ("GET", "/v1/messages/batches", {}, 404, "not_found_error"),
        ("GET", "/v1/messages", {}, 405, "invalid_request_error"),
    ]:
        r = httpx.request(method, url + path, timeout=30, **kwargs)
        assert r.status_code == status, (path, r.text)
        request_id = r.headers["request-id"]
        seen.add(request_id)
        if kind:
            assert r.json() == {"type": "error", "error": {"type": kind, "message": r.json()["error"]["message"]},
                                "request_id": request_id}
    assert len(seen) == 7


@pytest.mark.parametrize("code,status,anthropic_status,category", [
    ("invalid_value", 400, 400, "invalid_request_error"),
    ("invalid_api_key", 401, 401, "authentication_error"),
    ("not_found", 404, 404, "not_found_error"),
    ("request_too_large", 413, 413, "request_too_large"),
    ("server_overloaded", 429, 529, "overloaded_error"),
    ("request_queue_timeout", 503, 504, "timeout_error"),
    ("engine_unavailable", 503, 503, "api_error"),
    ("internal_error", 500, 500, "api_error"),
])
def test_error_categories(code, status, anthropic_status, category):
    assert anthropic_error(ProtocolError("m", code=code, status=status), "req_1") == (
        anthropic_status, {"type": "error", "error": {"type": category, "message": "m"}, "request_id": "req_1"})


def test_x_api_key_or_bearer_authenticates_every_route(artifacts_dir, qwen_tokenizer):
    live = start_anthropic_server(artifacts_dir, qwen_tokenizer, api_key="sekrit")
    try:
        for path in ("/v1/messages?beta=true", "/v1/messages/count_tokens?beta=true"):
            r = httpx.post(live.url + path, json=body("ALPHA"), timeout=30)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert r.json()["request_id"] == r.headers["request-id"]
            for headers in ({"x-api-key": "sekrit"}, {"Authorization": "Bearer sekrit"}):
                assert httpx.post(live.url + path, json=body("ALPHA"), headers=headers, timeout=30).status_code == 200
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=live.url, api_key="wrong", max_retries=0).messages.create(
                model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "ALPHA"}])
        good = anthropic.Anthropic(base_url=live.url, api_key="sekrit", max_retries=0)
        assert good.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "ALPHA"}]).input_tokens
        assert httpx.get(live.url + "/health").status_code == 200
    finally:
        live.stop()


def test_overload_is_529_and_queue_timeout_is_504_even_for_a_stream(artifacts_dir, qwen_tokenizer, tmp_path):
    """Contract, "Execution behavior" in Anthropic's error shape: a full capacity is 529 overloaded_error and a
    request not admitted in time is 504 timeout_error, a queued stream too (its answer waits for admission).
    The request log's request_rejected carries the status and type the client received ("Structured request
    log")."""
    request_log = tmp_path / "requests.jsonl"
    live = start_anthropic_server(artifacts_dir, qwen_tokenizer, max_concurrency=1, max_pending_requests=1,
                                  pending_timeout_ms=1500, keepalive_s=0.2, request_log_jsonl=str(request_log))
    try:
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", live.url + "/v1/messages",
                             json=body("LONG", stream=True, max_tokens=2500)) as running:
                lines = running.iter_lines()  # held: a dropped line iterator closes the response
                next(lines)
                with ThreadPoolExecutor(1) as pool:
                    waiting = pool.submit(httpx.post, live.url + "/v1/messages", json=body("ALPHA", stream=True),
                                          timeout=30)
                    assert wait_until(lambda: live.engine.snapshot()["waiting"] == 1)
                    sdk = anthropic.Anthropic(base_url=live.url, api_key="k", max_retries=0)
                    with pytest.raises(anthropic.OverloadedError) as err:
                        sdk.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "A"}])
                    assert err.value.status_code == 529 and err.value.body["error"]["type"] == "overloaded_error"
                    queued = waiting.result()
                assert queued.status_code == 504, queued.text
                assert queued.json() == {"type": "error", "error": {
                    "type": "timeout_error", "message": queued.json()["error"]["message"]},
                    "request_id": queued.headers["request-id"]}
                r = httpx.post(live.url + "/v1/messages", json=body("ALPHA"), timeout=30)
                assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"
        rejected = [json.loads(line) for line in request_log.read_text().splitlines()
                    if json.loads(line)["event"] == "request_rejected"]
        assert [(r["error"]["status"], r["error"]["type"], r["error"]["code"]) for r in rejected] == [
            (529, "overloaded_error", "server_overloaded")]
    finally:
        live.stop()


def test_context_exhaustion_is_model_context_window_exceeded(artifacts_dir, qwen_tokenizer):
    live = start_anthropic_server(artifacts_dir, qwen_tokenizer, max_context=64)
    try:
        r = httpx.post(live.url + "/v1/messages", json=body("LONG", max_tokens=1000), timeout=30)
        assert r.json()["stop_reason"] == "model_context_window_exceeded"
        usage = r.json()["usage"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["output_tokens"] == 64
        r = httpx.post(live.url + "/v1/messages", json=body("LONG", max_tokens=1000, stream=True), timeout=30)
        assert sse_events(r.text)[-2][1]["delta"]["stop_reason"] == "model_context_window_exceeded"
        r = httpx.post(live.url + "/v1/messages", json=body("word " * 100), timeout=30)
        error = r.json()["error"]
        assert r.status_code == 400 and error["type"] == "invalid_request_error"
        assert "more than the context limit of 64 tokens" in error["message"]
    finally:
        live.stop()


def test_claude_code_default_request(artifacts_dir, qwen_tokenizer, caplog, tmp_path):
    """What Claude Code sends by default: query string, beta headers, billing block, cache marks, a 31999
    thinking budget under max_tokens 32000, a JSON user id, context management, rich tool schemas."""
    request_log = tmp_path / "requests.jsonl"
    live = start_anthropic_server(artifacts_dir, qwen_tokenizer, max_context=33000,
                                  request_log_jsonl=str(request_log))
    cc = {"type": "ephemeral"}
    request = {
        "model": "claude-sonnet-4-5-20250929", "max_tokens": 32000, "stream": True,
        "thinking": {"type": "enabled", "budget_tokens": 31999},
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.0.14.abc; cc_entrypoint=cli;"},
                   {"type": "text", "text": "You are Claude Code.", "cache_control": cc},
                   {"type": "text", "text": "\nBe concise.", "cache_control": cc}],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>context</system-reminder>"},
            {"type": "text", "text": "ALPHA", "cache_control": cc}]}],
        "tools": [{"name": "Bash", "description": "Run a command",
                   "input_schema": {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                                    "properties": {"command": {"type": "string"},
                                                   "timeout": {"type": "number", "maximum": 600000}},
                                    "required": ["command"], "additionalProperties": False}}],
        "metadata": {"user_id": json.dumps({"device_id": "d", "account_uuid": "", "session_id": "s"})},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    }
    headers = {"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
               "anthropic-version": "2023-06-01", "x-app": "cli", "x-claude-code-session-id": "s",
               "x-api-key": "anything"}
    try:
        with caplog.at_level(logging.INFO, logger="ninfer.server"):
            r = httpx.post(live.url + "/v1/messages?beta=true", json=request, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        blocks = check_lifecycle(sse_events(r.text))
        assert [b["type"] for b in blocks] == ["thinking", "text"] and blocks[1]["text"] == "The answer is 4."
        assert sse_events(r.text)[0][1]["message"]["model"] == "claude-sonnet-4-5-20250929"
        assert any("thinking budget 31999 lowered to" in rec.getMessage() for rec in caplog.records)
        records = [json.loads(line) for line in request_log.read_text().splitlines()]
        start = next(r for r in records if r.get("event") == "request_start")
        assert start["request"]["protocol"] == "anthropic_messages"
        assert start["request"]["requested_output_tokens"] == 32000
        assert 31900 < start["request"]["thinking_budget"] < 31999  # lowered just enough, max_tokens kept
    finally:
        live.stop()


def test_client_disconnect_cancels_and_frees_pages(server):
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/messages", json=body("LONG", stream=True, max_tokens=2500)) as r:
            lines = r.iter_lines()
            for _ in range(8):
                next(lines)
            assert server.engine.snapshot()["running"] == 1
    engine = server.engine
    assert wait_until(lambda: engine.snapshot()["running"] == 0), engine.snapshot()
    assert engine.snapshot()["kv_pages_used"] == engine.cache.held_pages
