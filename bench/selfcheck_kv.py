"""Quantized-KV (fp8 / int8) kernel checks, shared by tests/test_kv_dtype.py and a GPU run.

`check_attention_quantized` quantizes a random paged cache with the torch reference
(`attention.quantize_kv`), then compares
- the Triton decode (each split count) / prefill kernels against `paged_attention_ref` on the same
  quantized cache (same stored values: this is kernel error only, tolerances as for bf16/fp32);
- the Triton quantizing write (`triton_attention.write_kv_quantized`) against `quantize_kv`;
and reports, apart, how far quantized attention is from attention over the unquantized cache.
The kernels also run on CPU tensors under TRITON_INTERPRET=1.

On an H200 (kernels in bf16 and fp32, then the engine with decode CUDA graphs and the sync check):
    python3 -m bench.selfcheck_kv
"""

from __future__ import annotations

import torch

from bench.selfcheck import attention_problem, default_lengths
from ninfer.forward import KV_STORAGE
from ninfer.kernels.attention import dequantize_kv, paged_attention_ref, quantize_kv


def quantized_layer(cache: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's cache [S, Hkv, D] quantized as write_kv stores it: (values, scales [S, Hkv])."""
    return quantize_kv(cache, KV_STORAGE[kv_dtype])


def check_attention_quantized(device, dtype, kv_dtype: str, *, decode: bool, hq=8, hkv=2, head_dim=64,
                              page_size=16, cached=None, new=None, seed=0) -> dict:
    from ninfer.kernels import triton_attention

    cached, new = default_lengths(decode, cached, new)
    q, kc, vc, batch = attention_problem(device, dtype, hq=hq, hkv=hkv, head_dim=head_dim, page_size=page_size,
                                         cached=cached, new=new, seed=seed)
    scale = head_dim**-0.5
    (kq, ks), (vq, vs) = quantized_layer(kc, kv_dtype), quantized_layer(vc, kv_dtype)
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
    amax) and scales; rows the write must not touch stay zero."""
    from ninfer.kernels import triton_attention

    gen = torch.Generator().manual_seed(seed)
    storage = KV_STORAGE[kv_dtype]
    k = (torch.randn((tokens, hkv, head_dim), generator=gen) * torch.rand((tokens, hkv, 1), generator=gen) * 8)
    k[0, 0] = 0.0  # an all-zero row
    k[1, 0, :7] = 1e-3  # values in e4m3's subnormal range after scaling
    v = torch.randn((tokens, hkv, head_dim), generator=gen)
    k, v = k.to(dtype=dtype, device=device), v.to(dtype=dtype, device=device)
    where = torch.randperm(slots, generator=gen)[:tokens].to(device)
    kc = torch.zeros((slots, hkv, head_dim), dtype=storage, device=device)
    vc = torch.zeros_like(kc)
    ks = torch.zeros((slots, hkv), dtype=torch.float32, device=device)
    vs = torch.zeros_like(ks)
    triton_attention.write_kv_quantized(kc, vc, ks, vs, k, v, where)
    out = {}
    for name, cache, scales, x in (("k", kc, ks, k), ("v", vc, vs, v)):
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
# and of the write (one quantization step: int8 1/127 of amax; fp8 the top binade's step 32/448).
ATTN_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
WRITE_TOL = {"int8": 1.0 / 127 + 1e-6, "fp8": 32.0 / 448 + 1e-6}

ATTENTION_CASES = [
    dict(decode=True),
    dict(decode=True, hq=12, hkv=2, head_dim=256, cached=[3, 100, 700], new=[1, 1, 1]),
    dict(decode=False),
    dict(decode=False, hq=6, hkv=1, head_dim=128, cached=[0, 50], new=[100, 20]),
    dict(decode=False, hq=12, hkv=2, head_dim=256, cached=[0, 70], new=[150, 30]),  # the D=256 launch
]


def run_all(device="cuda", dtypes=(torch.bfloat16, torch.float32), kv_dtypes=("fp8", "int8"),
            cases=ATTENTION_CASES) -> list[dict]:
    """Every case; each record says whether it is within tolerance."""
    records = []
    for dtype in dtypes:
        for kv_dtype in kv_dtypes:
            for case in cases:
                r = check_attention_quantized(device, dtype, kv_dtype, **case)
                worst = max(r["max_abs_diff"].values())
                records.append({"check": "attention", "dtype": str(dtype), "kv_dtype": kv_dtype, **case, **r,
                                "ok": worst <= ATTN_TOL[dtype] * max(1.0, r["ref_absmax"])})
            w = check_write_quantized(device, dtype, kv_dtype)
            ok = (max(w["k_values_over_amax"], w["v_values_over_amax"]) <= WRITE_TOL[kv_dtype]
                  and max(w["k_scale_rel"], w["v_scale_rel"]) <= 1e-6
                  and not (w["k_untouched_nonzero"] or w["v_untouched_nonzero"]))
            records.append({"check": "write", "dtype": str(dtype), "kv_dtype": kv_dtype, **w, "ok": ok})
    return records


def engine_checks(device="cuda", dtype=torch.bfloat16, preset="tiny-qwen3.6") -> list[dict]:
    """CUDA only: per KV storage, greedy output with decode CUDA graphs equals eager, the decode step
    makes no host sync, and (informational) where greedy output first departs from bf16 KV."""
    from bench import selfcheck
    from ninfer.artifact.presets import get_preset, instantiate, tokenizer_json_for
    from ninfer.tokenizer import Tokenizer

    model = instantiate(preset, device, dtype, seed=0)
    tok = Tokenizer.from_json_str(tokenizer_json_for(get_preset("tiny-qwen3.6"))[0])
    prompts = [[(7 * i + 13 * j) % 900 + 50 for j in range(n)] for i, n in enumerate([3, 17, 5, 40, 9, 26, 2, 33])]
    records, base = [], None
    for kv_dtype in ("bf16", "fp8", "int8"):
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


def main() -> None:
    import json

    cuda = torch.cuda.is_available()
    records = run_all("cuda" if cuda else "cpu")
    for r in records:
        print(json.dumps(r, default=str), flush=True)
    if cuda:  # the engine needs the Qwen tokenizer: offline hosts set NINFER_QWEN_TOKENIZER_JSON
        engine = engine_checks()
        for r in engine:
            print(json.dumps(r, default=str), flush=True)
        records += engine
    bad = [r for r in records if not r["ok"]]
    print(f"{len(records) - len(bad)}/{len(records)} quantized-KV checks within tolerance")
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
