"""Where a CPU decode step goes: runner-level greedy decode at a given context, timed and profiled.

  python bench/cpu_step_profile.py --artifact models/smollm2-135m-instruct.ninfer --context 128 6000 --dtype int8
  python bench/cpu_step_profile.py ... --profile torch     # + the top ops by self CPU time
  python bench/cpu_step_profile.py ... --profile cprofile  # + the top Python functions by own time

One JSON line per context: ms per step (runner.forward + argmax + read-back, no engine loop, one thread
of Python, torch's threads as set) as median and mean over --steps steps after --warmup. Everything runs
on the calling thread (see Engine.build_and_start for why that matters on CPU).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from ninfer.engine.engine import EngineSettings  # noqa: E402
from ninfer.engine.loader import load_engine  # noqa: E402


def _sequence(context: int, steps: int, page_size: int) -> SimpleNamespace:
    """A sequence holding consecutive pages for its whole run (what PagePool hands a fresh request)."""
    pages = list(range(-(-(context + steps + 8) // page_size)))
    return SimpleNamespace(num_computed=0, pages=pages, state_slot=0, mrope=None, positions=None)


def _prefill(runner, seq, tokens: list[int], chunk: int) -> int:
    logits = None
    for at in range(0, len(tokens), chunk):
        part = tokens[at:at + chunk]
        logits = runner.forward([seq], [part])
        seq.num_computed += len(part)
    return int(logits[0].argmax())


def _decode(runner, seq, token: int, steps: int) -> tuple[list[float], int]:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = runner.forward([seq], [[token]])
        token = int(logits[0].argmax())
        seq.num_computed += 1
        times.append(time.perf_counter() - t0)
    return times, token


def run(runner, context: int, args) -> dict:
    seq = _sequence(context, args.warmup + args.steps, runner.page_size)
    prompt = [(31 * j) % 40000 + 500 for j in range(context)]
    with torch.inference_mode():
        started = time.perf_counter()
        token = _prefill(runner, seq, prompt, args.prefill_chunk)
        prefill_s = time.perf_counter() - started
        _, token = _decode(runner, seq, token, args.warmup)
        if args.profile == "torch":
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                times, _ = _decode(runner, seq, token, args.steps)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows), file=sys.stderr)
        elif args.profile == "cprofile":
            prof = cProfile.Profile()
            prof.enable()
            times, _ = _decode(runner, seq, token, args.steps)
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.rows)
            print(out.getvalue(), file=sys.stderr)
        else:
            times, _ = _decode(runner, seq, token, args.steps)
    ms = [t * 1e3 for t in times]
    return {"context": context, "steps": args.steps, "median_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms),
            "min_ms": min(ms), "tokens_per_s": 1e3 / statistics.median(ms), "prefill_s": prefill_s,
            "prefill_chunk": args.prefill_chunk}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--context", type=int, nargs="+", default=[128, 6000])
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32", "int8"])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--prefill-chunk", type=int, default=512, help="tokens a prefill forward (configs/tiny.yaml's)")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    ap.add_argument("--profile", choices=["none", "torch", "cprofile"], default="none")
    ap.add_argument("--rows", type=int, default=25, help="profile rows printed (to stderr)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    top = max(args.context) + args.warmup + args.steps + 64
    settings = EngineSettings(max_context=top, kv_capacity=top, max_concurrency=1, prefill_chunk=args.prefill_chunk, eos_ids=set())
    engine = load_engine(args.artifact, settings, dtype=args.dtype, start=False)  # everything on this thread
    for context in args.context:
        result = run(engine.runner, context, args)
        result.update({"dtype": args.dtype, "threads": torch.get_num_threads(), "torch": torch.__version__,
                       "command": " ".join(sys.argv)})
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
