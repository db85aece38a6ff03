"""NVFP4 kernels against the torch reference, and their bandwidth, at the Qwen3.6-27B shapes.

    from bench import selfcheck_nvfp4 as s
    s.check_nvfp4("cuda", torch.bfloat16)   # {"max_abs_diff": {...}, "ref_absmax": ...}
    s.time_nvfp4_gemv("cuda")               # per shape: us and GB/s, NVFP4 kernel vs bf16 F.linear

Shapes are (N, K) of the 27B decoder's matmuls, merged as the model merges them: GDN
in_proj_qkv+z (16384 x 5120), attention q+k+v (14336 x 5120), MLP gate+up (34816 x 5120), MLP
down (5120 x 17408), o_proj / GDN out_proj (5120 x 6144).
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from ninfer.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4

SHAPES_27B = {
    "gdn_in_qkvz": (16384, 5120),
    "attn_qkv": (14336, 5120),
    "mlp_gate_up": (34816, 5120),
    "mlp_down": (5120, 17408),
    "o_proj": (5120, 6144),
}


def _problem(n: int, k: int, m: int, device, dtype, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, generator=gen, device=device, dtype=torch.float32) * 0.02
    q = quantize_nvfp4(w)
    x = torch.randn(m, k, generator=gen, device=device, dtype=torch.float32).to(dtype)
    return q, x


def check_nvfp4(device, dtype, *, shapes: dict | None = None, ms=(1, 2, 3, 4, 5, 8, 16, 17, 64), seed: int = 0,
                configs: list[dict] | None = None) -> dict:
    """Kernel (nvfp4_linear: GEMV for M <= 16, dequantize + matmul above) vs x @ dequantize(W)^T in
    fp32. Returns {"max_abs_diff": {shape_mM: diff}, "ref_absmax": max |ref|}; also the
    dequantize kernel vs the torch dequantizer (exact in fp32)."""
    from ninfer.kernels import triton_nvfp4

    diffs, absmax = {}, 0.0
    for name, (n, k) in (shapes or SHAPES_27B).items():
        q, _ = _problem(n, k, 1, device, dtype, seed)
        w = dequantize_nvfp4(*q)
        diffs[f"{name}_dequant"] = (triton_nvfp4.nvfp4_dequantize(*q, dtype=torch.float32) - w).abs().max().item()
        for m in ms:
            x = _problem(1, k, m, device, dtype, seed + m)[1]
            ref = x.float() @ w.T
            got = triton_nvfp4.nvfp4_linear(x, *q).float()
            diffs[f"{name}_m{m}"] = (got - ref).abs().max().item()
            absmax = max(absmax, ref.abs().max().item())
            if configs is not None or (m == 1 and x.is_cuda):  # every packed-fp16 GEMV candidate, or `configs`
                for cfg in configs if configs is not None else HFMA_CONFIGS + PREFETCH_CONFIGS:
                    got = triton_nvfp4.nvfp4_gemv(x, *q, config=cfg).float()
                    diffs[f"{name}_m{m}_{_short(cfg)}"] = (got - ref).abs().max().item()
        del w
    return {"max_abs_diff": diffs, "ref_absmax": absmax}


def _time(fn, iters: int) -> float:
    """Mean microseconds per call over `iters` calls captured in one CUDA graph (launch overhead
    excluded, as in the engine's decode graphs), L2 flushed before the replay."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(3):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / iters)
    return min(times)


def _rotating(fn, items: list):
    """fn(item) over items in turn, one per call (each captured call reads a different copy)."""
    state = {"i": 0}

    def call():
        item = items[state["i"] % len(items)]
        state["i"] += 1
        fn(item)

    return call


def time_nvfp4_gemv(device="cuda", *, shapes: dict | None = None, ms=(1, 2, 3, 4, 8), iters: int = 20,
                    config: dict | None = None, with_bf16: bool = True) -> list[dict]:
    """Per shape and M: microseconds and GB/s of the NVFP4 GEMV (bytes read = packed + scales +
    row scales + x, written = y) and of torch's bf16 F.linear on the same shape (bytes = 2NK + x + y).
    Each timed call reads a different copy of the weight when one copy fits in L2."""
    from ninfer.kernels import triton_nvfp4, triton_nvfp4_mma

    paired = (config or {}).get("WARPS", 0) if (config or {}).get("PAIRED") else 0  # weights stored for that launch
    pad = (config or {}).get("PAD", 0)  # bytes between stored rows (the mma GEMV: W_ROW, S_ROW)
    config = {key: v for key, v in config.items() if key != "PAD"} if config else config
    out = []
    for name, (n, k) in (shapes or SHAPES_27B).items():
        plain, _ = _problem(n, k, 1, device, torch.bfloat16)
        q = (*triton_nvfp4_mma.pair_weights(plain[0], plain[1], paired), plain[2]) if paired else plain
        if (config or {}).get("TILED"):
            q = (*triton_nvfp4_mma.tile_weights(q[0], q[1], paired), q[2])
        copies = max(1, -(-(120 << 20) // (n * k // 2)))  # rotate over > 2x the 60 MB L2
        qs = [q] + [tuple(t.clone() for t in q) for _ in range(copies - 1)]
        if pad:
            qs = [padded_rows(qq, pad) for qq in qs]
        ws = []
        if with_bf16:
            w_bf16 = dequantize_nvfp4(*plain, dtype=torch.bfloat16)
            ws = [w_bf16] + [w_bf16.clone() for _ in range(max(1, -(-(120 << 20) // (n * k * 2))) - 1)]
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            y = torch.empty(m, n, device=device, dtype=torch.bfloat16)
            ours = _rotating(lambda qq, x=x, y=y: triton_nvfp4.nvfp4_gemv(x, *qq, out=y, config=config, paired=paired),
                             qs)
            theirs = _rotating(lambda ww, x=x, y=y: torch.mm(x, ww.t(), out=y), ws)
            us = _time(ours, iters)
            io = 2 * m * k + 2 * m * n
            nbytes = n * k // 2 + n * k // 16 + 4 * n + io
            row = {"shape": name, "n": n, "k": k, "m": m, "us": round(us, 2), "GBps": round(nbytes / us / 1e3, 1)}
            if with_bf16:
                us_bf16 = _time(theirs, iters)
                row.update(us_bf16=round(us_bf16, 2), GBps_bf16=round((2 * n * k + io) / us_bf16 / 1e3, 1),
                           speedup=round(us_bf16 / us, 2))
            out.append(row)
    return out


def padded_rows(q, pad: int):
    """NVFP4 (codes, block scales, row scales) with each codes row `pad` bytes and each scale row pad / 8 bytes
    apart from the next (views into wider buffers): the same weight, other DRAM addresses for its rows."""
    codes, scales, row_scale = q
    n = codes.shape[0]
    wide = torch.zeros(n, codes.shape[1] + pad, dtype=codes.dtype, device=codes.device)
    wide[:, : codes.shape[1]] = codes
    sbytes = scales.view(torch.uint8)
    swide = torch.zeros(n, sbytes.shape[1] + max(pad // 8, 4), dtype=torch.uint8, device=codes.device)
    swide[:, : sbytes.shape[1]] = sbytes
    return wide[:, : codes.shape[1]], swide[:, : sbytes.shape[1]].view(scales.dtype), row_scale


def time_nvfp4_prefill(device="cuda", *, shapes: dict | None = None, m: int = 1024, iters: int = 5) -> list[dict]:
    """M > 16 path (dequantize to bf16 scratch + torch matmul) against bf16 F.linear: TFLOP/s."""
    from ninfer.kernels import triton_nvfp4

    out = []
    for name, (n, k) in (shapes or SHAPES_27B).items():
        q, x = _problem(n, k, m, device, torch.bfloat16)
        w = dequantize_nvfp4(*q, dtype=torch.bfloat16)
        us = _time(lambda x=x, q=q: triton_nvfp4.nvfp4_linear(x, *q), iters)
        us_bf16 = _time(lambda x=x, w=w: F.linear(x, w), iters)
        us_deq = _time(lambda q=q: triton_nvfp4.nvfp4_dequantize(*q), iters)
        flops = 2 * m * n * k
        out.append({"shape": name, "m": m, "us": round(us, 1), "TFLOPs": round(flops / us / 1e6, 1),
                    "us_bf16": round(us_bf16, 1), "TFLOPs_bf16": round(flops / us_bf16 / 1e6, 1),
                    "us_dequant": round(us_deq, 1), "GBps_dequant": round(n * k * (2 + 0.5625) / us_deq / 1e3, 1)})
    return out


def _short(cfg: dict) -> str:
    return "_".join(f"{k}{v}" for k, v in cfg.items() if k != "BLOCK_M")


# BLOCK_W: words per step, two (one 16-weight scale block) per thread and weight row
HFMA_CONFIGS = [dict(kind="hfma", BLOCK_N=bn, BLOCK_W=64 * w, num_warps=w)
                for bn, w in ((8, 1), (16, 1), (8, 2), (16, 2), (8, 4), (4, 2))]
# K = 5184 words are not a multiple of the tiles: the masked paths
RAGGED = {"ragged": (200, 5184)}


# The register-fed tensor-core GEMV (triton_nvfp4_mma): 16-row tiles per program, warps splitting K, steps of
# weights loaded ahead (default: by token tiles), the K loop's unroll (default: the depth)
MMA_CONFIGS = [dict(kind="mma", TILES=1, WARPS=8), dict(kind="mma", TILES=2, WARPS=8), dict(kind="mma", TILES=1, WARPS=4),
               dict(kind="mma", TILES=2, WARPS=4), dict(kind="mma", TILES=1, WARPS=8, DEPTH=8, UNROLL=2),
               dict(kind="mma", TILES=1, WARPS=8, DEPTH=1, UNROLL=2)]

# L2 prefetch distances (steps ahead) on the tiles the config table uses, at the decode batch sizes
PREFETCH_CONFIGS = [dict(kind="hfma", BLOCK_N=bn, BLOCK_W=64 * w, num_warps=w, PREFETCH=p)
                    for bn, w in ((8, 2), (4, 2), (8, 4)) for p in (0, 2, 4)]


# Wide launches of the tensor-core GEMV (speculative verification: 8 sequences x up to 4 positions)
MMA_WIDE_CONFIGS = [dict(kind="mma", TILES=tiles, WARPS=8) for tiles in (1, 2)]  # 1: what decode and verify launch


# Bytes in flight without registers (s20): Triton's software pipeline staging the weights through shared memory
# (cp.async, STAGES steps ahead) or L2 prefetches beside the register queue; the first entry is the table's launch.
MMA_STAGING_CONFIGS = ([dict(kind="mma", TILES=1, WARPS=8)]
                       + [dict(kind="mma", TILES=t, WARPS=w, STAGES=s, UNROLL=u)
                          for t, w, s, u in ((1, 8, 3, 1), (1, 8, 5, 1), (1, 8, 8, 1), (1, 8, 5, 2), (1, 4, 5, 1),
                                             (2, 8, 3, 1), (2, 8, 5, 1), (2, 8, 8, 1), (2, 8, 4, 2), (2, 4, 5, 1),
                                             (2, 4, 8, 1))]
                       + [dict(kind="mma", TILES=1, WARPS=8, PREFETCH=p) for p in (2, 4)]
                       + [dict(kind="mma", TILES=1, WARPS=4), dict(kind="mma", TILES=1, WARPS=8, DEPTH=6, UNROLL=2)]
                       # fewer warps a program: more programs resident (fewer registers each) and longer K loops
                       + [dict(kind="mma", TILES=t, WARPS=w) for t, w in ((1, 2), (1, 1), (2, 2), (2, 1), (2, 4))]
                       + [dict(kind="mma", TILES=1, WARPS=2, DEPTH=6, UNROLL=2)]
                       # fewer registers (a shallower queue): 3-4 programs of 8 warps an SM, N = 5120 in one wave
                       + [dict(kind="mma", TILES=1, WARPS=8, DEPTH=d, UNROLL=d) for d in (3, 2)])


# Weights stored paired (s30): a lane's blocks of two steps side by side, one 16-byte load of words and one 2-byte load
# of scales for both (triton_nvfp4_mma.pair_weights; what a speculative engine stores); bit for bit the K-order
# launch's products. DEPTH counts pairs. EVICT: weight loads marked evict-first.
MMA_PAIRED_CONFIGS = ([dict(kind="mma", TILES=1, WARPS=8), dict(kind="mma", TILES=1, WARPS=8, PAIRED=True)]
                      + [dict(kind="mma", TILES=1, WARPS=8, PAIRED=True, DEPTH=d) for d in (1, 3)]
                      + [dict(kind="mma", TILES=1, WARPS=8, PAIRED=True, EVICT=1)])


def check_mma_paired(device="cuda", *, shapes: dict | None = None, ms=(1, 4, 8, 17, 32)) -> dict:
    """Paired weights' products against the K-order launch's, bit for bit ({"shape_mM": true when equal}), from the
    table's launch."""
    from ninfer.kernels import triton_nvfp4, triton_nvfp4_mma

    out = {}
    for name, (n, k) in (shapes or SHAPES_27B).items():
        q, _ = _problem(n, k, 1, device, torch.bfloat16)
        paired = triton_nvfp4_mma.pair_weights(q.packed, q.scale, 8)
        x = _problem(1, k, max(ms), device, torch.bfloat16, seed=7)[1]
        for m in ms:
            want = triton_nvfp4.nvfp4_gemv(x[:m], *q, config=dict(kind="mma", TILES=1, WARPS=8))
            got = triton_nvfp4.nvfp4_gemv(x[:m], *paired, q.row_scale, paired=8)
            out[f"{name}_m{m}"] = torch.equal(got, want)
    return out


# Padded rows (s32, not yet run): the 27B MLP down projection (rows 8,704 bytes apart) streams at ~1.8 TB/s where
# gate_up (2,560) reaches 2.6 and neither more programs (split K) nor fewer (PERSIST) helped; rows placed at other
# strides test whether its concurrent row streams meet in the same DRAM channels or banks.
MMA_PAD_CONFIGS = [dict(kind="mma", TILES=1, WARPS=8, PAIRED=True, PAD=p) for p in (0, 128, 256, 512, 1024, 2048)]
# Tiled storage (s34): each 16-row tile's weights one contiguous run (triton_nvfp4_mma.tile_weights), so a program
# streams one region instead of 16 rows far apart; TILES 2 makes it 32 rows, two runs
MMA_TILED_CONFIGS = [dict(kind="mma", TILES=t, WARPS=8, PAIRED=True, TILED=tiled) for t in (1, 2)
                     for tiled in (False, True)]
# The N = 5120 linears on tiled storage (s35): mlp_down reads its bytes in 20.6 us in the GEMV's own load pattern
# but takes 27.3 through the GEMV (o_proj 8.4 against 9.5), and split K (s32) did not help: how far ahead a warp
# loads (DEPTH, in pairs of steps; None: the table's) and the warps a program (which sets the programs an SM holds)
MMA_DOWN_SHAPES = {name: SHAPES_27B[name] for name in ("mlp_down", "o_proj")}
MMA_DOWN_CONFIGS = [dict(kind="mma", TILES=1, WARPS=w, PAIRED=True, TILED=True, DEPTH=d, UNROLL=u)
                    for w in (8, 4) for d in (None, 1, 2, 3, 4) for u in (None, 1)]
# s36-s37: compiled on the CPU for sm_90 with the device's Triton 3.6 (bench/sass_count.py), the table's launch of
# mlp_down takes 94 registers a thread, so an SM holds two of its 8-warp programs and the 320 programs run in 1.2
# waves on an H100. Capping registers at 80 (MAXNREG, no result changes) fits three.
MMA_DOWN_CONFIGS += [dict(kind="mma", TILES=1, WARPS=w, PAIRED=True, TILED=True, DEPTH=d, UNROLL=u, MAXNREG=r)
                     for w, d, u, r in ((8, None, None, 80), (8, 1, None, 80), (8, 2, 1, 80), (8, 1, 1, 80),
                                        (8, 1, None, 64), (4, None, None, 80))]

# s36 counted 181-242 registers a thread for three and four token tiles (17..32 rows), compiling without the JIT's
# alignment marks; with them (bench/sass_count.py, s37) 98-128, two 8-warp programs an SM already. The sweep reads
# each compiled kernel's own count on the device, capped at 128 and not.
MMA_CAP_CONFIGS = [dict(kind="mma", TILES=1, WARPS=8, PAIRED=True, TILED=True, MAXNREG=r, DEPTH=d)
                   for r, d in ((None, None), (128, None), (128, 2))]


def check_mma_pad(device="cuda", *, shapes: dict | None = None, ms=(1, 4, 32), pads=(128, 2048)) -> dict:
    """The paired mma launch on padded rows, and on tiled storage, against the same weights stored back to back,
    bit for bit ({"shape_mM_padP": true when equal, "shape_mM_tiled": likewise})."""
    from ninfer.kernels import triton_nvfp4, triton_nvfp4_mma

    out = {}
    for name, (n, k) in (shapes or SHAPES_27B).items():
        q, _ = _problem(n, k, 1, device, torch.bfloat16)
        paired = (*triton_nvfp4_mma.pair_weights(q.packed, q.scale, 8), q.row_scale)
        tiled = (*triton_nvfp4_mma.tile_weights(paired[0], paired[1], 8), q.row_scale)
        x = _problem(1, k, max(ms), device, torch.bfloat16, seed=7)[1]
        layouts = {f"pad{pad}": (padded_rows(paired, pad), {}) for pad in pads}
        layouts["tiled"] = (tiled, {"kind": "mma", "TILES": 1, "WARPS": 8, "TILED": True})
        for key, (weights, config) in layouts.items():
            for m in ms:
                want = triton_nvfp4.nvfp4_gemv(x[:m], *paired, paired=8)
                got = triton_nvfp4.nvfp4_gemv(x[:m], *weights, paired=8, config=config or None)
                out[f"{name}_m{m}_{key}"] = torch.equal(got, want)
    return out


def check_mma_staging(device="cuda", *, shapes: dict | None = None, ms=(1, 4, 8), configs=None) -> dict:
    """Each staging / prefetch config against the plain mma launch of its warps (TILES 1, no staging), bit for
    bit (neither may change a result): {"shape_mM_config": true when equal}; a config the compiler refuses maps
    to its error."""
    from ninfer.kernels import triton_nvfp4

    configs = configs or MMA_STAGING_CONFIGS
    out = {}
    for name, (n, k) in (shapes or SHAPES_27B).items():
        q, _ = _problem(n, k, 1, device, torch.bfloat16)
        for m in ms:
            x = _problem(1, k, m, device, torch.bfloat16, seed=m)[1]
            base = {w: triton_nvfp4.nvfp4_gemv(x, *q, config=dict(kind="mma", TILES=1, WARPS=w))
                    for w in {cfg["WARPS"] for cfg in configs}}
            for cfg in configs[1:]:
                try:
                    same = torch.equal(triton_nvfp4.nvfp4_gemv(x, *q, config=cfg), base[cfg["WARPS"]])
                except Exception as exc:  # registers, shared memory
                    same = f"{type(exc).__name__}: {str(exc)[:200]}"
                out[f"{name}_m{m}_{_short(cfg)}"] = same
    return out


def best_few_launch(result: dict, ms=(1, 4)) -> dict:
    """The DEPTH / UNROLL / MAXNREG keys (those set) of the 8-warp config of a --sweep-mma-down result whose two
    linears at `ms` sum to the least time: NINFER_NVFP4_MMA_FEW's value for an A/B (the weights are stored for 8)."""
    totals: dict[str, list] = {}
    for row in result["sweep_mma_down"]:
        if "us_total" in row and row["m"] in ms and row["config"]["WARPS"] == 8:
            entry = totals.setdefault(_short(row["config"]), [row["config"], 0.0, 0])
            entry[1] += row["us_total"]
            entry[2] += 1
    best = min((e for e in totals.values() if e[2] == len(ms)), key=lambda e: e[1])
    return {k: best[0][k] for k in ("DEPTH", "UNROLL", "MAXNREG") if best[0].get(k)}


def best_mma_launch(result: dict, ms=(1, 4)) -> dict:
    """The launch keys (no "kind") of the config whose five GEMVs at `ms` sum to the least time, among those timed
    at every M of `ms` whose every bitwise check in `result` (a --sweep-mma-staging output) held."""
    failed = {key for key, ok in result["check_mma_staging"].items() if ok is not True}
    totals: dict[str, list] = {}  # short name -> [config, summed us, Ms timed]
    for row in result["sweep_mma_staging"]:
        short = _short(row["config"])
        if "us_total" in row and row["m"] in ms and not any(key.endswith("_" + short) for key in failed):
            entry = totals.setdefault(short, [row["config"], 0.0, 0])
            entry[1] += row["us_total"]
            entry[2] += 1
    best = min((e for e in totals.values() if e[2] == len(ms)), key=lambda e: e[1])
    return {k: v for k, v in best[0].items() if k != "kind"}


def check_mma_wide(device="cuda", *, shapes: dict | None = None, ms=(16, 24, 32)) -> dict:
    """Every token of a launch of up to 32 rows against the 8-row launch of its tile, bit for bit, at
    each shape and MMA_WIDE_CONFIGS tile: {"shape_mM_tiles": true when equal}."""
    from ninfer.kernels import triton_nvfp4

    out = {}
    for name, (n, k) in (shapes or SHAPES_27B).items():
        q, _ = _problem(n, k, 1, device, torch.bfloat16)
        for m in ms:
            x = _problem(1, k, m, device, torch.bfloat16, seed=m)[1]
            for cfg in MMA_WIDE_CONFIGS:
                wide = triton_nvfp4.nvfp4_gemv(x, *q, config=cfg)
                tiles = [triton_nvfp4.nvfp4_gemv(x[r0:r0 + 8], *q, config=dict(cfg, TILES=1))
                         for r0 in range(0, m, 8)]
                out[f"{name}_m{m}_t{cfg['TILES']}"] = torch.equal(wide, torch.cat(tiles))
    return out


def check_mma_rows(device="cuda", *, shapes: dict | None = None, ms=(1, 5, 8, 17, 32), cfg: dict | None = None) -> dict:
    """The tensor-core GEMV computes a row alike at every M: each M's rows against the first M rows of a
    32-row launch, bit for bit ({"shape_mM": true when equal})."""
    from ninfer.kernels import triton_nvfp4

    cfg = cfg or MMA_CONFIGS[0]
    out = {}
    for name, (n, k) in (shapes or SHAPES_27B).items():
        q, _ = _problem(n, k, 1, device, torch.bfloat16)
        x = _problem(1, k, 32, device, torch.bfloat16, seed=7)[1]
        full = triton_nvfp4.nvfp4_gemv(x, *q, config=cfg)
        for m in ms:
            out[f"{name}_m{m}"] = torch.equal(triton_nvfp4.nvfp4_gemv(x[:m], *q, config=cfg), full[:m])
    return out


def default_sweep(m: int) -> list[dict]:
    """Candidate configs: for M = 1 the packed-fp16 GEMV and the fp32-decode one, for M <= HFMA_MAX_M
    the packed-fp16 GEMV and the tensor-core kernel, above the tensor-core kernel."""
    from ninfer.kernels.triton_nvfp4 import HFMA_MAX_M

    if m == 1:
        return HFMA_CONFIGS + [dict(kind="fma", BLOCK_M=1, BLOCK_N=bn, BLOCK_W=bw, num_warps=w)
                               for bn, bw, w in ((4, 128, 4), (8, 64, 2))]
    dot = [dict(kind="dot", BLOCK_M=16, BLOCK_N=bn, BLOCK_W=bw, num_warps=w)
           for bn, bw, w in ((32, 16, 4), (64, 16, 4))]
    if m <= HFMA_MAX_M:
        return HFMA_CONFIGS + (dot if m > 4 else [])
    return [dict(kind="dot", BLOCK_M=16, BLOCK_N=bn, BLOCK_W=bw, num_warps=w)
            for bn, bw, w in ((32, 16, 4), (64, 16, 4), (64, 16, 8), (64, 8, 4))]


def sweep_gemv_configs(device="cuda", *, shapes: dict | None = None, ms=(1, 2, 4, 8), configs: list[dict] | None = None,
                       iters: int = 20) -> list[dict]:
    """GB/s of each candidate launch config per shape and M (for choosing triton_nvfp4._gemv_config).
    Candidates are the union of default_sweep(m); each runs at every M it applies to."""
    explicit = configs is not None
    if configs is None:
        configs = []
        for m in ms:
            configs += [c for c in default_sweep(m) if c not in configs]
    from ninfer.kernels.triton_nvfp4_mma import _gemv_mma_kernel

    out = []
    for cfg in configs:
        cms = ms if explicit else tuple(m for m in ms if cfg in default_sweep(m))
        before = set(_compiled(_gemv_mma_kernel))
        try:
            rows = time_nvfp4_gemv(device, shapes=shapes, ms=cms, iters=iters, config=cfg, with_bf16=False)
        except Exception as exc:  # a config the compiler refuses (registers, shared memory, PTX)
            out.append({"config": cfg, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            continue
        made = [ck for key, ck in _compiled(_gemv_mma_kernel).items() if key not in before]
        for m in cms:
            mine = [r for r in rows if r["m"] == m]
            out.append({"m": m, "config": cfg, "GBps": {r["shape"]: r["GBps"] for r in mine},
                        "us": {r["shape"]: r["us"] for r in mine}, "us_total": round(sum(r["us"] for r in mine), 2)}
                       | ({"kernels": kernel_resources(made)} if made else {}))
    return out


def _compiled(kernel) -> dict:
    """A jitted Triton kernel's compiled variants on the current CUDA device ({} where this Triton keeps them
    elsewhere)."""
    try:
        return dict(kernel.device_caches[torch.cuda.current_device()][0])
    except Exception:
        return {}


def compiled_constants(ck) -> dict:
    """A compiled kernel's constexpr arguments by name ({} where this Triton keeps them elsewhere)."""
    try:
        return {ck.src.fn.arg_names[key[0]]: v for key, v in ck.src.constants.items()}
    except Exception:
        return {}


def kernel_resources(kernels) -> list[dict]:
    """Registers and spills a thread of each compiled kernel, with the K (KW words a row) and token tiles (XT) it
    was built for, and how many of its programs one SM holds by registers (s36: the 27B N = 5120 linears launch
    320 programs, over two waves where an SM holds two)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    regs_per_sm = getattr(props, "regs_per_multiprocessor", 65536)
    out = []
    for ck in kernels:
        consts = compiled_constants(ck)
        warps = ck.metadata.num_warps
        regs = getattr(ck, "n_regs", 0) or 0
        by_regs = regs_per_sm // (-(-regs // 8) * 8 * 32 * warps) if regs else None
        out.append({"K": 8 * consts["KW"] if "KW" in consts else None, "XT": consts.get("XT"), "warps": warps,
                    "regs": regs, "spills": getattr(ck, "n_spills", None),
                    "programs_per_sm": min(by_regs, 64 // warps, 32) if by_regs is not None else None})
    return out


def decode_tokens_per_s(preset: str = "qwen3.6-27b", weights: str = "nvfp4", new_tokens: int = 64) -> dict:
    """Batch-1 greedy decode speed of a random-weight preset through the engine (CUDA graphs on):
    the time of a 4 + new_tokens request minus that of a 4-token one, over new_tokens."""
    import gc
    import time

    from ninfer.engine.engine import EngineSettings
    from ninfer.engine.loader import engine_from_preset
    from ninfer.engine.types import EngineRequest, SamplingParams

    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    settings = EngineSettings(max_context=1024, max_concurrency=1, eos_ids={-1}, prefix_reuse=False)
    engine = engine_from_preset(preset, settings, weights=weights)
    build_s = time.perf_counter() - start
    try:
        def run(eng, n: int, tag: str) -> float:
            req = EngineRequest(f"{tag}{n}", list(range(100, 132)), max_tokens=n,
                                sampling=SamplingParams(temperature=0.0))
            t = time.perf_counter()
            eng.generate(req)
            return time.perf_counter() - t

        run(engine, 4, "warm")
        short, long = run(engine, 4, "a"), run(engine, 4 + new_tokens, "b")
    finally:
        engine.shutdown()
    out = {"preset": preset, "weights": weights, "tokens_per_s": round(new_tokens / (long - short), 2),
           "ms_per_token": round((long - short) / new_tokens * 1e3, 3), "build_s": round(build_s, 1),
           "peak_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 1)}
    engine = None
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    """python -m bench.selfcheck_nvfp4 [--sweep] [--out FILE]: check, time, print JSON."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time the candidate GEMV configs")
    parser.add_argument("--decode", action="store_true",
                        help="only the 27B batch-1 engine decode speed, NVFP4 then bf16 (needs ~60 GB)")
    parser.add_argument("--sweep-prefetch", action="store_true",
                        help="only time the GEMV tiles with L2 prefetch distances 0, 2, 4 at M = 1, 2")
    parser.add_argument("--sweep-mma", action="store_true",
                        help="only the tensor-core GEMV: checks, its tiles at M = 1..32 and the table's kernels at M = 1..8")
    parser.add_argument("--sweep-mma-wide", action="store_true",
                        help="only the tensor-core GEMV at 8..32 rows (verification): bitwise check and times")
    parser.add_argument("--sweep-mma-paired", action="store_true",
                        help="only the tensor-core GEMV on weights stored paired: bitwise against K order, then times "
                             "of MMA_PAIRED_CONFIGS at M = 1, 4, 8, 32")
    parser.add_argument("--sweep-mma-pad", action="store_true",
                        help="only the tensor-core GEMV on paired weights whose rows are stored apart (MMA_PAD_CONFIGS): "
                             "bitwise against rows back to back, then times at M = 1, 4, 8, 32")
    parser.add_argument("--sweep-mma-tiled", action="store_true",
                        help="only the tensor-core GEMV on paired weights stored tiled (MMA_TILED_CONFIGS): bitwise "
                             "against rows back to back, then times at M = 1, 4, 8, 32 beside the untiled launch")
    parser.add_argument("--sweep-mma-down", action="store_true",
                        help="only the tensor-core GEMV on tiled weights of the N = 5120 linears (MMA_DOWN_CONFIGS: "
                             "depth, unroll and warps) at M = 1, 4, 8")
    parser.add_argument("--sweep-mma-cap", action="store_true",
                        help="only the tensor-core GEMV on tiled weights at 24 and 32 rows, registers capped or not "
                             "(MMA_CAP_CONFIGS)")
    parser.add_argument("--ms", type=int, nargs="*", help="with --sweep-mma-tiled, --sweep-mma-down or --sweep-mma-cap: "
                                                          "the rows of x to time")
    parser.add_argument("--sweep-mma-staging", action="store_true",
                        help="only the tensor-core GEMV with shared-memory staging / L2 prefetch: bitwise against the "
                             "table's launch, then times at M = 1, 2, 4, 8 beside the table's kernels")
    parser.add_argument("--part", default=None, metavar="I/N",
                        help="with --sweep-mma-staging: only compile and check the I-th of N slices of the configs "
                             "(parallel warm-up of the Triton cache)")
    parser.add_argument("--best-mma", metavar="JSON",
                        help="print the launch keys of the fastest bitwise-checked config of a --sweep-mma-staging "
                             "result (summed over M = 1 and 4) as JSON, and exit")
    parser.add_argument("--best-few", metavar="JSON",
                        help="print NINFER_NVFP4_MMA_FEW's keys of the fastest 8-warp config of a --sweep-mma-down "
                             "result (summed over M = 1 and 4) as JSON, and exit")
    parser.add_argument("--out", help="write the JSON here too")
    args = parser.parse_args(argv)
    if args.best_mma:
        print(json.dumps(best_mma_launch(json.load(open(args.best_mma)))))
        return 0
    if args.best_few:
        print(json.dumps(best_few_launch(json.load(open(args.best_few)))))
        return 0
    result = {"device": torch.cuda.get_device_name()}
    if args.sweep_mma_staging and args.part:
        i, n = (int(v) for v in args.part.split("/"))
        mine = MMA_STAGING_CONFIGS[:1] + MMA_STAGING_CONFIGS[1:][i::n]
        result["check_mma_staging"] = check_mma_staging("cuda", configs=mine)
    elif args.sweep_mma_staging:
        result["check_mma_staging"] = check_mma_staging("cuda")
        result["sweep_table"] = sweep_gemv_configs("cuda", ms=(1, 2, 4, 8), configs=[None])
        result["sweep_mma_staging"] = sweep_gemv_configs("cuda", ms=(1, 2, 4, 8), configs=MMA_STAGING_CONFIGS)
    elif args.sweep_mma_paired:
        result["check_mma_paired"] = check_mma_paired("cuda")
        result["sweep_mma_paired"] = sweep_gemv_configs("cuda", ms=(1, 4, 8, 32), configs=MMA_PAIRED_CONFIGS)
    elif args.sweep_mma_pad:
        result["check_mma_pad"] = check_mma_pad("cuda")
        result["sweep_mma_pad"] = sweep_gemv_configs("cuda", ms=(1, 4, 8, 32), configs=MMA_PAD_CONFIGS)
    elif args.sweep_mma_tiled:
        result["check_mma_layouts"] = check_mma_pad("cuda", pads=())
        result["sweep_mma_tiled"] = sweep_gemv_configs("cuda", ms=tuple(args.ms or (1, 4, 8, 32)),
                                                       configs=MMA_TILED_CONFIGS)
    elif args.sweep_mma_cap:
        result["sweep_mma_cap"] = sweep_gemv_configs("cuda", ms=tuple(args.ms or (24, 32)), configs=MMA_CAP_CONFIGS)
    elif args.sweep_mma_down:
        result["sweep_mma_down"] = sweep_gemv_configs("cuda", shapes=MMA_DOWN_SHAPES, ms=tuple(args.ms or (1, 4, 8)),
                                                      configs=MMA_DOWN_CONFIGS)
    elif args.sweep_mma_wide:
        result["check_mma_wide"] = check_mma_wide("cuda")
        result["sweep_mma_wide"] = sweep_gemv_configs("cuda", ms=(8, 16, 24, 32), configs=MMA_WIDE_CONFIGS)
        result["sweep_hfma_m1"] = sweep_gemv_configs("cuda", ms=(1,), configs=[
            dict(kind="hfma", BLOCK_N=8, BLOCK_W=128, num_warps=2)])
    elif args.sweep_mma:
        result["check_mma"] = check_nvfp4("cuda", torch.bfloat16, ms=(1, 3, 8, 17, 32), configs=MMA_CONFIGS[:1])
        result["check_mma_rows"] = check_mma_rows("cuda")
        result["sweep_table"] = sweep_gemv_configs("cuda", ms=(1, 2, 3, 4, 8), configs=[None])
        result["sweep_mma"] = sweep_gemv_configs("cuda", ms=(1, 4, 8, 32), configs=MMA_CONFIGS)
    elif args.sweep_prefetch:
        result["sweep_prefetch"] = sweep_gemv_configs("cuda", ms=(1, 2), configs=PREFETCH_CONFIGS)
    elif args.decode:
        result["decode"] = [decode_tokens_per_s(weights="nvfp4"), decode_tokens_per_s(weights="bf16")]
    else:
        result.update(check_bf16=check_nvfp4("cuda", torch.bfloat16, shapes={**SHAPES_27B, **RAGGED}),
                      gemv=time_nvfp4_gemv("cuda"),
                      prefill=time_nvfp4_prefill("cuda"))
    if args.sweep:
        result["sweep"] = sweep_gemv_configs("cuda")
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
