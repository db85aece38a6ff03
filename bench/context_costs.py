"""Measure this machine's pause-route coefficients and print a --context-cost-presets registry (JSON).

  python bench/context_costs.py --artifact models/smollm2-135m-instruct.ninfer --dtype int8 > presets.json
  python bench/context_costs.py --artifact models/qwen27b.ninfer --kv-dtype fp8 --prefill-chunk 1024  # on a GPU

transfer: device-to-host and host-to-device copies of --copy-mib MiB (pinned host memory on CUDA), the median of
--repeat. prefill: the engine's own prompt processing (a --prompt-tokens prompt, one output token, timed by the
engine's prompt_ms), with the same options as the server it is for, since the signature the engine matches entries
against names the model, its weight and KV formats, the prefill chunk and vision. The registry goes to stdout, the
engine's startup record (which prints the signature) to stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from ninfer.engine.context_cost import GIB  # noqa: E402
from ninfer.engine.engine import EngineSettings  # noqa: E402
from ninfer.engine.loader import load_engine  # noqa: E402
from ninfer.engine.types import EngineRequest, FinishEvent, SamplingParams  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_rates(device: torch.device, mib: int, repeat: int) -> tuple[float, float]:
    """GiB/s device-to-host and host-to-device, medians."""
    n = mib << 20
    on_device = torch.empty(n, dtype=torch.uint8, device=device)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda")
    rates: dict[str, list[float]] = {"d2h": [], "h2d": []}
    for _ in range(repeat + 1):  # the first round warms the copy paths
        for direction, (dst, src) in (("d2h", (host, on_device)), ("h2d", (on_device, host))):
            _sync(device)
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            _sync(device)
            rates[direction].append(n / GIB / (time.perf_counter() - start))
    return statistics.median(rates["d2h"][1:]), statistics.median(rates["h2d"][1:])


def prefill_rate(engine, tokens: int, repeat: int) -> float:
    rates = []
    for i in range(repeat):
        prompt = [(97 * j + 13 * i) % 5000 + 100 for j in range(tokens)]  # distinct prompts: no prefix reuse
        events = engine.generate(EngineRequest(f"prefill{i}", prompt, max_tokens=1,
                                               sampling=SamplingParams(temperature=0.0)))
        fin = events[-1]
        assert isinstance(fin, FinishEvent), fin
        rates.append(tokens / (fin.timings.prompt_ms / 1000.0))
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-dtype", default="bf16")
    ap.add_argument("--prefill-chunk", type=int, default=1024)
    ap.add_argument("--vision", action="store_true")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--copy-mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    settings = EngineSettings(max_context=args.prompt_tokens + 64, kv_dtype=args.kv_dtype,
                              prefill_chunk=args.prefill_chunk, vision=args.vision, prefix_reuse=False)
    engine = load_engine(args.artifact, settings, dtype=args.dtype)
    try:
        costs = engine.context_costs
        d2h, h2d = copy_rates(engine.device, args.copy_mib, args.repeat)
        rate = prefill_rate(engine, args.prompt_tokens, args.repeat)
    finally:
        engine.shutdown()
    print(json.dumps({
        "transfer": [{"hardware": costs.hardware, "d2h_gib_per_s": round(d2h, 2), "h2d_gib_per_s": round(h2d, 2)}],
        "prefill": [{"hardware": costs.hardware, "signature": costs.signature, "tokens_per_s": round(rate, 1)}],
    }, indent=2))


if __name__ == "__main__":
    main()
