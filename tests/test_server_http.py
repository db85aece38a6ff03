"""The HTTP edge with raw httpx: SSE framing, request ids, auth, CORS, body limit, admission errors,
keep-alive, and cancellation when the client disconnects."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import pytest
from server_fixtures import (
    MODEL,
    LiveServer,
    base_context,
    scripted_artifact,
    scripted_engine,
    start_server,
    wait_until,
)

from ninfer.config import ServerConfig
from ninfer.server.engine_client import LocalEngineClient
from ninfer.server.sse import KEEPALIVE, with_keepalive


@pytest.fixture(scope="module")
def path(artifacts_dir, qwen_tokenizer):
    return scripted_artifact(artifacts_dir, qwen_tokenizer)


@pytest.fixture(scope="module")
def server(path, qwen_tokenizer):
    live = start_server(path, qwen_tokenizer)
    yield live
    live.stop()


def body(keyword: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": keyword}], **extra}


def sse_events(text: str) -> list[str]:
    """The data payloads of an SSE body; asserts every frame is `data: ...` followed by a blank line."""
    assert text.endswith("\n\n")
    frames = [f for f in text.split("\n\n") if f]
    assert all(f.startswith("data: ") and "\n" not in f for f in frames if not f.startswith(":")), frames
    return [f[len("data: "):] for f in frames if f.startswith("data: ")]


def test_stream_framing_order_and_headers(server):
    r = httpx.post(server.url + "/v1/chat/completions", json=body("ALPHA", stream=True, return_progress=True,
                                                                    timings_per_token=True), timeout=30)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-request-id"].startswith("req_") and r.headers["cache-control"] == "no-cache"
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    progress = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
    assert progress[0]["processed"] == progress[0]["cache"] and progress[-1]["processed"] == progress[-1]["total"]
    first_output = next(i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["delta"].get(
        "reasoning_content"))
    assert max(i for i, c in enumerate(chunks) if "prompt_progress" in c) < first_output
    visible = [c for c in chunks[1:] if c["choices"] and ({"reasoning_content", "content"} & set(c["choices"][0]["delta"]))]
    counts = [c["timings"]["predicted_n"] for c in visible]
    assert counts == sorted(counts) and counts[-1] > 0
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and "timings" in chunks[-1]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_per_token_timings_are_the_terminal_timings_clock(server):
    """Contract, "llama.cpp-compatible request observations": each visible chunk carries the latest cumulative
    snapshot, prompt time ending at the first committed token. So once output shows, every snapshot's prompt_ms is
    the terminal one, and generation time only grows up to the terminal figure (both the engine's clock, not the
    router's arrival times, which put ~0 ms of prompt on a first token that arrived with the progress events)."""
    r = httpx.post(server.url + "/v1/chat/completions", json=body("ALPHA", stream=True, timings_per_token=True),
                   timeout=30)
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    final = chunks[-1]["timings"]
    snapshots = [c["timings"] for c in chunks[1:-1] if "timings" in c]
    assert len(snapshots) >= 2 and final["prompt_ms"] > 0
    assert {t["prompt_ms"] for t in snapshots} == {final["prompt_ms"]}
    predicted = [t["predicted_ms"] for t in snapshots]
    assert predicted == sorted(predicted) and predicted[-1] <= final["predicted_ms"]
    assert all(t["prompt_n"] == final["prompt_n"] and t["cache_n"] == final["cache_n"] for t in snapshots)


def test_every_response_has_a_unique_request_id(server):
    ids = set()
    for method, url, kwargs in [("GET", "/v1/models", {}), ("GET", "/health", {}),
                                ("POST", "/v1/chat/completions", {"json": body("ALPHA", model="x")}),
                                ("POST", "/v1/chat/completions", {"content": b"{not json"}),
                                ("GET", "/v1/nowhere", {}),
                                ("POST", "/v1/chat/completions", {"json": body("ALPHA", max_tokens=3)})]:
        r = httpx.request(method, server.url + url, timeout=30, **kwargs)
        ids.add(r.headers["x-request-id"])
    assert len(ids) == 6


def test_accepted_connections_use_keepalive_and_a_user_timeout(server):
    """Contract, "Endpoints": on Linux an accepted connection uses TCP keepalive and a 15 s TCP_USER_TIMEOUT.
    The server's end of a live keep-alive connection is found among this process's sockets and read back."""
    if not hasattr(socket, "TCP_USER_TIMEOUT"):
        pytest.skip("TCP_USER_TIMEOUT is Linux's")
    with socket.create_connection(("127.0.0.1", server.port)) as client:
        client.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert client.recv(4096).startswith(b"HTTP/1.1 200")
        with _accepted_end(client.getsockname()) as accepted:
            assert accepted.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 15_000
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 5


def _accepted_end(peer) -> socket.socket:
    """A duplicate of this process's TCP socket whose peer is `peer` (the server thread's end of a connection)."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):  # every socket first: the duplicates below take new numbers
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                fds.append(int(fd))
        except OSError:
            continue
    found = []
    for fd in fds:
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.family == socket.AF_INET and sock.getpeername() == peer:
                found.append(sock)
                continue
        except OSError:
            pass
        sock.close()
    assert len(found) == 1, found
    return found[0]


def test_auto_capacity_models_report_the_engines_pool(path, qwen_tokenizer):
    """Contract: GET /v1/models reports the effective max_model_len. With --kv-capacity auto only the engine knows
    its pool (sized from free device memory): the router asks it. Here the engine's pool is 256 tokens, as a GPU
    with little memory left would size it, below --max-context 4096."""
    router_cfg = ServerConfig(artifact=str(path), max_context=4096, page_size=16, max_concurrency=2, kv_capacity="auto")
    engine = scripted_engine(path, qwen_tokenizer, router_cfg.model_copy(update={"kv_capacity": 256}))
    ctx = replace(base_context(path), config=router_cfg, engine=LocalEngineClient(engine),
                  max_model_len=router_cfg.max_model_len)
    live = LiveServer(ctx, engine)
    try:
        assert ctx.max_model_len == 4096  # what the options alone say
        listed = httpx.get(live.url + "/v1/models", timeout=10).json()["data"][0]
        one = httpx.get(live.url + f"/v1/models/{MODEL}", timeout=10).json()
        assert listed["max_model_len"] == one["max_model_len"] == 256
    finally:
        live.stop()


def test_error_bodies_use_the_openai_shape(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.get(server.url + "/v1/nowhere", timeout=10)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(server.url + "/v1/chat/completions", json=body("word " * 5000), timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert err["max_context"] == 4096 and err["prompt_tokens"] > 4096


def test_health_ok_and_unavailable(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    server.engine.healthy = False  # what an engine-wide failure leaves behind
    try:
        r = httpx.get(server.url + "/health")
        assert r.status_code == 503 and r.json() == {"status": "unavailable"}
    finally:
        server.engine.healthy = True


def test_client_disconnect_cancels_and_frees_pages(server):
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/chat/completions",
                         json=body("LONG", stream=True, max_tokens=2500)) as r:
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
            assert server.engine.snapshot()["running"] == 1
    # leaving the block closed the connection mid-stream; only retained prefixes may still hold pages
    engine = server.engine
    assert wait_until(lambda: engine.snapshot()["running"] == 0), engine.snapshot()
    assert engine.snapshot()["kv_pages_used"] == engine.cache.held_pages
    assert engine.snapshot()["requests"].get("cancelled", 0) >= 1


def test_auth_cors_and_body_limit(path, qwen_tokenizer):
    live = start_server(path, qwen_tokenizer, api_key="sekrit", cors=True, max_request_mib=1)
    try:
        url = live.url
        assert httpx.get(url + "/health").status_code == 200  # open without a key
        r = httpx.get(url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key" and "x-request-id" in r.headers
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200
        assert httpx.get(url + "/v1/models", headers={"x-api-key": "sekrit"}).status_code == 200
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        pre = httpx.options(url + "/v1/chat/completions", headers={
            "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] in ("*", "http://app.example")
        r = httpx.get(url + "/v1/models", headers={"Origin": "http://app.example", "x-api-key": "sekrit"})
        assert r.headers["access-control-allow-origin"] == "*"
        big = b'{"model": "' + b"x" * (1024 * 1024) + b'"}'
        r = httpx.post(url + "/v1/chat/completions", content=big, headers={"x-api-key": "sekrit"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():  # no content-length: the limit is counted on the streamed bytes
            for _ in range(20):
                yield b" " * 65536

        r = httpx.post(url + "/v1/chat/completions", content=chunks(), headers={"x-api-key": "sekrit"})
        assert r.status_code == 413
    finally:
        live.stop()


def test_overload_and_queue_timeout_even_for_a_stream(path, qwen_tokenizer):
    """Contract, "Execution behavior": capacity is max_concurrency + max_pending_requests (429 server_overloaded
    beyond it) and a request not admitted within --pending-timeout-ms gets HTTP 503 request_queue_timeout; a
    stream's answer waits for admission, so a queued stream gets that status too, not a 200."""
    live = start_server(path, qwen_tokenizer, max_concurrency=1, max_pending_requests=1, pending_timeout_ms=1500,
                        keepalive_s=0.2)
    try:
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", live.url + "/v1/chat/completions",
                             json=body("LONG", stream=True, max_tokens=2500)) as running:
                lines = running.iter_lines()  # held: a dropped line iterator closes the response
                next(lines)
                with ThreadPoolExecutor(1) as pool:
                    waiting = pool.submit(httpx.post, live.url + "/v1/chat/completions",
                                          json=body("ALPHA", stream=True), timeout=30)
                    assert wait_until(lambda: live.engine.snapshot()["waiting"] == 1)
                    r = httpx.post(live.url + "/v1/chat/completions", json=body("ALPHA"), timeout=30)
                    assert r.status_code == 429 and r.json()["error"]["code"] == "server_overloaded"
                    queued = waiting.result()
                assert queued.status_code == 503, queued.text
                assert queued.json()["error"]["code"] == "request_queue_timeout"
                assert queued.headers["x-request-id"]
                r = httpx.post(live.url + "/v1/chat/completions", json=body("ALPHA"), timeout=30)
                assert r.status_code == 503 and r.json()["error"]["code"] == "request_queue_timeout"
    finally:
        live.stop()


def test_keepalive_wrapper_keeps_the_source_alive():
    async def slow():
        yield b"a"
        await asyncio.sleep(0.35)
        yield b"b"

    async def collect():
        return [f async for f in with_keepalive(slow(), 0.1)]

    frames = asyncio.run(collect())
    assert frames[0] == b"a" and frames[-1] == b"b" and frames.count(KEEPALIVE) >= 2
