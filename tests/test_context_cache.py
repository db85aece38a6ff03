"""Context cache (contract: "Execution behavior": prefix reuse, checkpoints, pausing and restoration;
cached-token usage fields): exact reuse never changes greedy output, and pressure never leaks."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from engine_helpers import assert_no_leak
from kernel_markers import needs_cuda

from ninfer.chat.thinking import thinking_control
from ninfer.engine.engine import EngineSettings
from ninfer.engine.loader import load_engine
from ninfer.engine.types import EngineRequest, FinishEvent, SamplingParams, TokenEvent

GREEDY = SamplingParams(temperature=0.0)
PAGE = 4


def _ids(events):
    return [i for e in events if isinstance(e, TokenEvent) for i in e.token_ids]


def _run(engine, prompt, rid, max_tokens=8, **kw):
    events = engine.generate(EngineRequest(rid, prompt, max_tokens=max_tokens, sampling=GREEDY, **kw))
    assert isinstance(events[-1], FinishEvent)
    return _ids(events), events[-1]


def _engine(path, device=None, **kw):
    settings = dict(max_context=512, max_concurrency=2, prefill_chunk=32, page_size=PAGE)
    settings.update(kw)
    return load_engine(path, EngineSettings(**settings), **({"device": device} if device else {}))


def _prompt(n, salt=0):
    return [(31 * i + 7 * salt) % 700 + 60 for i in range(n)]


@pytest.fixture(params=["tiny_llama_path", "tiny_qwen_path", "smollm2_path"])
def model_path(request):
    return request.getfixturevalue(request.param), request.param != "tiny_qwen_path"


def test_multi_turn_reuses_the_previous_endpoint_with_identical_output(model_path):
    path, attention_only = model_path
    first = _prompt(37)
    cold = _engine(path, prefix_reuse=False)
    warm = _engine(path)
    try:
        out1, fin1 = _run(warm, first, "t1")
        assert fin1.usage.cached_tokens == 0 and fin1.prefix_reuse_path == "root"
        second = first + out1 + _prompt(9, salt=3)
        expect_ids, cold_fin = _run(cold, second, "c2")
        got_ids, fin2 = _run(warm, second, "t2")
    finally:
        cold.shutdown()
        warm.shutdown()
    endpoint = len(first) + len(out1) - 1  # every computed token of turn 1
    expected = endpoint - endpoint % PAGE if attention_only else endpoint
    assert got_ids == expect_ids
    assert cold_fin.usage.cached_tokens == 0
    assert fin2.usage.cached_tokens == expected and fin2.prefix_reuse_path == "checkpoint"
    assert fin2.timings.cache_n == expected and fin2.timings.prompt_n == len(second) - expected
    assert_no_leak(warm)


def test_edited_history_falls_back_to_an_earlier_checkpoint_or_root(tiny_qwen_path):
    """Hybrid: reuse only where state was captured. The input checkpoint at 20 survives an edit after it."""
    base = _prompt(40)
    engine = _engine(tiny_qwen_path)
    cold = _engine(tiny_qwen_path, prefix_reuse=False)
    try:
        _run(engine, base, "a", checkpoints=[20])
        edited = base[:30] + [999] + base[31:]
        got, fin = _run(engine, edited, "b")
        want, _ = _run(cold, edited, "c")
        early_edit = [998] + base[1:]
        _, fin_root = _run(engine, early_edit, "d")
    finally:
        engine.shutdown()
        cold.shutdown()
    assert fin.usage.cached_tokens == 20 and got == want
    assert fin_root.usage.cached_tokens == 0 and fin_root.prefix_reuse_path == "root"
    assert_no_leak(engine)


def test_attention_models_reuse_any_page_aligned_prefix(tiny_llama_path):
    base = _prompt(50)
    engine = _engine(tiny_llama_path)
    try:
        _run(engine, base, "a")
        _, fin = _run(engine, base[:23] + [5, 6, 7], "b")
    finally:
        engine.shutdown()
    assert fin.usage.cached_tokens == 20  # 23 common tokens, whole pages only


def test_no_prefix_reuse_reads_and_writes_nothing(tiny_qwen_path):
    engine = _engine(tiny_qwen_path, prefix_reuse=False)
    try:
        out, _ = _run(engine, _prompt(30), "a", checkpoints=[10])
        _, fin = _run(engine, _prompt(30) + out + [1, 2], "b")
        assert not engine.cache.entries
    finally:
        engine.shutdown()
    assert fin.usage.cached_tokens == 0


def test_session_keeps_only_its_latest_endpoint(tiny_qwen_path):
    engine = _engine(tiny_qwen_path)
    try:
        out, _ = _run(engine, _prompt(20), "a", session_key="s")
        _run(engine, _prompt(20) + out + [3, 4], "b", session_key="s")
        _run(engine, _prompt(25, salt=1), "c", retain_endpoint=False)  # a store:false child
        kinds = [(e.kind, e.session) for e in engine.cache.entries]
    finally:
        engine.shutdown()
    assert kinds == [("endpoint", "s")]


def _storm(path, **kw):
    """4 concurrent long requests in a pool that holds about two of them."""
    prompts = [_prompt(60, salt=s) for s in range(4)]
    engine = _engine(path, max_concurrency=4, kv_capacity=160, state_slots=8, prefix_reuse=False, **kw)

    async def main():
        async def one(i):
            return [e async for e in engine.stream(EngineRequest(f"s{i}", prompts[i], max_tokens=40,
                                                                   sampling=GREEDY))]
        return await asyncio.gather(*(one(i) for i in range(4)))
    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    return prompts, [_ids(r) for r in results], engine, [r[-1] for r in results]


@pytest.mark.parametrize("fixture", ["tiny_llama_path", "tiny_qwen_path", "smollm2_path"])
@pytest.mark.parametrize("host_budget", [None, 0], ids=["snapshot", "replay"])
def test_pressure_storm_keeps_greedy_output(fixture, host_budget, request):
    path = request.getfixturevalue(fixture)
    prompts, outputs, engine, _ = _storm(path, host_context_bytes=host_budget)
    alone = _engine(path, prefix_reuse=False)
    try:
        expected = [_run(alone, p, f"alone{i}", max_tokens=40)[0] for i, p in enumerate(prompts)]
    finally:
        alone.shutdown()
    assert outputs == expected
    counters = engine.counters
    assert engine.scheduler.preemptions > 0
    # Contract, "Live metrics": prefill counts initial prefill, recomputation after a pause is recovery (replay),
    # also for a request paused before its first output; and every pause cycle ends in a restore by one route
    # (none restored only to be paused again in the same step: "Execution behavior", a restoration reserves room
    # for one new unit)
    assert counters.prefill_tokens == sum(len(p) for p in prompts)
    assert engine.scheduler.preemptions == counters.snapshot_restores + counters.replay_restores
    if host_budget == 0:
        assert counters.replay_restores > 0 and counters.snapshot_restores == 0 and counters.replayed_tokens > 0
    else:
        assert counters.snapshot_restores > 0 and counters.transfer_bytes_h2d > 0
    assert engine.host_used == 0
    assert_no_leak(engine)


def test_many_snapshot_restores_at_once_never_fail_the_engine(qwen_tokenizer):
    """Eight requests in a pool that holds about one of them, with host snapshots: several paused
    requests become restorable at the same boundary. Every request still completes (serving.md: an
    admitted request may pause for resource pressure and is never lost)."""
    from ninfer.engine.engine import Engine
    from ninfer.engine.types import FinishReason
    from ninfer.models.scripted import FixedLogitsModel

    settings = EngineSettings(max_context=528, max_concurrency=8, eos_ids=set())
    engine = Engine(FixedLogitsModel(2000), qwen_tokenizer, settings, thinking=thinking_control(qwen_tokenizer)).start()
    outputs: dict[int, list] = {}

    def one(i: int) -> None:
        request = EngineRequest(f"m{i}", [100 + i] * 64, max_tokens=300, sampling=GREEDY)
        outputs[i] = engine.generate(request, timeout=120)

    try:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert engine.healthy
        for i in range(8):
            assert outputs[i][-1].reason is FinishReason.LENGTH and len(_ids(outputs[i])) == 300, i
        assert engine.counters.snapshot_restores > 0 and engine.scheduler.preemptions > 0
        assert engine.host_used == 0
        assert_no_leak(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("device", [None, pytest.param("cuda", marks=[needs_cuda, pytest.mark.cuda])],
                         ids=["cpu", "cuda"])
def test_request_log_sees_each_requests_copies_and_prefill_work(tiny_qwen_path, device):
    """Contract, "Structured request log": request_done's work.gpu_seconds (the prompt chunks' device time from
    CUDA events; on the CPU their wall time) and context_transfers (the request's own copies by direction), and
    the throughput record's StateImage operations, tail-page copies and last selection (on the CPU run: the GPU
    host lacks the server's packages)."""
    base = _prompt(40)
    engine = _engine(tiny_qwen_path, device=device, scheduling_events=True)
    try:
        report = engine.startup_report()
        before = engine.snapshot()
        _, first = _run(engine, base, "a", checkpoints=[22])  # a StateImage captured at 22
        _, reuse = _run(engine, base[:30] + [999] + base[31:], "b")  # adopts 22: the state and the tail page 20-23
        after = engine.snapshot()
    finally:
        engine.shutdown()
    assert reuse.usage.cached_tokens == 22
    memory = report["memory"]  # server_start's arenas; on CUDA the allocator's workspace beyond them, and the GPU
    assert memory["arenas_bytes"]["weights"] > 0 and memory["arenas_bytes"]["state"] > 0
    assert (memory["workspace"] is None) == (device is None) and (report["environment"]["gpu"] is None) == (device is None)
    for fin in (first, reuse):
        assert fin.work["gpu_seconds"] > 0 and fin.work["prefill_intervals"] >= 1
        assert fin.context_transfers["d2h"] == fin.context_transfers["h2d"] == {
            "bytes": {"main_kv": 0, "state": 0, "backend_kv": 0}, "copies": 0, "seconds": 0}
    captured = first.context_transfers["d2d"]  # its own state copied into the checkpoint's slot
    assert captured["copies"] == 1 and captured["bytes"]["state"] > 0 and captured["bytes"]["main_kv"] == 0
    adopted = reuse.context_transfers["d2d"]
    assert adopted["copies"] == 1 and adopted["seconds"] >= 0
    assert adopted["bytes"]["state"] == captured["bytes"]["state"] and adopted["bytes"]["main_kv"] > 0

    if device is not None:
        return
    from ninfer.server.request_log import throughput_fields

    record = throughput_fields(before, after, 1.0, None)
    cache = record["context_cache"]
    assert cache["state_images"] == {"captured": 1, "adopted": 1, "to_host": 0, "from_host": 0}
    assert cache["tail_page_copies"] == 1 and cache["pressure_evictions"] == 0
    assert cache["last_selection"] == {"outcome": "hit", "reused_tokens": 22, "checkpoint_kind": "input"}
    assert record["scheduler"]["terminal_pending"] == 0 and record["scheduler"]["capture_pending"] == 0
    work = record["host_work"]
    assert work["detail_invocations"]["request_observation"] > 0
    assert 0 < work["detail_subset_seconds"]["request_observation"] < work["elapsed_seconds"]["total"]
    assert work["per_round_seconds"]["host"] == pytest.approx(
        work["elapsed_seconds"]["total"] / record["decode_batch"]["rounds"])
    idle = throughput_fields(after, after, 1.0, None)["host_work"]  # no rounds: normalized values are null
    assert idle["per_round_seconds"] == {"host": None, "device_wait": None}
    assert idle["detail_per_invocation_seconds"] == {"request_observation": None}


def test_a_snapshot_pause_logs_the_requests_host_copies(tiny_qwen_path):
    _, _, engine, finishes = _storm(tiny_qwen_path, scheduling_events=True)
    paused = [f for f in finishes if f.scheduling["snapshot_restores"]]
    assert paused, [f.scheduling for f in finishes]
    for fin in paused:
        out, back = fin.context_transfers["d2h"], fin.context_transfers["h2d"]
        assert out["copies"] >= back["copies"] >= 1 and out["seconds"] >= 0
        assert out["bytes"]["main_kv"] > 0 and out["bytes"]["state"] > 0
        assert fin.scheduling["transfer_bytes"]["h2d"] == sum(back["bytes"].values())
    images = engine.snapshot()["state_images"]
    assert images["to_host"] >= images["from_host"] >= len(paused)


def test_context_costs_choose_the_cheaper_pause_route(tiny_qwen_path, tmp_path):
    """Contract, "Server options": --context-cost-presets. A pause takes the snapshot route only where it costs less
    than recomputing the request: with the generic CPU coefficients a tiny model's copies are far cheaper; a
    registry entry for this hardware whose transfers crawl makes replay the cheaper route; one whose prefill crawls
    too (for this engine's signature) brings the snapshots back. Output is the same by every route."""
    import json

    from ninfer.engine.context_cost import hardware_name

    hardware = hardware_name(torch.device("cpu"))
    _, generic_out, generic, _ = _storm(tiny_qwen_path)
    assert generic.counters.snapshot_restores > 0 and generic.context_costs.transfer_source == "generic"

    slow_copies = tmp_path / "slow_copies.json"
    crawl = {"hardware": hardware, "d2h_gib_per_s": 1e-6, "h2d_gib_per_s": 1e-6}
    slow_copies.write_text(json.dumps({"transfer": [crawl]}))
    _, replay_out, replayed, _ = _storm(tiny_qwen_path, context_cost_presets=str(slow_copies))
    costs = replayed.context_costs
    assert (costs.transfer_source, costs.prefill_source) == (f"presets:{slow_copies}", "generic")
    assert replayed.scheduler.preemptions > 0 and replayed.kv.replay_by_cost > 0
    assert replayed.counters.snapshot_restores == 0 and replayed.counters.replay_restores > 0

    slow_prefill = tmp_path / "slow_prefill.json"
    slow_prefill.write_text(json.dumps({"transfer": [crawl], "prefill": [
        {"hardware": hardware, "signature": costs.signature, "tokens_per_s": 1e-9}]}))
    _, snapshot_out, snapshotted, _ = _storm(tiny_qwen_path, context_cost_presets=str(slow_prefill))
    assert snapshotted.context_costs.prefill_source == f"presets:{slow_prefill}"
    assert snapshotted.counters.snapshot_restores > 0 and snapshotted.kv.replay_by_cost == 0
    assert generic_out == replay_out == snapshot_out


def test_a_pool_smaller_than_max_context_is_each_sequences_ceiling(tiny_qwen_path):
    """Contract, "Execution behavior": --max-context is each sequence's logical ceiling, and a smaller KV pool
    lowers it (/v1/models reports min(max_context, pool) as max_model_len). A request alone in a 64-token pool
    ends at the context ceiling with 64 tokens in all, as it would with --max-context 64 (a starved finish took
    one token past it)."""
    from ninfer.engine.types import FinishReason

    finishes = []
    for kw in ({"kv_capacity": 64}, {"max_context": 64}):
        engine = _engine(tiny_qwen_path, max_concurrency=1, **kw)
        engine.settings.eos_ids = set()  # random weights: run to the ceiling
        try:
            ids, finish = _run(engine, _prompt(40), "c", max_tokens=100)
        finally:
            engine.shutdown()
        finishes.append((finish.reason, 40 + len(ids)))
    assert finishes == [(FinishReason.CONTEXT, 64)] * 2


def test_a_pool_larger_than_memory_is_refused_with_its_size(tiny_qwen_path):
    """A --kv-capacity (or --max-context) far past the machine's memory: a clear error with the bytes needed and
    the flags to lower, before anything is allocated (it grew until the kernel's OOM killer ended the process)."""
    from ninfer.engine.kv_sizing import KVCapacityError

    with pytest.raises(KVCapacityError, match="lower --kv-capacity or --max-context"):
        _engine(tiny_qwen_path, kv_capacity=10**13, max_context=10**13)


def test_a_chunk_that_rebuilds_an_old_frontier_and_ends_the_prompt_samples(tiny_qwen_path, monkeypatch):
    """A request paused mid-prompt (replay route) whose rebuilding chunk also reaches the prompt's end (chunk
    boundaries shift when the prefix it reused first is gone): that chunk counts its old tokens as replay and
    still samples the first token. Here every request arrives as if its first 24 prompt tokens had been computed
    before a pause; the 40-token prompt is one chunk. The replay_complete branch once skipped the sample."""
    from ninfer.engine.engine import Engine

    prompt = _prompt(40)
    plain = _engine(tiny_qwen_path, prefill_chunk=64)
    try:
        expected, _ = _run(plain, prompt, "plain", max_tokens=6)
    finally:
        plain.shutdown()
    prepare = Engine._prepare

    def paused_before(self, request, emit):
        seq = prepare(self, request, emit)
        seq.computed_high = 24
        return seq

    monkeypatch.setattr(Engine, "_prepare", paused_before)
    engine = _engine(tiny_qwen_path, prefill_chunk=64)
    try:
        ids, finish = _run(engine, prompt, "rebuilt", max_tokens=6)
    finally:
        engine.shutdown()
    assert ids == expected and len(ids) == 6
    assert (engine.counters.replayed_tokens, engine.counters.prefill_tokens) == (24, 16)
