"""Speculative verification's cost against a plain decode step (issue 21, benchmark (a)).

Random weights at a preset shape, built on the device. For each concurrency C and draft count k, times
`ModelRunner.execute` of a decode StepPlan whose rows carry k drafts (k + 1 logit rows per sequence,
one traversal) against the same plan without drafts (the decode CUDA graph). Prints one JSON line per
(C, k) and a summary with the issue's goal (k = 3 verify <= 1.25x a plain step).

    python bench/spec_verify.py --shape qwen3.6-27b --weights bf16 --concurrency 1 2 4 8 --drafts 1 2 3 4 5
    python bench/spec_verify.py --dry-run   # tiny preset on the CPU: the harness itself
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import torch


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3.6-27b")
    p.add_argument("--weights", choices=["bf16", "nvfp4"], default="bf16")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--drafts", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    p.add_argument("--context", type=int, default=1024, help="tokens already in each sequence's cache")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--kv-capacity", type=int, default=65536,
                   help="KV cache tokens at least (as a served engine's: attention's split count follows capacity)")
    p.add_argument("--fast-verify", action="store_true",
                   help="verify rows as one matmul pass (EngineSettings.exact_verify=False)")
    p.add_argument("--dry-run", action="store_true", help="tiny preset on the CPU, two steps")
    args = p.parse_args()
    if args.dry_run:
        args.shape, args.concurrency, args.drafts, args.context, args.steps = "tiny-qwen3.6", [1, 2], [1, 3], 32, 2

    from ninfer.artifact.presets import get_preset, instantiate
    from ninfer.engine.plan import SeqWork, StepPlan
    from ninfer.engine.runner import ModelRunner
    from ninfer.models import prepare_for_inference_

    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = get_preset(args.shape).text_config()
    model = instantiate(args.shape, device, dtype, seed=0, fuse=False)
    if args.weights == "nvfp4":
        from ninfer.quant.nvfp4 import quantize_model_

        quantize_model_(model)
    prepare_for_inference_(model)
    page, lanes = 16, max(args.concurrency)
    lane_pages = -(-(args.context + max(args.drafts) + args.steps * (max(args.drafts) + 1) + 8) // page)
    num_pages = max(lanes * lane_pages, -(-args.kv_capacity // page))
    runner = ModelRunner(model, num_pages=num_pages, page_size=page, num_state_slots=lanes, num_lanes=lanes,
                         vocab_size=cfg["vocab_size"], device=device, dtype=dtype, cuda_graphs=True,
                         max_seq_len=lane_pages * page, draft_tokens=max(args.drafts),
                         exact_verify=not args.fast_verify)
    greedy = SimpleNamespace(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, presence_penalty=0.0,
                             frequency_penalty=0.0, seed=0, greedy=True, penalized=False)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def timed_step(seqs, k: int) -> float:
        """Median ms of `steps` plans of C rows with k drafts; the sequences stay at the same frontier (the
        same KV slots are rewritten each time), so every step sees the same context."""
        times = []
        for _ in range(args.steps + 2):
            plan = StepPlan(decode=[SeqWork(s, s.num_computed, [5] + [7] * k, draft_ids=[7] * k, decode=True)
                                    for s in seqs])
            sync()
            t = time.perf_counter()
            runner.execute(plan)
            sync()
            times.append((time.perf_counter() - t) * 1e3)
        return sorted(times[2:])[len(times[2:]) // 2]

    summary = {}
    emit(kind="spec_verify_setup", shape=args.shape, weights=args.weights, device=str(device),
         exact_verify=not args.fast_verify, graph_status=runner.graph_status, nvfp4_gemv=runner.nvfp4_status)
    for c in args.concurrency:
        seqs = [SimpleNamespace(num_computed=args.context, pages=list(range(i * lane_pages, (i + 1) * lane_pages)),
                                state_slot=i, lane=i, output_ids=[1], sampling=greedy, mrope=None) for i in range(c)]
        plain = timed_step(seqs, 0)
        for k in args.drafts:
            verify = timed_step(seqs, k)
            emit(kind="spec_verify", shape=args.shape, weights=args.weights, concurrency=c, drafts=k,
                 plain_step_ms=plain, verify_step_ms=verify, ratio=verify / plain,
                 verify_graph=(c, k + 1) in runner.graphs)
            summary[f"C{c}_k{k}"] = round(verify / plain, 3)
    k3 = [v for key, v in summary.items() if key.endswith("_k3")]
    emit(kind="summary", shape=args.shape, weights=args.weights, ratios=summary,
         goal_k3_le_1_25x={"worst": max(k3) if k3 else None, "met": bool(k3) and max(k3) <= 1.25})


if __name__ == "__main__":
    main()
