"""The engine's host work per decode step, measured with a model that costs (almost) nothing.

  python bench/engine_host_overhead.py                 # C = 1 and 8, greedy, 2,000-token vocabulary
  python bench/engine_host_overhead.py --vocab 248320  # the Qwen vocabulary (the CPU argmax then counts too)

On a GPU the engine runs its steps one after the other, so this host time (scheduling, the runner's
input fills, committing each token: stops, thinking control, detokenization; penalty counts; event
delivery) is time the GPU waits. Here every step's forward returns fixed logits, so what remains is
that host work (plus one argmax over the vocabulary, which the GPU would do). Prints one JSON line
per concurrency with wall milliseconds per decode step and the top functions by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from ninfer.chat.thinking import thinking_control


def measure(concurrency: int, vocab: int, tokens: int, profile: bool) -> dict:
    from ninfer.artifact.qwen_tokenizer import build_qwen_tokenizer_json
    from ninfer.engine.engine import Engine, EngineSettings
    from ninfer.engine.types import EngineRequest, FinishEvent, SamplingParams
    from ninfer.models.scripted import FixedLogitsModel
    from ninfer.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_json_str(build_qwen_tokenizer_json())
    context = tokens + 128
    settings = EngineSettings(max_context=context, kv_capacity=concurrency * context, max_concurrency=concurrency,
                              eos_ids=set())  # room for every request: no pauses
    prof = cProfile.Profile()
    decode_step = Engine._decode_step

    def profiled(self):
        prof.enable()
        try:
            return decode_step(self)
        finally:
            prof.disable()

    engine = Engine(FixedLogitsModel(vocab), tokenizer, settings, thinking=thinking_control(tokenizer))
    if profile:
        engine._decode_step = profiled.__get__(engine)
    engine.start()
    engine.settings.eos_ids = set()
    finished = threading.Semaphore(0)
    t0 = time.perf_counter()
    for i in range(concurrency):
        engine.submit(EngineRequest(f"h{i}", [100 + i] * 64, max_tokens=tokens, sampling=SamplingParams(temperature=0.0)),
                      lambda ev: finished.release() if isinstance(ev, FinishEvent) else None)
    for _ in range(concurrency):
        finished.acquire()
    wall = time.perf_counter() - t0
    steps = engine.counters.decode_steps
    engine.shutdown()
    record = {"kind": "engine_host_overhead", "concurrency": concurrency, "vocab": vocab, "decode_steps": steps,
              "ms_per_step": wall / steps * 1e3, "us_per_token": wall / (steps * concurrency) * 1e6,
              "profiled": profile}
    if profile:
        stats = pstats.Stats(prof)
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][3])[:12]
        record["top_cumulative_ms_per_step"] = [
            [f"{Path(f).name}:{line}({fn})", round(ct / steps * 1e3, 4)] for (f, line, fn), (_, _, _, ct, _) in rows]
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--vocab", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=400, help="output tokens per request")
    ap.add_argument("--profile", action="store_true", help="cProfile the decode steps (slows them down)")
    args = ap.parse_args()
    print(json.dumps({"kind": "env", "torch": torch.__version__, "threads": torch.get_num_threads(),
                      "command": " ".join(["bench/engine_host_overhead.py", *sys.argv[1:]])}), flush=True)
    for c in args.concurrency:
        print(json.dumps(measure(c, args.vocab, args.tokens, args.profile)), flush=True)


if __name__ == "__main__":
    main()
