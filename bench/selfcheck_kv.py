"""Quantized-KV (fp8 / int8 / nvfp4 / k8v4) kernel checks, shared by tests/test_kv_dtype.py and a GPU run.

`check_attention_quantized` quantizes a random paged cache with the torch reference
(`attention.quantize_kv`), then compares
- the Triton decode (each split count) / prefill kernels against `paged_attention_ref` on the same
  quantized cache (same stored values: this is kernel error only, tolerances as for bf16/fp32);
- the Triton quantizing write (`triton_attention.write_kv_quantized`) against `quantize_kv`;
and reports, apart, how far quantized attention is from attention over the unquantized cache.
The kernels also run on CPU tensors under TRITON_INTERPRET=1.

On an H200 (kernels in bf16 and fp32, the Qwen3.6-27B attention shape for nvfp4 / k8v4, decode
attention timings at 1k / 8k / 32k context with the NVFP4 tile candidates, tokens per GiB, then
the engine with decode CUDA graphs and the sync check):
    python3 -m bench.selfcheck_kv
    python3 -m bench.selfcheck_kv --kv-dtypes nvfp4 k8v4 --no-engine   # the new storages only
On a CPU (Triton's interpreter: small shapes, fp32, the timing code on tiny shapes, untimed; no engine):
    python3 -m bench.selfcheck_kv --quick
Every record is one JSON line; the last line counts the records within tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
from functools import partial

import torch

from bench.selfcheck import attention_problem, default_lengths
from ninfer.forward import KV_STORAGE, CacheSpec, kv_row_width
from ninfer.kernels.attention import dequantize_kv, paged_attention_ref, quantize_kv

QUANTIZED = ("fp8", "int8", "nvfp4", "k8v4")
QWEN27B_ATTN = dict(hq=24, hkv=4, head_dim=256)  # Qwen3.6-27B full-attention layers (16 of its 64)
QWEN27B_SPEC = CacheSpec(num_attn_layers=16, num_kv_heads=4, head_dim=256)


def quantized_layers(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_dtype: str):
    """One layer's caches [S, Hkv, D] quantized as write_kv stores them: ((k values, k scales), (v values,
    v scales)), scales [S, Hkv] fp32 (NVFP4 values: rows [S, Hkv, D/2 + D/16] uint8)."""
    k_storage, v_storage = KV_STORAGE[kv_dtype]
    return quantize_kv(k_cache, k_storage), quantize_kv(v_cache, v_storage)


def empty_layer(storage: torch.dtype, slots: int, hkv: int, head_dim: int, device):
    """A zeroed quantized layer (values, fp32 scales), as ModelCache allocates it."""
    values = torch.zeros((slots, hkv, kv_row_width(storage, head_dim)), dtype=storage, device=device)
    return values, torch.zeros((slots, hkv), dtype=torch.float32, device=device)


def check_attention_quantized(device, dtype, kv_dtype: str, *, decode: bool, hq=8, hkv=2, head_dim=64,
                              page_size=16, cached=None, new=None, seed=0) -> dict:
    from ninfer.kernels import triton_attention

    cached, new = default_lengths(decode, cached, new)
    q, kc, vc, batch = attention_problem(device, dtype, hq=hq, hkv=hkv, head_dim=head_dim, page_size=page_size,
                                         cached=cached, new=new, seed=seed)
    scale = head_dim**-0.5
    (kq, ks), (vq, vs) = quantized_layers(kc, vc, kv_dtype)
    scales = dict(k_scale=ks, v_scale=vs)
    ref = paged_attention_ref(q, kq, vq, batch, page_size, scale, **scales).float()
    exact = paged_attention_ref(q, kc, vc, batch, page_size, scale).float()
    if decode:
        got = triton_attention.paged_decode(q, kq, vq, batch.page_table, batch.seq_lens, page_size, scale, **scales)
        diffs = {"out": (got.float() - ref).abs().max().item()}
        for splits in (1, 3):
            alt = triton_attention.paged_decode(q, kq, vq, batch.page_table, batch.seq_lens, page_size, scale,
                                                num_splits=splits, **scales)
            diffs[f"out_splits{splits}"] = (alt.float() - ref).abs().max().item()
    else:
        got = triton_attention.paged_prefill(q, kq, vq, batch.query_start_loc, batch.seq_lens, batch.page_table,
                                             page_size, scale, max(batch.query_lens_cpu), **scales)
        diffs = {"out": (got.float() - ref).abs().max().item()}
    return {"max_abs_diff": diffs, "ref_absmax": ref.abs().max().item(),
            "quantization_error": {"attention_vs_unquantized": (ref - exact).abs().max().item(),
                                   "unquantized_absmax": exact.abs().max().item()}}


def check_write_quantized(device, dtype, kv_dtype: str, *, tokens=37, hkv=3, head_dim=80, slots=128,
                          seed=0) -> dict:
    """The Triton quantizing write against `quantize_kv`: stored values (dequantized, over each row's
    amax) and scales; rows the write must not touch stay zero. NVFP4 rows need head_dim % 16 == 0:
    an 80-dim head is five blocks."""
    from ninfer.kernels import triton_attention

    gen = torch.Generator().manual_seed(seed)
    k_storage, v_storage = KV_STORAGE[kv_dtype]
    k = (torch.randn((tokens, hkv, head_dim), generator=gen) * torch.rand((tokens, hkv, 1), generator=gen) * 8)
    k[0, 0] = 0.0  # an all-zero row
    k[1, 0, :7] = 1e-3  # values in e4m3's subnormal range after scaling
    k[2, 1, 16:32] = 1e-7  # an NVFP4 block whose E4M3 scale underflows to 0
    v = torch.randn((tokens, hkv, head_dim), generator=gen)
    v[3, -1, :16] *= 1e-4  # an NVFP4 block with a subnormal E4M3 scale
    k, v = k.to(dtype=dtype, device=device), v.to(dtype=dtype, device=device)
    where = torch.randperm(slots, generator=gen)[:tokens].to(device)
    kc, ks = empty_layer(k_storage, slots, hkv, head_dim, device)
    vc, vs = empty_layer(v_storage, slots, hkv, head_dim, device)
    triton_attention.write_kv_quantized(kc, vc, ks, vs, k, v, where)
    out = {}
    for name, cache, scales, x, storage in (("k", kc, ks, k, k_storage), ("v", vc, vs, v, v_storage)):
        values, scale = quantize_kv(x, storage)
        amax = x.float().abs().amax(-1, keepdim=True).clamp_min(1e-30)
        got = dequantize_kv(cache[where], scales[where], torch.float32)
        want = dequantize_kv(values, scale, torch.float32)
        out[f"{name}_values_over_amax"] = ((got - want).abs() / amax).max().item()
        out[f"{name}_scale_rel"] = ((scales[where] - scale).abs() / scale).max().item()
        out[f"{name}_bytes_mismatch_fraction"] = (
            (cache[where].view(torch.uint8) != values.view(torch.uint8)).float().mean().item())
        untouched = torch.ones(slots, dtype=torch.bool, device=device)
        untouched[where] = False
        out[f"{name}_untouched_nonzero"] = float(cache[untouched].view(torch.uint8).any().item()
                                                 or scales[untouched].any().item())
    return out


# Tolerances of the kernel-vs-reference outputs (over the reference's absmax, as in test_kernels)
# and of the write (one quantization step over the row's amax: int8 1/127; fp8 the top binade's step
# 32/448; NVFP4 the top step of a block holding the row's amax, 2 of 6).
ATTN_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
WRITE_TOL = {"int8": 1.0 / 127 + 1e-6, "fp8": 32.0 / 448 + 1e-6, "nvfp4": 2.0 / 6 + 1e-6}


def _write_tol(kv_dtype: str) -> tuple[float, float]:
    """(K, V) write tolerances: k8v4 is int8 K and NVFP4 V."""
    if kv_dtype == "k8v4":
        return WRITE_TOL["int8"], WRITE_TOL["nvfp4"]
    return WRITE_TOL[kv_dtype], WRITE_TOL[kv_dtype]


ATTENTION_CASES = [
    dict(decode=True),
    dict(decode=True, hq=12, hkv=2, head_dim=256, cached=[3, 100, 700], new=[1, 1, 1]),
    dict(decode=False),
    dict(decode=False, hq=6, hkv=1, head_dim=128, cached=[0, 50], new=[100, 20]),
    dict(decode=False, hq=12, hkv=2, head_dim=256, cached=[0, 70], new=[150, 30]),  # the D=256 launch
]
# the Qwen3.6-27B attention shape (decode rows, a prefill chunk after a cached prefix)
QWEN27B_CASES = [
    dict(decode=True, **QWEN27B_ATTN, cached=[0, 16, 1000, 4100], new=[1, 1, 1, 1]),
    dict(decode=False, **QWEN27B_ATTN, cached=[0, 1500], new=[300, 64]),
]
QUICK_CASES = [  # the interpreter on a CPU: small shapes
    dict(decode=True, hq=4, hkv=2, head_dim=32, cached=[0, 20], new=[1, 1]),
    dict(decode=False, hq=4, hkv=2, head_dim=32, page_size=4, cached=[0, 9], new=[12, 3]),
]


def run_all(device="cuda", dtypes=(torch.bfloat16, torch.float32), kv_dtypes=("fp8", "int8"),
            cases=ATTENTION_CASES, write_shape: dict | None = None) -> list[dict]:
    """Every case; each record says whether it is within tolerance."""
    records = []
    for dtype in dtypes:
        for kv_dtype in kv_dtypes:
            for case in cases:
                r = check_attention_quantized(device, dtype, kv_dtype, **case)
                worst = max(r["max_abs_diff"].values())
                records.append({"check": "attention", "dtype": str(dtype), "kv_dtype": kv_dtype, **case, **r,
                                "ok": worst <= ATTN_TOL[dtype] * max(1.0, r["ref_absmax"])})
            w = check_write_quantized(device, dtype, kv_dtype, **(write_shape or {}))
            k_tol, v_tol = _write_tol(kv_dtype)
            ok = (w["k_values_over_amax"] <= k_tol and w["v_values_over_amax"] <= v_tol
                  and max(w["k_scale_rel"], w["v_scale_rel"]) <= 1e-6
                  and not (w["k_untouched_nonzero"] or w["v_untouched_nonzero"]))
            records.append({"check": "write", "dtype": str(dtype), "kv_dtype": kv_dtype, **(write_shape or {}), **w,
                            "ok": ok})
    return records


# ---- timings (CUDA; --quick runs the same code on CPU tensors in the interpreter, tiny, untimed) ----------

CONTEXTS = (1024, 8192, 32768)
CACHE_SLOTS = 131072  # a served pool is large: the split count is then the one a server uses
DECODE_TILES = [(32, 4, 2), (32, 8, 2), (64, 4, 2), (64, 8, 2), (128, 4, 3), (128, 8, 2)]  # BLOCK_N, warps, stages
PREFILL_TILES = [(128, 64, 8), (64, 32, 8), (64, 64, 4), (128, 32, 8)]  # BLOCK_M, BLOCK_N, warps
PREFILL_SHAPE = (4096, 1024)  # cached, new
QUICK_TIMING = dict(device="cpu", contexts=(40,), cache_slots=128, decode_tiles=DECODE_TILES[:1],
                    prefill_tiles=[(16, 16, 4)], prefill_shape=(32, 16))


def _timing_cache(kv_dtype: str, slots: int, hkv: int, head_dim: int, device, gen: torch.Generator):
    """A full random cache: (k, v, k_scale, v_scale), quantized by the Triton write."""
    from ninfer.kernels import triton_attention

    k = torch.randn((slots, hkv, head_dim), generator=gen, device=gen.device).to(device, torch.bfloat16)
    v = torch.randn((slots, hkv, head_dim), generator=gen, device=gen.device).to(device, torch.bfloat16)
    if kv_dtype == "bf16":
        return k, v, None, None
    k_storage, v_storage = KV_STORAGE[kv_dtype]
    kc, ks = empty_layer(k_storage, slots, hkv, head_dim, device)
    vc, vs = empty_layer(v_storage, slots, hkv, head_dim, device)
    triton_attention.write_kv_quantized(kc, vc, ks, vs, k, v, torch.arange(slots, device=device))
    return kc, vc, ks, vs


def _us(fn, device) -> float:
    """Median microseconds of fn on CUDA; on a CPU (the interpreter's dry run) one call, untimed: 0."""
    if torch.device(device).type != "cuda":
        fn()
        return 0.0
    import triton

    return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def _tile_sweep(run, tiles, base, device) -> dict:
    """{"a/b/c": {us, max_abs_diff against the default tiles}} for each candidate."""
    out = {}
    for t in tiles:
        err = (run(tiles=t).float() - base.float()).abs().max().item()
        out["/".join(map(str, t))] = {"us": _us(partial(run, tiles=t), device), "max_abs_diff": err}
    return out


def time_attention(kv_dtypes=("bf16", *QUANTIZED), sweep=("nvfp4", "k8v4"), *, device="cuda", contexts=CONTEXTS,
                   cache_slots=CACHE_SLOTS, decode_tiles=DECODE_TILES, prefill_tiles=PREFILL_TILES,
                   prefill_shape=PREFILL_SHAPE, page_size=16, seed=0) -> list[dict]:
    """Batch-1 decode attention of one 27B layer (24 q heads, 4 KV heads, D 256, bf16 queries) at each
    context over a `cache_slots` pool (scattered pages): microseconds with the default tiles, and for the
    `sweep` storages each of `decode_tiles` (its max error against the default tiles beside it). Then one
    prefill chunk (`prefill_shape`: new tokens after cached ones) per storage, `prefill_tiles` swept likewise."""
    from ninfer.kernels import triton_attention

    hq, hkv, head_dim = QWEN27B_ATTN["hq"], QWEN27B_ATTN["hkv"], QWEN27B_ATTN["head_dim"]
    gen = torch.Generator(device="cuda" if torch.device(device).type == "cuda" else "cpu").manual_seed(seed)
    scale = head_dim**-0.5
    table = torch.randperm(cache_slots // page_size, generator=gen, device=gen.device).to(device, torch.int32)[None]
    q = torch.randn((1, hq, head_dim), generator=gen, device=gen.device).to(device, torch.bfloat16)
    splits = triton_attention.pick_num_splits(torch.device(device), hkv, cache_slots)
    records = []
    for kv_dtype in kv_dtypes:
        kc, vc, ks, vs = _timing_cache(kv_dtype, cache_slots, hkv, head_dim, device, gen)
        scales = dict(k_scale=ks, v_scale=vs)
        for ctx in contexts:
            lens = torch.tensor([ctx], dtype=torch.int32, device=device)
            pages = table[:, : -(-ctx // page_size)].contiguous()
            decode = partial(triton_attention.paged_decode, q, kc, vc, pages, lens, page_size, scale, **scales)
            rec = {"check": "decode_timing", "kv_dtype": kv_dtype, "context": ctx, "num_splits": splits,
                   "us": _us(decode, device)}
            if kv_dtype in sweep:
                rec["tiles_us"] = _tile_sweep(decode, decode_tiles, decode(), device)
            records.append(rec)
        cached, new = prefill_shape
        qp = torch.randn((new, hq, head_dim), generator=gen, device=gen.device).to(device, torch.bfloat16)
        qsl = torch.tensor([0, new], dtype=torch.int32, device=device)
        lens = torch.tensor([cached + new], dtype=torch.int32, device=device)
        pages = table[:, : -(-(cached + new) // page_size)].contiguous()
        prefill = partial(triton_attention.paged_prefill, qp, kc, vc, qsl, lens, pages, page_size, scale, new, **scales)
        rec = {"check": "prefill_timing", "kv_dtype": kv_dtype, "cached": cached, "new": new, "us": _us(prefill, device)}
        if kv_dtype in sweep:
            rec["tiles_us"] = _tile_sweep(prefill, prefill_tiles, prefill(), device)
        records.append(rec)
        del kc, vc, ks, vs
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return records


def capacity_records(kv_dtypes=("bf16", *QUANTIZED), spec: CacheSpec = QWEN27B_SPEC) -> list[dict]:
    """KV bytes per token and tokens per GiB of the 27B cache (16 attention layers, 4 KV heads, D 256)."""
    bf16 = spec.kv_bytes_per_token(torch.bfloat16, "bf16")
    return [{"check": "capacity", "kv_dtype": kv_dtype, "bytes_per_token": spec.kv_bytes_per_token(torch.bfloat16, kv_dtype),
             "tokens_per_gib": 2**30 // spec.kv_bytes_per_token(torch.bfloat16, kv_dtype),
             "tokens_vs_bf16": bf16 / spec.kv_bytes_per_token(torch.bfloat16, kv_dtype)} for kv_dtype in kv_dtypes]


def engine_checks(device="cuda", dtype=torch.bfloat16, preset="tiny-qwen3.6",
                  kv_dtypes=("fp8", "int8", "nvfp4", "k8v4")) -> list[dict]:
    """CUDA only: per KV storage, greedy output with decode CUDA graphs equals eager, the decode step
    makes no host sync, and (informational) where greedy output first departs from bf16 KV."""
    from bench import selfcheck
    from ninfer.artifact.presets import get_preset, instantiate, tokenizer_json_for
    from ninfer.tokenizer import Tokenizer

    model = instantiate(preset, device, dtype, seed=0)
    tok = Tokenizer.from_json_str(tokenizer_json_for(get_preset("tiny-qwen3.6"))[0])
    prompts = [[(7 * i + 13 * j) % 900 + 50 for j in range(n)] for i, n in enumerate([3, 17, 5, 40, 9, 26, 2, 33])]
    records, base = [], None
    for kv_dtype in ("bf16", *kv_dtypes):
        run = dict(concurrency=8, prompts=prompts, max_tokens=16, kv_dtype=kv_dtype)
        graphs = selfcheck.engine_greedy(model, tok, device, dtype, no_cuda_graph=False, **run)
        eager = selfcheck.engine_greedy(model, tok, device, dtype, no_cuda_graph=True, **run)
        sync = selfcheck.runner_sync_check(model, device, dtype, kv_dtype=kv_dtype)
        base = base or graphs["outputs"]
        first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(base, graphs["outputs"])]
        records.append({"check": "engine", "preset": preset, "kv_dtype": kv_dtype, "graph_status": graphs["graph_status"],
                        "graph_replays": graphs["graph_replays"], "host_sync": sync["host_sync_in_decode_step"],
                        "first_mismatch_vs_bf16": first,
                        "ok": graphs["outputs"] == eager["outputs"] and graphs["graph_replays"] > 0
                        and sync["host_sync_in_decode_step"] == "none"})
    return records


def summary(records: list[dict], info: list[dict]) -> dict:
    """One line of the figures that matter: per storage the worst kernel error (over max(1, ref absmax)) of
    each dtype's attention checks, whether its writes matched, decode microseconds per context (and
    the fastest swept tiles), prefill microseconds, tokens per GiB of the 27B cache."""
    out = {"check": "summary", "attention_err": {}, "write_ok": {}, "decode_us": {}, "decode_best_tiles": {},
           "prefill_us": {}, "tokens_per_gib": {}}
    for r in records:
        key = f"{r['kv_dtype']}/{r.get('dtype', '')}".rstrip("/")
        if r.get("hq") == QWEN27B_ATTN["hq"] or r.get("head_dim") == 256 and r.get("hkv") == QWEN27B_ATTN["hkv"]:
            key += "/27b_shape"
        if r["check"] == "attention":
            err = max(r["max_abs_diff"].values()) / max(1.0, r["ref_absmax"])
            out["attention_err"][key] = max(out["attention_err"].get(key, 0.0), err)
        elif r["check"] == "write":
            out["write_ok"][key] = out["write_ok"].get(key, True) and r["ok"]
    for r in info:
        kv = r["kv_dtype"]
        if r["check"] == "capacity":
            out["tokens_per_gib"][kv] = r["tokens_per_gib"]
        elif r["check"] == "decode_timing":
            out["decode_us"].setdefault(kv, {})[r["context"]] = r["us"]
            if "tiles_us" in r:
                best = min(r["tiles_us"].items(), key=lambda t: t[1]["us"])
                out["decode_best_tiles"].setdefault(kv, {})[r["context"]] = {"tiles": best[0], **best[1]}
        elif r["check"] == "prefill_timing":
            out["prefill_us"][kv] = r["us"]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv-dtypes", nargs="+", default=list(QUANTIZED), choices=QUANTIZED)
    ap.add_argument("--quick", action="store_true",
                    help="small shapes in fp32, the timing code untimed on tiny shapes, no engine (a CPU)")
    ap.add_argument("--no-engine", action="store_true", help="skip the engine checks (they need the Qwen tokenizer)")
    ap.add_argument("--no-timing", action="store_true", help="skip the decode / prefill attention timings")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.quick
    if not cuda:  # the kernels on CPU tensors: Triton's interpreter, read when their modules are imported (below)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = "cuda" if cuda else "cpu"
    new = [d for d in args.kv_dtypes if d in ("nvfp4", "k8v4")]
    if cuda:
        records = run_all(device, kv_dtypes=args.kv_dtypes)
        records += run_all(device, dtypes=(torch.bfloat16,), kv_dtypes=new, cases=QWEN27B_CASES,
                           write_shape=dict(tokens=64, hkv=4, head_dim=256))
    else:
        records = run_all(device, dtypes=(torch.float32,), kv_dtypes=args.kv_dtypes, cases=QUICK_CASES,
                          write_shape=dict(tokens=9, hkv=2, head_dim=32, slots=24))
    for r in records:
        print(json.dumps(r, default=str), flush=True)
    info = capacity_records(("bf16", *args.kv_dtypes))
    if not args.no_timing:  # a CPU: the same code in the interpreter on tiny shapes, figures 0
        timed = tuple(dict.fromkeys(("bf16", "fp8", "int8", *args.kv_dtypes)))  # the new storages beside the old
        info += time_attention(timed, sweep=new, **({} if cuda else QUICK_TIMING))
    for r in info:
        print(json.dumps(r), flush=True)
    if cuda and not args.no_engine:  # the engine needs the Qwen tokenizer: offline hosts set NINFER_QWEN_TOKENIZER_JSON
        for r in engine_checks(kv_dtypes=args.kv_dtypes):
            print(json.dumps(r, default=str), flush=True)
            records.append(r)
    print(json.dumps(summary(records, info)), flush=True)
    bad = [r for r in records if not r["ok"]]
    print(f"{len(records) - len(bad)}/{len(records)} quantized-KV checks within tolerance")
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
