"""Is a verified position computed exactly as a plain decode step? (issue 21; prints JSON lines)

Random weights at a preset shape on the device. For batches of B sequences with a cached prompt, one
verify forward of `width` tokens per sequence (ModelRunner.verify: the verify CUDA graph of (B, width))
against `width` plain decode steps over the same tokens (the decode CUDA graphs), from the same cache
contents: logits bitwise equal or the largest difference.

    python bench/verify_exactness.py --shape qwen3.6-27b --batches 1 2 4 8 --width 4
    python bench/verify_exactness.py --shape qwen3.6-27b --weights nvfp4
    python bench/verify_exactness.py --dry-run   # tiny preset on the CPU
"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3.6-27b")
    p.add_argument("--weights", choices=["bf16", "nvfp4"], default="bf16")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--prompt", type=int, default=40)
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    if args.dry_run:
        args.shape, args.batches = "tiny-qwen3.6", [1, 2]

    from ninfer.artifact.presets import get_preset, instantiate
    from ninfer.engine.runner import ModelRunner
    from ninfer.models import prepare_for_inference_

    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = instantiate(args.shape, device, dtype, seed=0, fuse=False)
    if args.weights == "nvfp4":
        from ninfer.quant.nvfp4 import quantize_model_

        quantize_model_(model)
    prepare_for_inference_(model)
    page, lanes = 16, max(args.batches)
    per = -(-(args.prompt + args.width + 1) // page)
    vocab = get_preset(args.shape).text_config()["vocab_size"]
    runner = ModelRunner(model, num_pages=lanes * per, page_size=page, num_state_slots=lanes, num_lanes=lanes,
                         vocab_size=vocab, device=device, dtype=dtype, draft_tokens=args.width - 1,
                         max_seq_len=per * page)
    print(json.dumps({"kind": "setup", "shape": args.shape, "weights": args.weights, "graph_status": runner.graph_status}), flush=True)
    cache = runner.cache
    for b in args.batches:
        seqs = [SimpleNamespace(num_computed=0, pages=list(range(i * per, (i + 1) * per)), state_slot=i, lane=i,
                                output_ids=[], mrope=None) for i in range(b)]
        with torch.inference_mode():
            for i, s in enumerate(seqs):
                runner.forward_eager([s], [[100 + 7 * i + j for j in range(args.prompt)]])
                s.num_computed = args.prompt
            saved = [t.clone() for t in (cache.k, cache.v, cache.conv, cache.ssm)]
            rows = [[500 + 13 * i + j for j in range(args.width)] for i in range(b)]
            verified = runner.verify(seqs, rows, args.width).clone()
            for t, s in zip((cache.k, cache.v, cache.conv, cache.ssm), saved):
                t.copy_(s)
            steps = []
            for j in range(args.width):
                steps.append(runner.forward(seqs, [[r[j]] for r in rows]).clone())
                for s in seqs:
                    s.num_computed += 1
            plain = torch.stack(steps, 1).reshape(verified.shape)
            same_argmax = bool(torch.equal(verified.argmax(-1), plain.argmax(-1)))
        print(json.dumps({"kind": "verify_exactness", "weights": args.weights, "batch": b, "width": args.width,
                          "bitwise_equal": bool(torch.equal(verified, plain)),
                          "max_abs_diff": (verified - plain).abs().max().item(), "same_argmax": same_argmax,
                          "verify_graph": (b, args.width) in runner.graphs}), flush=True)


if __name__ == "__main__":
    main()
