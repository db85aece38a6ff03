"""s39 diagnostic (CUDA): seeded and greedy output of the tiny MTP engine with and without rounds queued before the
last read back, against plain decoding; for each request that differs, the first output position that does and
whether the rounds that committed it and the token before it were queued.

    python bench/debug_overlap_seeded.py /tmp/tiny-mtp.ninfer   # writes the artifact there when missing
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
from engine_helpers import run_all, token_ids  # noqa: E402
from test_overlapped_rounds import GREEDY, SEEDED, _mtp_engine, _plain, _requests  # noqa: E402

from ninfer.artifact.presets import write_preset  # noqa: E402
from ninfer.engine.speculative import OracleProposer  # noqa: E402


def traced_run(path, base: list[list[int]], sampling, overlap: bool, device) -> tuple[list[list[int]], dict, object]:
    """One MTP engine run (oracle drafts): outputs, (request, output index) -> committed by a queued round, engine."""
    oracle = OracleProposer({f"r{i}": b for i, b in enumerate(base)}, corrupt=0.25, vocab=900, seed=4)
    engine = _mtp_engine(path, oracle, 1, overlap=overlap, device=device)
    where, queued_plans = {}, set()
    queue, commit = engine._queue_next_round, engine._commit

    def queue_next(plan, launched):
        q = queue(plan, launched)
        if q is not None:
            queued_plans.add(id(q[0]))
        return q

    def committing(plan, output):
        before = {id(w.seq): len(w.seq.output_ids) for w in plan.decode}
        result = commit(plan, output)
        for w in plan.decode:
            for j in range(before[id(w.seq)], len(w.seq.output_ids)):
                where[(w.seq.request_id, j)] = id(plan) in queued_plans
        return result

    engine._queue_next_round, engine._commit = queue_next, committing
    try:
        outs = [token_ids(e) for e in run_all(engine, _requests("r", 40, sampling))]
    finally:
        engine.shutdown()
    return outs, where, engine


def main() -> None:
    path = Path(sys.argv[1])
    if not path.exists():
        write_preset("tiny-qwen3.6", path, seed=0, mtp=True)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    for name, sampling in (("seeded", SEEDED), ("greedy", GREEDY)):
        base = [token_ids(e) for e in _plain(path, _requests("r", 40, sampling), device=device)]
        for overlap in (False, True):
            outs, where, engine = traced_run(path, base, sampling, overlap, device)
            diffs = []
            for i, (o, b) in enumerate(zip(outs, base)):
                j = next((j for j, (x, y) in enumerate(zip(o, b)) if x != y), None)
                if j is not None:
                    diffs.append((i, j, where.get((f"r{i}", j)), where.get((f"r{i}", j - 1))))
            print(name, "overlap" if overlap else "no-overlap", "queued", engine.queued_rounds, "rounds",
                  engine.counters.spec_rounds, "diffs (request, index, queued, previous queued):", diffs, flush=True)


if __name__ == "__main__":
    main()
