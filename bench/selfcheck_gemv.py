"""Decode GEMV (ninfer.kernels.triton_gemv) on a CUDA device: correctness, speed, offline tuning.

    python -m bench.selfcheck_gemv                  # check, tune, check + time the tuned table
    python -m bench.selfcheck_gemv --only check,time  # the built-in table only

About 45 s in all on an H200 (compiles included); every record is one JSON line on stdout.

- `check_gemv`: max abs diff against cuBLAS (F.linear) and against an fp32 reference for the
  Qwen3.6-27B linear shapes at M in {1, 8}, odd shapes with a bias, run-to-run and eager-vs-graph
  bitwise equality (split-K and not).
- `time_gemv`: per shape and M in {1, 2, 4, 8}, the Triton kernel (the heuristic's config) against
  cuBLAS, each timed as CUDA-graph replays of a loop over several distinct weight copies (>= ~1 GB
  in all, so the 50 MB L2 holds none of it), with GB/s and the fraction of the device copy bandwidth
  (a device-to-device copy timed the same way, bytes read + written); plus the whole decode step's
  linears (27B layer counts) at each M.
- `tune_gemv`: a handful of candidate configs per (M bucket, shape class), weighted by how often
  each shape runs in a decode step; prints the winners as the `_TABLE` literal for triton_gemv.py.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

# Qwen3.6-27B decode linears: name -> (N, K, times per decode step). 64 layers: 48 Gated DeltaNet
# (in-projection qkv+z+b+a, out_proj) and 16 attention (q+gate/k/v, o_proj); 64 MLPs; the lm_head.
SHAPES_27B = {
    "gdn_in_proj": (10240 + 6144 + 48 + 48, 5120, 48),
    "attn_qkv": (12288 + 1024 + 1024, 5120, 16),
    "mlp_gate_up": (2 * 17408, 5120, 64),
    "lm_head": (248320, 5120, 1),
    "mlp_down": (5120, 17408, 64),
    "o_proj_out_proj": (5120, 6144, 64),
}
ODD_SHAPES = [(1000, 999), (4099, 64), (64, 4100), (257, 8192)]  # N, K


def _emit(rec: dict) -> dict:
    print(json.dumps(rec), flush=True)
    return rec


def _weights(n: int, k: int, dtype, device, copies: int = 1, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn((n, k), generator=g, device=device, dtype=torch.float32).mul_(k**-0.5).to(dtype)
            for _ in range(copies)]


def _x(m: int, k: int, dtype, device, seed: int = 1) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn((m, k), generator=g, device=device, dtype=torch.float32).to(dtype)


# ---- correctness ----------------------------------------------------------------------------------


@torch.no_grad()
def check_gemv(device="cuda", dtype=torch.bfloat16, ms=(1, 8)) -> list[dict]:
    """Max abs diffs: ours vs cuBLAS, ours vs fp32 and cuBLAS vs fp32 (the rounding floor)."""
    from ninfer.kernels import triton_gemv

    device = torch.device(device)
    out = []
    cases = [(name, n, k, False) for name, (n, k, _) in SHAPES_27B.items()]
    cases += [(f"odd_{n}x{k}", n, k, True) for n, k in ODD_SHAPES]
    for name, n, k, with_bias in cases:
        (w,) = _weights(n, k, dtype, device)
        b = _x(1, n, dtype, device, seed=3)[0] if with_bias else None
        for m in (ms if not with_bias else (1, 3, 8, 16)):
            x = _x(m, k, dtype, device, seed=m)
            got = triton_gemv.gemv(x, w, b).float()
            cublas = F.linear(x, w, b).float()
            ref = F.linear(x.float(), w.float(), None if b is None else b.float())
            cfg = triton_gemv.pick_config(m, n, k, device, dtype)
            rec = dict(kind="check", shape=name, m=m, n=n, k=k, config=cfg.short(),
                       vs_cublas=(got - cublas).abs().max().item(), vs_fp32=(got - ref).abs().max().item(),
                       cublas_vs_fp32=(cublas - ref).abs().max().item(), ref_max=ref.abs().max().item(),
                       finite=bool(torch.isfinite(got).all().item()))
            rec["ok"] = rec["finite"] and rec["vs_fp32"] <= 2 * rec["cublas_vs_fp32"] + 1e-2 * rec["ref_max"]
            out.append(_emit(rec))
            del got, cublas, ref
        del w
    # determinism: run to run and CUDA-graph replay vs eager, the table's configs and a forced split-K
    forced = triton_gemv.GemvConfig(dot=True, block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=4)
    for name in ("mlp_down", "mlp_gate_up"):
        n, k, _ = SHAPES_27B[name]
        (w,) = _weights(n, k, dtype, device, seed=5)
        for m, cfg in ((1, None), (8, None), (2, forced)):
            x = _x(m, k, dtype, device, seed=7)
            a, b2 = triton_gemv.gemv(x, w, config=cfg), triton_gemv.gemv(x, w, config=cfg)
            torch.cuda.synchronize(device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y = triton_gemv.gemv(x, w, config=cfg)
            y.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize(device)
            used = cfg or triton_gemv.pick_config(m, n, k, device, dtype)
            rec = dict(kind="determinism", shape=name, m=m, config=used.short(), run_to_run=bool(torch.equal(a, b2)),
                       graph_vs_eager=bool(torch.equal(a, y)))
            rec["ok"] = rec["run_to_run"] and rec["graph_vs_eager"]
            out.append(_emit(rec))
            del g
    return out


# ---- timing ---------------------------------------------------------------------------------------


def _time_graph(fn, x, ws, device, min_ms=3.0, replays=7) -> float:
    """Seconds per call: CUDA-graph replays of `reps` passes over the weight copies, median replay."""
    for w in ws:  # compile / warm up outside the capture
        fn(x, w)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    e0.record()
    for w in ws:
        fn(x, w)
    e1.record()
    torch.cuda.synchronize(device)
    per_pass = max(e0.elapsed_time(e1), 1e-3)
    reps = max(1, min(64, math.ceil(min_ms / per_pass)))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for w in ws:
                fn(x, w)
    g.replay()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(replays):
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize(device)
        times.append(e0.elapsed_time(e1))
    del g
    times.sort()
    return times[len(times) // 2] / 1e3 / (reps * len(ws))


def copy_bandwidth(device="cuda", sizes_mib=(256, 1024, 2048)) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written (best of a few sizes,
    each far past the L2; the copies timed as CUDA-graph replays like the GEMVs)."""
    device = torch.device(device)
    best = 0.0
    for mib in sizes_mib:
        src = torch.empty(mib * 2**20 // 2, dtype=torch.bfloat16, device=device).normal_()
        dsts = [torch.empty_like(src) for _ in range(2)]
        t = _time_graph(lambda s, d: d.copy_(s), src, dsts, device, min_ms=10.0)
        best = max(best, 2 * src.numel() * src.element_size() / t)
        del src, dsts
    return best


def _copies(n: int, k: int, dtype) -> int:
    nbytes = n * k * torch.finfo(dtype).bits // 8
    return max(2, min(8, math.ceil(1e9 / nbytes)))


def _cublas(x, w):
    return F.linear(x, w)


@torch.no_grad()
def time_gemv(device="cuda", dtype=torch.bfloat16, ms=(1, 2, 4, 8)) -> list[dict]:
    from ninfer.kernels import triton_gemv

    device = torch.device(device)
    bw = copy_bandwidth(device)
    out = [_emit(dict(kind="copy_bandwidth", gbps=bw / 1e9))]
    step = {m: {"triton_s": 0.0, "cublas_s": 0.0, "bytes": 0} for m in ms}
    esize = torch.finfo(dtype).bits // 8
    for name, (n, k, count) in SHAPES_27B.items():
        ws = _weights(n, k, dtype, device, copies=_copies(n, k, dtype))
        for m in ms:
            x = _x(m, k, dtype, device, seed=m)
            nbytes = (n * k + m * k + m * n) * esize
            t_tri = _time_graph(triton_gemv.gemv, x, ws, device)
            t_cub = _time_graph(_cublas, x, ws, device)
            cfg = triton_gemv.pick_config(m, n, k, device, dtype)
            out.append(_emit(dict(
                kind="time", shape=name, m=m, n=n, k=k, config=cfg.short(), triton_us=t_tri * 1e6,
                cublas_us=t_cub * 1e6, triton_gbps=nbytes / t_tri / 1e9, cublas_gbps=nbytes / t_cub / 1e9,
                triton_frac_copy=nbytes / t_tri / bw, cublas_frac_copy=nbytes / t_cub / bw,
                speedup=t_cub / t_tri)))
            step[m]["triton_s"] += count * t_tri
            step[m]["cublas_s"] += count * t_cub
            step[m]["bytes"] += count * nbytes
        del ws
    for m in ms:
        s = step[m]
        floor = s["bytes"] / bw
        out.append(_emit(dict(kind="decode_step_linears", m=m, gbytes=s["bytes"] / 1e9, copy_floor_ms=floor * 1e3,
                              triton_ms=s["triton_s"] * 1e3, cublas_ms=s["cublas_s"] * 1e3,
                              triton_frac=floor / s["triton_s"], cublas_frac=floor / s["cublas_s"])))
    return out


# ---- offline tuning -------------------------------------------------------------------------------


def candidates(m: int):
    """A handful of configs around the winners of earlier tuning runs on an H200."""
    from ninfer.kernels.triton_gemv import GemvConfig as C

    dot = [C(True, 64, 128, 1, 4, 4), C(True, 64, 128, 1, 4, 6), C(True, 32, 128, 1, 4, 6),
           C(True, 128, 128, 0, 4, 4), C(True, 64, 128, 1, 4, 5), C(True, 64, 256, 1, 4, 4),
           C(True, 32, 128, 1, 4, 8), C(True, 64, 128, 1, 8, 6), C(True, 128, 64, 1, 4, 8)]
    fma = [C(False, 4, 256, 1, 2, 4), C(False, 4, 1024, 1, 4, 3), C(False, 4, 512, 1, 4, 3),
           C(False, 2, 256, 1, 2, 4), C(False, 4, 256, 1, 2, 6), C(False, 4, 512, 1, 2, 4),
           C(False, 8, 128, 1, 2, 6), C(False, 2, 512, 1, 2, 4), C(False, 8, 256, 1, 2, 4),
           C(False, 4, 128, 1, 1, 8), C(False, 4, 2048, 1, 8, 3)]
    return (fma + dot) if m <= 4 else dot


@torch.no_grad()
def tune_gemv(device="cuda", dtype=torch.bfloat16, ms=(1, 2, 4, 8, 16), budget_s: float = 420.0) -> dict:
    """Time the candidates on the 27B shapes; per (M bucket, shape class) the config with the least
    decode-step time (count-weighted over the class's shapes). Prints and returns the table."""
    from ninfer.kernels import triton_gemv

    device = torch.device(device)
    start = time.monotonic()
    classes: dict[str, list[str]] = {}
    for name, (n, k, _) in SHAPES_27B.items():
        classes.setdefault(triton_gemv.shape_class(n, k), []).append(name)
    totals: dict[tuple[int, str], dict[str, float]] = {}
    configs = {}
    for cls, names in classes.items():
        for name in names:
            n, k, count = SHAPES_27B[name]
            ws = _weights(n, k, dtype, device, copies=_copies(n, k, dtype))
            for m in ms:
                x = _x(m, k, dtype, device, seed=m)
                key = (triton_gemv.m_bucket(m), cls)
                row = totals.setdefault(key, {})
                row_cublas = _time_graph(_cublas, x, ws, device)
                row["cublas"] = row.get("cublas", 0.0) + count * row_cublas
                times = {}
                for cand in candidates(m):
                    label = cand.short()
                    configs[label] = cand
                    if time.monotonic() - start > budget_s:
                        t = float("inf")
                    else:
                        try:
                            t = _time_graph(lambda x_, w_, c=cand: triton_gemv.gemv(x_, w_, config=c), x, ws, device)
                        except Exception as e:  # a config that does not compile here
                            _emit(dict(kind="tune_error", config=label, shape=name, m=m, error=repr(e)[:200]))
                            t = float("inf")
                    times[label] = t * 1e6
                    row[label] = row.get(label, 0.0) + count * t
                _emit(dict(kind="tune_shape", shape=name, m=m, n=n, k=k, best=min(times, key=times.get),
                           cublas_us=round(row_cublas * 1e6, 2), elapsed_s=round(time.monotonic() - start, 1),
                           us={c: round(v, 2) for c, v in times.items()}))
            del ws
    table = {}
    for key, row in sorted(totals.items()):
        best = min((c for c in row if c != "cublas"), key=row.get)
        table[key] = configs[best]
        _emit(dict(kind="tune_winner", m_bucket=key[0], shape_class=key[1], config=best,
                   step_us=row[best] * 1e6, cublas_step_us=row["cublas"] * 1e6,
                   runner_up=sorted((c for c in row if c != "cublas"), key=row.get)[1:3]))
    literal = "{\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in table.items()) + "}"
    _emit(dict(kind="tune_table", elapsed_s=time.monotonic() - start, python=literal))
    return table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="check,time,tune", help="comma list of check, time, tune")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tune-budget-s", type=float, default=300.0)
    ap.add_argument("--no-apply", action="store_true", help="time the built-in table, not the tuned one")
    args = ap.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    parts = set(args.only.split(","))
    t0 = time.monotonic()
    ok = True
    if "check" in parts:
        ok = all(r["ok"] for r in check_gemv(args.device, dtype))
    if "tune" in parts:
        table = tune_gemv(args.device, dtype, budget_s=args.tune_budget_s)
        if not args.no_apply:  # the timing below then shows the tuned table
            from ninfer.kernels import triton_gemv

            triton_gemv._TABLE.update(table)
            triton_gemv.pick_config.cache_clear()
            if "check" in parts:
                ok = all(r["ok"] for r in check_gemv(args.device, dtype)) and ok
    if "time" in parts:
        time_gemv(args.device, dtype)
    _emit(dict(kind="done", ok=ok, elapsed_s=time.monotonic() - t0,
               device=torch.cuda.get_device_name(args.device), torch=torch.__version__,
               triton=__import__("triton").__version__))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
