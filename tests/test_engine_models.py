"""The engine over real models (contract: "Execution behavior"): batching and pausing never change
greedy output."""

from __future__ import annotations

import pytest
from engine_helpers import assert_no_leak, mixed_prompts, run_all, token_ids

from ninfer.engine.engine import EngineSettings
from ninfer.engine.loader import load_engine
from ninfer.engine.types import EngineRequest, FinishEvent, SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def _greedy_alone_and_batched(path, max_tokens=12, **batched_settings):
    prompts = mixed_prompts(8)

    def requests():
        return [EngineRequest(f"r{i}", p, max_tokens=max_tokens, sampling=GREEDY) for i, p in enumerate(prompts)]

    alone_engine = load_engine(path, EngineSettings(max_context=256, max_concurrency=1, prefill_chunk=16))
    try:
        alone = [token_ids(alone_engine.generate(r)) for r in requests()]
    finally:
        alone_engine.shutdown()
    settings = dict(max_context=256, max_concurrency=8, prefill_chunk=16)
    settings.update(batched_settings)
    batch_engine = load_engine(path, EngineSettings(**settings))
    try:
        results = run_all(batch_engine, requests())
        preemptions = batch_engine.scheduler.preemptions
    finally:
        batch_engine.shutdown()
    assert_no_leak(batch_engine)
    return alone, [token_ids(r) for r in results], [r[-1] for r in results], preemptions


@pytest.mark.parametrize("fixture", ["tiny_llama_path", "tiny_qwen_path", "tiny_qwen_moe_path"])
def test_greedy_output_is_identical_alone_and_in_a_batch_of_8(fixture, request):
    alone, batched, finishes, _ = _greedy_alone_and_batched(request.getfixturevalue(fixture))
    assert all(isinstance(f, FinishEvent) for f in finishes)
    assert batched == alone


@pytest.mark.slow
def test_embedded_default_batches_like_it_runs_alone(smollm2_path):
    alone, batched, _, _ = _greedy_alone_and_batched(smollm2_path, max_tokens=8)
    assert batched == alone


@pytest.mark.parametrize("fixture", ["tiny_llama_path", "tiny_qwen_path"])
def test_pausing_under_kv_pressure_keeps_greedy_output(fixture, request):
    """A pool far smaller than 8 requests need forces pauses; replay must not change a token."""
    alone, batched, finishes, preemptions = _greedy_alone_and_batched(
        request.getfixturevalue(fixture), max_tokens=20, kv_capacity=96, page_size=4, state_slots=8)
    assert preemptions > 0
    assert batched == alone
    assert sum(f.preemptions for f in finishes) == preemptions
