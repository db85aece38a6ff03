"""The request lifetime capacity (contract, "Execution behavior"): max_concurrency + max_pending_requests slots
held from before preparation until the answer is released, and an admission deadline that counts from the
reservation. The ledger on a controlled clock, then through HTTP with a slow preparation."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_fixtures import MODEL, scripted_artifact, start_server, wait_until

from ninfer.engine.request_slots import RELEASE_GRACE_S, UNCLAIMED_GRACE_S, RequestSlots
from ninfer.engine.types import InvalidRequestError, QueueTimeoutError, ServerOverloadedError
from ninfer.server import generation


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_reserved_slots_count_until_released_and_direct_submits_until_finished():
    clock = Clock()
    slots = RequestSlots(limit=2, timeout_s=1.0, clock=clock)
    slots.reserve("a")  # preparing
    assert slots.claim("direct") == pytest.approx(101.0)  # an engine user that never reserved
    with pytest.raises(ServerOverloadedError):
        slots.reserve("b")
    slots.finished("direct")  # a direct submit's slot ends with the request
    slots.reserve("b")
    assert slots.claim("a") == pytest.approx(101.0)  # the deadline counts from the reservation
    with pytest.raises(InvalidRequestError):
        slots.claim("a")
    slots.finished("a")  # done in the engine, but its answer is not written yet: still held
    with pytest.raises(ServerOverloadedError):
        slots.reserve("c")
    slots.release("a")
    slots.release("a")  # idempotent
    slots.reserve("c")
    assert len(slots) == 2


def test_a_reservation_past_its_deadline_is_a_queue_timeout_at_submit():
    clock = Clock()
    slots = RequestSlots(limit=4, timeout_s=1.0, clock=clock)
    slots.reserve("slow")
    clock.now += 1.0  # preparation used the whole wait
    with pytest.raises(QueueTimeoutError):
        slots.claim("slow")
    assert len(slots) == 1  # still the router's until it releases


def test_stale_slots_of_a_vanished_router_are_dropped_only_when_capacity_runs_out():
    clock = Clock()
    slots = RequestSlots(limit=2, timeout_s=1.0, clock=clock)
    slots.reserve("never-submitted")
    slots.reserve("never-released")
    slots.claim("never-released")
    slots.finished("never-released")
    clock.now += 1.0 + UNCLAIMED_GRACE_S + 0.1
    slots.reserve("x")  # the unclaimed reservation went
    slots.claim("x")  # x runs in the engine from here on
    with pytest.raises(ServerOverloadedError):
        slots.reserve("y")
    clock.now += RELEASE_GRACE_S
    slots.reserve("y")  # so did the finished one nobody released
    assert len(slots) == 2


@pytest.fixture(scope="module")
def path(artifacts_dir, qwen_tokenizer):
    return scripted_artifact(artifacts_dir, qwen_tokenizer)


@pytest.fixture
def slow_preparation(monkeypatch):
    """Prompt building that takes 1.2 s: a request spends that long in preparation (as a large media fetch
    would), before the engine sees it."""
    build = generation._timed_build_prompt

    def slow(*args):
        time.sleep(1.2)
        return build(*args)

    monkeypatch.setattr(generation, "_timed_build_prompt", slow)


def body(text: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}


def test_a_request_in_preparation_holds_capacity(path, qwen_tokenizer, slow_preparation):
    live = start_server(path, qwen_tokenizer, max_concurrency=1, max_pending_requests=0, pending_timeout_ms=10000)
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(httpx.post, live.url + "/v1/chat/completions", json=body("ALPHA"), timeout=30)
            assert wait_until(lambda: live.engine.snapshot()["held_requests"] == 1, interval=0.01)
            assert live.engine.snapshot()["waiting"] + live.engine.snapshot()["running"] == 0  # still preparing
            second = httpx.post(live.url + "/v1/chat/completions", json=body("ALPHA"), timeout=30)
            assert second.status_code == 429 and second.json()["error"]["code"] == "server_overloaded"
            assert first.result().status_code == 200
        assert wait_until(lambda: live.engine.snapshot()["held_requests"] == 0)  # released with the answer
        assert httpx.post(live.url + "/v1/chat/completions", json=body("ALPHA"), timeout=30).status_code == 200
    finally:
        live.stop()


def test_the_admission_deadline_starts_before_preparation(path, qwen_tokenizer, slow_preparation):
    live = start_server(path, qwen_tokenizer, pending_timeout_ms=1000)
    try:
        for stream in (False, True):
            r = httpx.post(live.url + "/v1/chat/completions", json=body("ALPHA", stream=stream), timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"] == "request_queue_timeout", r.text
        assert live.engine.snapshot()["held_requests"] == 0
    finally:
        live.stop()
