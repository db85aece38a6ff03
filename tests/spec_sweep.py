"""A randomized sweep of speculative decoding against plain decoding (run by hand; pytest does not collect it).

Each seed draws engine settings (drafter: MTP, DFlash or DFlash2; drafts 1-5; concurrency 1-6; page size; KV pool;
state slots; snapshot or replay pauses; prefix reuse; adaptive drafts; how many oracle drafts are corrupted) and
runs the multi-turn workload of tests/test_speculative.py (`_workload_waves`) through it; every request must decode
as through an engine without drafts, one request at a time, over the same KV pool, and every MTP head proposal must
equal the head run from scratch. s27 found two engine bugs with
it (an MTP chain past a row's pages; CPU verify rows rounding as one product), each now a test of its own.

    .venv/bin/python tests/spec_sweep.py 0 40    # seeds 0..39, one line each; ~15 s a seed on two cores
"""

from __future__ import annotations

import logging
import random
import sys
import tempfile
import traceback
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import test_speculative as ts  # noqa: E402
import torch  # noqa: E402
from engine_helpers import assert_no_leak, token_ids  # noqa: E402

from ninfer.artifact.presets import write_preset  # noqa: E402
from ninfer.engine.engine import EngineSettings  # noqa: E402
from ninfer.engine.loader import load_engine  # noqa: E402
from ninfer.engine.speculative import OracleProposer  # noqa: E402
from ninfer.engine.types import FinishEvent  # noqa: E402

CPU = torch.device("cpu")


def artifacts(work: Path) -> dict[str, Path]:
    qwen = write_preset("tiny-qwen3.6", work / "qwen.ninfer", seed=0)
    paths = {"mtp": write_preset("tiny-qwen3.6", work / "qwen-mtp.ninfer", seed=0, mtp=True)}
    for variant in ("dflash", "dflash2"):
        paths[variant] = ts._block_drafter_artifact(qwen, work / variant, variant)
    return paths


def one(seed: int, paths: dict[str, Path]) -> str:
    rng = random.Random(1000 + seed)
    spec = rng.choice(["mtp", "mtp", "dflash", "dflash2"])
    k = rng.randint(1, 5) if spec == "mtp" else rng.randint(2, 4)  # the tiny block drafters draft at most 4
    settings = EngineSettings(
        max_context=256, max_concurrency=rng.choice([1, 2, 3, 4, 6]), prefill_chunk=rng.choice([8, 16, 32, 64]),
        page_size=rng.choice([4, 8, 16]), kv_capacity=rng.choice([112, 128, 160, 224, 320]),
        state_slots=rng.choice([None, 8, 12]), draft_tokens=k, spec=spec, adaptive_drafts=rng.random() < 0.3,
        host_context_bytes=rng.choice([None, 0, 30000]), prefix_reuse=rng.random() < 0.85, pending_timeout_ms=10**9)
    engine = load_engine(paths[spec], settings, device=CPU)
    plain = load_engine(paths[spec], EngineSettings(max_context=256, max_concurrency=1, prefill_chunk=16,
                                                    prefix_reuse=False, kv_capacity=settings.kv_capacity,
                                                    page_size=settings.page_size), device=CPU)
    oracle = OracleProposer({}, corrupt=rng.choice([0.0, 0.2, 0.5]), vocab=900, seed=seed)
    propose, proposals = engine.proposer.propose, []

    def drafting(works, budgets):
        propose(works, budgets)
        if spec == "mtp":  # the head's own drafts, checked against a from-scratch head below
            proposals.extend((w.seq.tokens(0, w.seq.total_len), ts._proposed(w), b) for w, b in zip(works, budgets))
        oracle.propose(works, budgets)

    engine.proposer.propose = drafting
    fits = lambda request: len(request.prompt_ids) <= settings.kv_capacity  # noqa: E731 (longer ones: refused)
    try:
        for wave, request, got, expected in ts._run_workload(engine, plain, oracle, seed, fits):
            assert isinstance(got[-1], FinishEvent) and got[-1].error is None, (wave, request, got[-1])
            assert token_ids(got) == token_ids(expected), (wave, request, token_ids(got), token_ids(expected))
            assert got[-1].reason == expected[-1].reason, (wave, request, got[-1], expected[-1])
    finally:
        engine.shutdown()
        plain.shutdown()
    assert_no_leak(engine)
    for tokens, drafts, budget in proposals:
        assert drafts == ts._reference_drafts(engine, tokens, k)[:budget], ("head drafts", len(tokens), drafts)
    c = engine.counters
    return (f"{spec} k={k} C={settings.max_concurrency} page={settings.page_size} pool={settings.kv_capacity} "
            f"adaptive={settings.adaptive_drafts} reuse={settings.prefix_reuse} rounds={c.spec_rounds} "
            f"restores={c.snapshot_restores + c.replay_restores}")


def main() -> None:
    logging.basicConfig(level=logging.WARNING)  # an engine step's failure prints its traceback
    first, last = int(sys.argv[1]), int(sys.argv[2])
    with tempfile.TemporaryDirectory() as folder:
        paths = artifacts(Path(folder))
        failed = 0
        for seed in range(first, last):
            try:
                print(seed, "ok", one(seed, paths), flush=True)
            except Exception as exc:
                failed += 1
                print(seed, "FAIL", type(exc).__name__, str(exc)[:2000], flush=True)
                traceback.print_exc(limit=4)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
