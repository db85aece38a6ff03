"""Engine throughput: decode tokens/s at several concurrencies, one JSON line per run.

  python bench/engine_throughput.py --artifact models/smollm2-135m-instruct.ninfer --concurrency 1 2 4 8
  python bench/engine_throughput.py --preset qwen3.6-27b --concurrency 1 8      # on a GPU, no file

Every request is greedy, ignores EOS and produces exactly --max-tokens tokens, so runs compare.
Decode tokens/s counts tokens after each request's first one over the time from the last first
token to the last token (the steady decode phase); TTFT is reported separately.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from ninfer.engine.engine import EngineSettings  # noqa: E402
from ninfer.engine.loader import engine_from_preset, load_engine  # noqa: E402
from ninfer.engine.types import EngineRequest, FinishEvent, SamplingParams, TokenEvent  # noqa: E402


async def _one(engine, req, marks):
    t0 = time.perf_counter()
    first = last = None
    n = 0
    async for ev in engine.stream(req):
        if isinstance(ev, TokenEvent) and ev.token_ids:
            now = time.perf_counter()
            first = first or now
            last = now
            n += len(ev.token_ids)
        if isinstance(ev, FinishEvent):
            break
    marks.append({"ttft_s": first - t0, "first": first, "last": last, "tokens": n})


def run_once(engine, concurrency: int, prompt_len: int, max_tokens: int, vocab: int) -> dict:
    reqs = [
        EngineRequest(f"b{concurrency}-{i}-{time.time_ns()}",
                      [(1009 * i + 31 * j) % (vocab - 1000) + 500 for j in range(prompt_len)],
                      max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0))
        for i in range(concurrency)
    ]
    marks: list[dict] = []

    async def main():
        await asyncio.gather(*(_one(engine, r, marks) for r in reqs))

    t0 = time.perf_counter()
    asyncio.run(main())
    wall = time.perf_counter() - t0
    decode_start = max(m["first"] for m in marks)
    decode_end = max(m["last"] for m in marks)
    # tokens produced after every request reached decode (steady state with all lanes busy)
    decode_tokens = sum(m["tokens"] - 1 for m in marks)
    span = decode_end - min(m["first"] for m in marks)
    return {
        "concurrency": concurrency,
        "prompt_len": prompt_len,
        "max_tokens": max_tokens,
        "total_tokens": sum(m["tokens"] for m in marks),
        "wall_s": wall,
        "aggregate_tokens_per_s": sum(m["tokens"] for m in marks) / wall,
        "decode_tokens_per_s": decode_tokens / span if span > 0 else 0.0,
        "steady_window_s": decode_end - decode_start,
        "mean_ttft_s": sum(m["ttft_s"] for m in marks) / len(marks),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--artifact", help=".ninfer file")
    src.add_argument("--preset", help="synthetic preset built on the device (e.g. qwen3.6-27b, tiny-qwen3.6)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32", "int8"])
    ap.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp8", "int8", "nvfp4", "k8v4"],
                    help="KV storage (the server's --kv-dtype)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up runs per concurrency (not reported)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    for c in args.concurrency:
        settings = EngineSettings(max_context=args.prompt_len + args.max_tokens + 16, max_concurrency=c,
                                  prefill_chunk=1024, eos_ids=set(), kv_dtype=args.kv_dtype)
        settings.kv_capacity = settings.max_context * c
        t_load = time.perf_counter()
        engine = (load_engine(args.artifact, settings, dtype=args.dtype) if args.artifact
                  else engine_from_preset(args.preset, settings, dtype=args.dtype))
        engine.settings.eos_ids = set()  # run every request to max_tokens
        load_s = time.perf_counter() - t_load
        try:
            vocab = engine.tokenizer.vocab_size
            for _ in range(args.warmup):
                run_once(engine, c, args.prompt_len, min(args.max_tokens, 8), vocab)
            if engine.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            result = run_once(engine, c, args.prompt_len, args.max_tokens, vocab)
        finally:
            engine.shutdown()
        params = sum(p.numel() for p in engine.runner.model.parameters())
        result.update({
            "model": args.artifact or args.preset,
            "device": torch.cuda.get_device_name() if engine.device.type == "cuda" else platform.processor() or "cpu",
            "dtype": str(engine.runner.cache.k.dtype).removeprefix("torch."),
            "kv_dtype": args.kv_dtype,
            "parameters": params,
            "load_s": load_s,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "peak_gpu_bytes": torch.cuda.max_memory_allocated() if engine.device.type == "cuda" else None,
            "command": " ".join(sys.argv),
        })
        print(json.dumps(result), flush=True)
        del engine
        gc.collect()  # the engine's event callbacks form reference cycles; free the model before the next
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
