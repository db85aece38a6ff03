"""Engine-level decode benchmark: what a served request gets, the engine loop included.

  python bench/gpu_engine.py --shape qwen3.6-35b-a3b                  # bf16, greedy and sampled, C = 1, 2, 4, 8
  python bench/gpu_engine.py --quick                                  # tiny-qwen3.6 on the CPU: a dry run

bench/gpu_decode.py times the runner (forward + sample + read-back). A served token also costs the
engine's host work between steps: scheduling, committing each token (stops, thinking control,
incremental detokenization), penalty counts and event delivery. The engine runs one step after the
other, so the GPU waits through that work. This script submits C requests of --tokens output
tokens each to one Engine (random weights on the device, the preset's tokenizer, no EOS) and
reports the aggregate decode rate over the window in which all C are decoding, from the arrival
times of their tokens. Prints one JSON object per line (kind = env | setup | engine_decode).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from ninfer.chat.thinking import thinking_control


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def decode_window(arrivals: list[list[tuple[float, int]]]) -> tuple[float, int]:
    """(seconds, tokens) of the window from the last request's first token to the first request's last
    one: every request decodes throughout it."""
    start = max(times[0][0] for times in arrivals)
    end = min(times[-1][0] for times in arrivals)
    tokens = sum(n for times in arrivals for t, n in times if start < t <= end)
    return end - start, tokens


def run(engine, prompts: list[list[int]], tokens: int, sampling) -> list[list[tuple[float, int]]]:
    """Submit every prompt at once; per request the (arrival time, token count) of its token events."""
    from ninfer.engine.types import EngineRequest, FinishEvent, TokenEvent

    arrivals: list[list[tuple[float, int]]] = [[] for _ in prompts]
    done = threading.Semaphore(0)
    errors: list[object] = []

    def sink(i: int):
        def on_event(ev) -> None:
            if isinstance(ev, TokenEvent):
                arrivals[i].append((time.perf_counter(), len(ev.token_ids)))
            elif isinstance(ev, FinishEvent) or isinstance(ev, Exception):
                if isinstance(ev, Exception):
                    errors.append(ev)
                done.release()
        return on_event

    stamp = time.monotonic_ns()
    for i, p in enumerate(prompts):
        engine.submit(EngineRequest(f"b{stamp}-{i}", p, max_tokens=tokens, sampling=sampling), sink(i))
    for _ in prompts:
        done.acquire()
    if errors:
        raise RuntimeError(f"engine error: {errors[0]}")
    return arrivals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3.6-27b", choices=["qwen3.6-27b", "qwen3.6-35b-a3b"])
    ap.add_argument("--weights", default="bf16", choices=["bf16", "nvfp4"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--tokens", type=int, default=160, help="output tokens per request")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--quick", action="store_true", help="tiny-qwen3.6 (fp32 on the CPU): a dry run")
    args = ap.parse_args()

    from ninfer.artifact.presets import get_preset, instantiate, tokenizer_json_for
    from ninfer.engine.engine import Engine, EngineSettings
    from ninfer.engine.types import SamplingParams
    from ninfer.models import prepare_for_inference_
    from ninfer.tokenizer import Tokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = "tiny-qwen3.6-moe" if args.quick and "a3b" in args.shape else "tiny-qwen3.6" if args.quick else args.shape
    if args.quick:
        args.tokens, args.prompt = min(args.tokens, 24), min(args.prompt, 16)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    emit(kind="env", device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
         shape=name, weights=args.weights, command=" ".join(["bench/gpu_engine.py", *sys.argv[1:]]))

    preset = get_preset(name)
    model = instantiate(name, device, dtype, seed=0, fuse=False)
    if args.weights == "nvfp4":
        from ninfer.quant.nvfp4 import quantize_model_

        quantize_model_(model)
    prepare_for_inference_(model)
    tokenizer = Tokenizer.from_json_str(tokenizer_json_for(preset)[0])
    lanes = max(args.concurrency)
    context = args.prompt + args.tokens + 64
    settings = EngineSettings(max_context=context, max_concurrency=lanes, kv_capacity=lanes * context,
                              prefill_chunk=1024, eos_ids=set())
    t0 = time.perf_counter()
    engine = Engine(model, tokenizer, settings, device=device, dtype=dtype, thinking=thinking_control(tokenizer)).start()
    engine.settings.eos_ids = set()  # the tokens are random: never stop early
    runner = engine.runner
    emit(kind="setup", start_s=time.perf_counter() - t0, graph_status=runner.graph_status,
         sampler=runner.sampler_status)

    vocab = preset.text_config()["vocab_size"]
    modes = {"greedy": SamplingParams(temperature=0.0),
             "sampled": SamplingParams(**preset.sampling_presets["non_thinking"], seed=1)}
    try:
        for c in args.concurrency:
            prompts = [[(997 * i + 31 * j) % (vocab - 1000) + 500 for j in range(args.prompt)] for i in range(c)]
            for mode, sampling in modes.items():
                run(engine, prompts, 8, sampling)  # warm: this batch size's graphs and kernels
                steps0 = engine.counters.decode_steps
                arrivals = run(engine, prompts, args.tokens, sampling)
                seconds, tokens = decode_window(arrivals)
                emit(kind="engine_decode", shape=name, weights=args.weights, sampling=mode, concurrency=c,
                     tok_s=tokens / seconds if seconds > 0 else None, window_s=seconds, window_tokens=tokens,
                     decode_steps=engine.counters.decode_steps - steps0,
                     ms_per_step=seconds / (tokens / c) * 1e3 if tokens else None)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
