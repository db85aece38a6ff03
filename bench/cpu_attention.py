"""The C decode attention alone (ninfer/kernels/cpu_decode.c): one decode row over a long context, every layer.

  python bench/cpu_attention.py --context 6000 --threads 1 2 --kv-dtypes bf16 int8 k8v4 nvfp4

SmolLM2-135M's attention shape by default (30 layers, 9 query heads, 3 KV heads, head_dim 64, pages of 16),
each layer with its own cache so the working set is a real step's (138 MB of bf16 K/V at 6,000 tokens). One JSON
line per (threads, KV dtype): milliseconds for all layers (the median of --repeats), the K/V bytes read, and the
rate in GB/s and GFLOP/s (two products a context token, query head and dimension: scores and values), and the
nanoseconds per context token and layer.

The arithmetic alone, out of cache: --sequences 16 --layers 1 --context 1024 (16 sequences read one layer's cache,
which stays in L2, in one call). NINFER_CPU_AMX=0 measures the AVX-512 passes where the CPU has AMX.
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

from ninfer.forward import KV_STORAGE, ForwardBatch  # noqa: E402
from ninfer.kernels import attention, cpu_native  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=6000)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--kv-dtypes", nargs="+", default=["bf16", "int8", "k8v4", "nvfp4"],
                    choices=["bf16", "int8", "k8v4", "nvfp4"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sequences", type=int, default=1, help="decode rows, all reading the same context")
    args = ap.parse_args()
    if cpu_native.library() is None:
        raise SystemExit("the native CPU library is unavailable (no C compiler, or NINFER_CPU_NATIVE=0)")

    page, hkv, d = 16, args.kv_heads, args.head_dim
    pages = -(-args.context // page)
    gen = torch.Generator().manual_seed(0)
    bf16 = [tuple(torch.randn(pages * page, hkv, d, generator=gen).to(torch.bfloat16) for _ in range(2))
            for _ in range(args.layers)]
    n = args.sequences
    q = torch.randn(1, args.heads, d, generator=gen).to(torch.bfloat16).expand(n, args.heads, d).contiguous()
    batch = ForwardBatch.build([[0]] * n, [args.context - 1] * n, [list(range(pages))] * n, page)
    flops = 4 * args.layers * args.heads * d * args.context * n
    for kv in args.kv_dtypes:
        if kv == "bf16":
            caches = [(k, v, None, None) for k, v in bf16]
        else:
            ks, vs = KV_STORAGE[kv]
            caches = [(kq, vq, sk, sv) for (kq, sk), (vq, sv) in
                      ((attention.quantize_kv(k, ks), attention.quantize_kv(v, vs)) for k, v in bf16)]
        kv_bytes = args.context * sum(t.element_size() * t[0].numel() + (0 if s is None else 4 * hkv)
                                      for k, v, sk, sv in caches[:1] for t, s in ((k, sk), (v, sv))) * args.layers
        for threads in args.threads:
            previous = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                def step(caches=caches):
                    for k, v, sk, sv in caches:
                        cpu_native.decode_attention(q, k, v, batch.page_table, batch.seq_lens, page, d ** -0.5, sk, sv)
                step()
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    step()
                    times.append(time.perf_counter() - t0)
            finally:
                torch.set_num_threads(previous)
            ms = statistics.median(times) * 1e3
            print(json.dumps({"kv_dtype": kv, "threads": threads, "context": args.context, "layers": args.layers,
                              "ms": round(ms, 3), "kv_mb": round(kv_bytes / 1e6, 1),
                              "gb_per_s": round(n * kv_bytes / ms / 1e6, 2), "gflop_per_s": round(flops / ms / 1e6, 1),
                              "sequences": n, "ns_per_token_layer": round(ms * 1e6 / (n * args.context * args.layers), 2),
                              "command": " ".join(sys.argv)}), flush=True)


if __name__ == "__main__":
    main()
