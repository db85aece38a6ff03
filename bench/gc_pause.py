"""How long a full garbage collection pauses an engine process, before and after freeze_startup_objects.

Builds an engine from a preset in-process (random weights), serves a few requests so serving's own objects
exist, then times gc.collect() (a full collection, as the interpreter runs now and then inside an engine
step) several times, freezes start-up's objects as the Engine replica does, and times it again. Prints one
JSON line.

    python bench/gc_pause.py                          # tiny-qwen3.6 on this machine's CPU
    python bench/gc_pause.py --preset qwen3.6-27b --weights nvfp4   # on a GPU host
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from statistics import median


def full_collection_ms(repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - start) * 1e3)
    return round(median(times), 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny-qwen3.6")
    p.add_argument("--weights", choices=["bf16", "nvfp4"], default="bf16")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dry-run", action="store_true", help="the tiny preset on the CPU, two collections each")
    args = p.parse_args()
    if args.dry_run:
        args.preset, args.weights, args.repeat = "tiny-qwen3.6", "bf16", 2

    import torch

    from ninfer.engine.engine import EngineSettings
    from ninfer.engine.loader import engine_from_preset
    from ninfer.engine.types import EngineRequest, SamplingParams
    from ninfer.server.gc_freeze import freeze_startup_objects

    engine = engine_from_preset(args.preset, EngineSettings(max_context=256, max_concurrency=2),
                                weights=args.weights, device=torch.device("cpu") if args.dry_run else None)
    try:
        for i in range(3):
            engine.generate(EngineRequest(f"warm{i}", list(range(100, 140)), max_tokens=8,
                                          sampling=SamplingParams(temperature=0.0)))
        tracked = len(gc.get_objects())
        before = full_collection_ms(args.repeat)
        frozen = freeze_startup_objects()
        after = full_collection_ms(args.repeat)
    finally:
        engine.shutdown()
    print(json.dumps({"kind": "gc_pause", "preset": args.preset, "weights": args.weights, "device": str(engine.device),
                      "tracked_objects": tracked, "full_collection_ms": before, "frozen": frozen,
                      "full_collection_ms_after_freeze": after}))


if __name__ == "__main__":
    main()
