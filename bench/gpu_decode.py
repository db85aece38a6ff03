"""GPU decode/prefill benchmark: ninfer vs Hugging Face transformers vs the roofline, one process, one GPU.

  python bench/gpu_decode.py                              # qwen3.6-27b bf16 on the GPU
  python bench/gpu_decode.py --shape qwen3.6-35b-a3b --skip-transformers
  python bench/gpu_decode.py --quick                      # tiny-qwen3.6 / tiny shapes: a CPU dry run

Prints one JSON object per line (kind = env | ceilings | ninfer_setup | ninfer_decode | ninfer_prefill |
ninfer_memory | hf_setup | hf_decode | hf_prefill | hf_memory | nvfp4 | skipped | error | summary).

In order, in this one process:
1. ceilings: device-to-device copy bandwidth (4 GiB, read + write counted) and dense bf16 GEMM TFLOP/s;
   roofline decode tok/s = copy bandwidth / weight bytes read per step (for a MoE shape the bytes a
   batch-1 step reads: everything but the routed experts, plus top_k / num_experts of them).
2. ninfer at the runner level (as bench/gpu_kernels.py's profile): the preset built on the device with
   random weights, decode CUDA graphs captured for batch 1..8; decode step time with all C lanes busy
   (forward + sample + `.tolist()` + penalty counts, the engine's per-step work) at C = 1, 2, 4, 8
   after a 128-token prompt per lane, greedy (and with --sampled also under the shape's non-thinking
   sampler preset: once replaying the sampler graph, once with the sampler run eagerly); TTFT
   (chunked prefill at the engine's default prefill_chunk, full chunks replayed from the prefill CUDA graph as in the engine, then the first token sampled and read back) and
   prefill tok/s at 1k and 8k prompts (8k also as one chunk, and eagerly chunked), 32k when the
   --deadline leaves time for it (else a `skipped` line with the reason); TTFT of prompts shorter
   than a chunk (100, 300, 520, 540, 700, 960 tokens, by the runner's prefill plan: runner.prefill_plan,
   e.g. 100 -> the 128-token graph padded, 520 -> 512 + 8, 960 -> the chunk's graph padded), then the eager
   forward for comparison; NINFER_PREFILL_PIECES=0: eager only); peak GPU memory.
3. transformers: Qwen3_5ForCausalLM (or the MoE class) built on the device in bf16 with random
   weights from the same HF-style config dict, sdpa attention (its default), default cache (fla's
   chunk / fused recurrent GDN kernels when fla-core is importable, else its torch fallbacks;
   hf_setup says which); generate decode tok/s at batch C = 1, 2, 4, 8 (greedy, min_new_tokens =
   max_new_tokens; decode rate = extra tokens over the time beyond a 1-token generate), prefill
   tok/s at every prompt length (one forward with logits_to_keep=1). One model at a time: ninfer's
   is freed first.
Weight formats (--weights): bf16 and NVFP4 (the random bf16 weights quantized on the device;
--nvfp4-lm-head also quantizes the lm_head, which stays bf16 otherwise); the summary line puts each
beside transformers and the rooflines, and checks the issue's goals.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from ninfer.forward import KV_DTYPES  # noqa: E402

T_START = time.perf_counter()
RESULTS: dict[str, object] = {}


def emit(**record) -> dict:
    record.setdefault("t_s", round(time.perf_counter() - T_START, 2))
    print(json.dumps(record), flush=True)
    return record


def elapsed() -> float:
    return time.perf_counter() - T_START


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- ceilings -------------------------------------------------------------------------------------


def copy_bandwidth(device: torch.device, nbytes: int, reps: int) -> dict:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t)
    del src, dst
    free_memory()
    med = statistics.median(times)
    return {"copy_bytes": nbytes, "copy_gbps": 2 * nbytes / med / 1e9, "copy_gbps_best": 2 * nbytes / min(times) / 1e9}


def gemm_tflops(device: torch.device, n: int, dtype: torch.dtype, reps: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    times = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t)
    del a, b
    free_memory()
    return 2 * n ** 3 / statistics.median(times) / 1e12


# ---- model arithmetic -----------------------------------------------------------------------------


def weight_stats(model: torch.nn.Module, cfg: dict) -> dict:
    """Total weight bytes, bytes a batch-1 decode step reads, and matmul parameters per token (for FLOPs)."""
    total = routed = 0
    matmul_params = 0.0  # multiply-accumulates per token in the linears (no embedding; lm_head last token only)
    top_k, experts = cfg.get("num_experts_per_tok", 0), cfg.get("num_experts", 0)
    # NVFP4 linears and experts hold buffers: *_packed (two weights a byte), *_scale, *_row_scale
    quant = [(n, b) for n, b in model.named_buffers() if n.endswith(("_packed", "_scale"))]
    for name, p in [*model.named_parameters(), *quant]:
        nbytes = p.numel() * p.element_size()
        total += nbytes
        is_routed = ".experts." in name or name.endswith(("experts.gate_up_proj", "experts.down_proj"))
        if is_routed:
            routed += nbytes
            if not name.endswith("_scale"):
                matmul_params += p.numel() * (2 if name.endswith("_packed") else 1) * top_k / experts
        elif name.endswith("weight_packed") and "lm_head" not in name:  # the head: last token only, as in bf16
            matmul_params += 2 * p.numel()
        elif p.dim() == 2 and "embed_tokens" not in name and "lm_head" not in name and "conv1d" not in name \
                and not name.endswith("weight_scale"):
            matmul_params += p.numel()
    active = total - routed + (routed * top_k / experts if experts else 0)
    # decode reads one embedding row: bytes without the table too
    embed = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" in n)
    return {"weight_bytes": total, "decode_bytes_b1": active, "decode_bytes_b1_no_embed": active - embed,
            "matmul_params_per_token": matmul_params}


def prefill_flops(cfg: dict, matmul_params: float, tokens: int) -> float:
    """Linear-layer FLOPs (2 per MAC) plus causal full-attention FLOPs (QK^T and PV) for one prompt."""
    n_attn = sum(1 for t in cfg["layer_types"] if t == "full_attention")
    attn = 4 * n_attn * cfg["num_attention_heads"] * cfg["head_dim"] * tokens * (tokens + 1) / 2
    return 2 * matmul_params * tokens + attn


# ---- ninfer -----------------------------------------------------------------------------------------


def ninfer_bench(args, device, dtype, ceil: dict, deadline: float, hf_reserve: float, weights: str = "bf16") -> None:
    from ninfer.artifact.presets import get_preset, instantiate
    from ninfer.engine.engine import EngineSettings
    from ninfer.engine.plan import SeqWork, StepPlan
    from ninfer.engine.runner import ModelRunner, prefill_plan
    from ninfer.kernels import backend
    from ninfer.models import prepare_for_inference_

    R = RESULTS.setdefault(weights, {})  # this weight format's figures
    cfg = get_preset(args.model).text_config()
    page = 16
    lanes = max(args.concurrency)
    decode_ctx = args.decode_prompt + args.decode_steps + 16
    lane_pages = -(-decode_ctx // page)
    big = max(args.prompts + ([args.long_prompt] if args.long_prompt else []))
    prefill_pages = -(-big // page) + 1
    chunk = args.prefill_chunk or EngineSettings().prefill_chunk

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = instantiate(args.model, device, dtype, seed=0, fuse=False)
    if weights == "nvfp4":
        from ninfer.quant.nvfp4 import quantize_model_

        quantize_model_(model, lm_head=args.nvfp4_lm_head)  # on the device, one linear at a time
        free_memory()
    prepare_for_inference_(model)
    sync(device)
    build_s = time.perf_counter() - t0
    ws = weight_stats(model, cfg)
    weights_alloc = torch.cuda.memory_allocated() if device.type == "cuda" else None
    t0 = time.perf_counter()
    runner = ModelRunner(model, num_pages=lanes * lane_pages + prefill_pages, page_size=page,
                         num_state_slots=lanes + 1, num_lanes=lanes, vocab_size=cfg["vocab_size"], device=device,
                         dtype=dtype, cuda_graphs=True, max_seq_len=max(lane_pages, prefill_pages) * page,
                         kv_dtype=args.kv_dtype, prefill_chunk=chunk)
    sync(device)
    capture_s = time.perf_counter() - t0
    bw = ceil["copy_gbps"] * 1e9
    roof = {"roofline_tok_s_b1": bw / ws["decode_bytes_b1"], "roofline_tok_s_b1_no_embed": bw / ws["decode_bytes_b1_no_embed"],
            "weight_floor_ms_b1": ws["decode_bytes_b1"] / bw * 1e3}
    R["roofline"] = roof
    R["weights"] = ws
    lm_head = "nvfp4" if weights == "nvfp4" and args.nvfp4_lm_head else "bf16"
    emit(kind="ninfer_setup", shape=args.model, weights=weights, lm_head=lm_head, kv_dtype=args.kv_dtype,
         dtype=str(dtype).removeprefix("torch."), build_s=build_s,
         capture_s=capture_s, graph_status=runner.graph_status, sampler=runner.sampler_status, nvfp4_gemv=runner.nvfp4_status,
         prefill_pieces=bool(runner.prefill_pieces),
         backends=backend.describe(device.type),
         weights_allocated_bytes=weights_alloc, prefill_chunk=chunk, **ws, **roof)

    sampling = SimpleNamespace(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, presence_penalty=0.0,
                               frequency_penalty=0.0, seed=0)
    vocab = cfg["vocab_size"]

    def prompt_ids(n: int, salt: int) -> list[int]:
        return [(1009 * salt + 31 * j) % (vocab - 1000) + 500 for j in range(n)]

    def prefill(seq, ids: list[int], step: int, forward=runner.forward) -> int:
        logits = None
        for i in range(0, len(ids), step):
            part = ids[i:i + step]
            logits = forward([seq], [part])
            seq.num_computed += len(part)
        tok = int(runner.sample([seq], logits)[0])  # the first token, read back: TTFT ends here
        seq.output_ids.append(tok)
        return tok

    # -- decode at C = 1, 2, 4, 8 (all lanes busy); greedy, then (--sampled) Qwen's non-thinking preset --
    # mode -> (sampler settings, sampling call, result key); "sampled_eager_sampler" is "sampled" without
    # the sampler graph, its comparison
    modes = {"greedy": (sampling, runner.sample, "ninfer_decode")}
    if args.sampled:
        preset = SimpleNamespace(**get_preset(args.model).sampling_presets["non_thinking"], seed=1)
        modes["sampled"] = (preset, runner.sample, "ninfer_decode_sampled")
        modes["sampled_eager_sampler"] = (preset, functools.partial(runner.sample, graphs=False),
                                          "ninfer_decode_sampled_eager_sampler")
    for c in args.concurrency:
        for mode, (params, sampler, key) in modes.items():
            figures = R.setdefault(key, {})
            seqs = [SimpleNamespace(num_computed=0, pages=list(range(lane_pages * i, lane_pages * (i + 1))),
                                    state_slot=i, lane=i, output_ids=[], sampling=params) for i in range(c)]
            for i, s in enumerate(seqs):
                runner.reset_lane(i, [])
                prefill(s, prompt_ids(args.decode_prompt, i), chunk)

            def step(seqs=seqs, sampler=sampler, penalized=bool(params.presence_penalty or params.frequency_penalty)):
                if sampler == runner.sample:  # the engine's path: one decode plan through ModelRunner.execute
                    plan = StepPlan(decode=[SeqWork(s, s.num_computed, [s.output_ids[-1]], decode=True) for s in seqs])
                    toks = [row[0] for row in runner.execute(plan).sampled]
                else:
                    toks = sampler(seqs, runner.forward(seqs, [[s.output_ids[-1]] for s in seqs])).tolist()
                if penalized:  # as the engine does: only penalties read the counts
                    runner.count_tokens([s.lane for s in seqs], toks)
                for s, t in zip(seqs, toks):
                    s.num_computed += 1
                    s.output_ids.append(t)

            for _ in range(args.decode_warmup):
                step()
            replays0, sampler0 = runner.graph_replays, runner.sampler_replays
            sync(device)
            t = time.perf_counter()
            for _ in range(args.decode_steps):
                step()
            sync(device)
            step_s = (time.perf_counter() - t) / args.decode_steps
            graphs_used = runner.graph_replays - replays0 == args.decode_steps
            figures[c] = c / step_s
            emit(kind="ninfer_decode", shape=args.model, weights=weights, sampling=mode, concurrency=c,
                 step_ms=step_s * 1e3, tok_s=c / step_s, tok_s_per_lane=1 / step_s, steps=args.decode_steps,
                 context_start=args.decode_prompt + args.decode_warmup, cuda_graphs=graphs_used,
                 sampler_graph=runner.sampler_replays - sampler0 == args.decode_steps,
                 fraction_of_roofline_b1_bytes=(c / step_s) / (c * roof["roofline_tok_s_b1"]))

    # -- prefill / TTFT --
    if args.decode_only:
        emit(kind="skipped", what=f"ninfer {weights} prefill", reason="--decode-only")
        return
    slot = lanes
    base_page = lanes * lane_pages
    prefill_res = {}

    def run_prefill(n: int, step: int, reps: int, label: str, forward=runner.forward, **extra) -> dict:
        times = []
        replays0 = runner.prefill_replays
        for r in range(reps):
            seq = SimpleNamespace(num_computed=0, pages=list(range(base_page, base_page + -(-n // page) + 1)),
                                  state_slot=slot, lane=0, output_ids=[], sampling=sampling)
            ids = prompt_ids(n, 100 + r)
            sync(device)
            t = time.perf_counter()
            prefill(seq, ids, step, forward)
            times.append(time.perf_counter() - t)
        ttft = min(times)
        flops = prefill_flops(cfg, ws["matmul_params_per_token"], n)
        rec = emit(kind="ninfer_prefill", shape=args.model, weights=weights, label=label, prompt_tokens=n, chunk=step, reps=reps,
                   ttft_s=ttft, ttft_s_all=[round(x, 4) for x in times], prefill_tok_s=n / ttft,
                   graph_chunks=runner.prefill_replays - replays0,
                   tflops=flops / ttft / 1e12, fraction_of_gemm=flops / ttft / 1e12 / ceil["gemm_tflops"], **extra)
        prefill_res[label] = rec
        return rec

    run_prefill(args.prompts[0], chunk, 1, "warmup")  # kernels' first calls (JIT / autotune cache) off the clock
    del prefill_res["warmup"]
    for n in args.prompts:
        run_prefill(n, chunk, args.prefill_reps, f"{n}")
    n8 = args.prompts[-1]
    if n8 > chunk:
        run_prefill(n8, n8, args.prefill_reps, f"{n8}-one-chunk")
        if runner.prefill_graph is not None:  # the same chunks without the prefill graph
            run_prefill(n8, chunk, args.prefill_reps, f"{n8}-eager", runner.forward_eager)
    for n in args.short_prompts:  # shorter than a chunk: the runner's prefill plan (pieces on) or one eager forward
        plan = prefill_plan(n, runner.prefill_pieces, chunk, runner.piece_costs) if runner.prefill_pieces else None
        run_prefill(n, chunk, args.prefill_reps, f"{n}", plan=plan)
        if runner.prefill_pieces:
            run_prefill(n, chunk, args.prefill_reps, f"{n}-eager", runner.forward_eager)
    if args.long_prompt and weights in args.long_formats:
        est = prefill_res[f"{n8}"]["ttft_s"] * (args.long_prompt / n8) * 1.6 + 5
        left = deadline - elapsed() - hf_reserve
        if est < left:
            run_prefill(args.long_prompt, chunk, 1, f"{args.long_prompt}")
        else:
            emit(kind="skipped", what=f"ninfer prefill {args.long_prompt}", reason=f"time budget: estimated {est:.0f} s "
                 f"> {left:.0f} s left before the deadline (--deadline {args.deadline}) minus the transformers reserve")
    else:
        emit(kind="skipped", what=f"ninfer {weights} prefill 32k",
             reason="--no-long given" if not args.long_prompt else f"{weights} not in --long-formats (time budget)")
    R["ninfer_prefill"] = {k: {"ttft_s": v["ttft_s"], "prefill_tok_s": v["prefill_tok_s"],
                                     "fraction_of_gemm": v["fraction_of_gemm"]} for k, v in prefill_res.items()}
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    R["ninfer_peak_bytes"] = peak
    emit(kind="ninfer_memory", shape=args.model, weights=weights, peak_allocated_bytes=peak,
         peak_reserved_bytes=torch.cuda.max_memory_reserved() if device.type == "cuda" else None,
         kv_cache_pages=runner.cache.k.shape if hasattr(runner.cache, "k") else None)
    # runner, model and the closures over them go out of scope on return; main() then collects


# ---- transformers ------------------------------------------------------------------------------------


def hf_bench(args, device, dtype, ceil: dict) -> None:
    import transformers

    from ninfer.artifact.presets import get_preset

    cfg = dict(get_preset(args.model).text_config())
    moe = bool(cfg.get("num_experts"))
    if moe:
        from transformers import Qwen3_5MoeForCausalLM as Cls
        from transformers import Qwen3_5MoeTextConfig as Cfg
    else:
        from transformers import Qwen3_5ForCausalLM as Cls
        from transformers import Qwen3_5TextConfig as Cfg
    cfg.pop("model_type", None)
    config = Cfg(**cfg)
    config._attn_implementation = "sdpa"  # transformers' default; eager would not fit a 32k prompt
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    t0 = time.perf_counter()
    try:
        with torch.device(device):
            model = Cls(config)
    finally:
        torch.set_default_dtype(previous)
    model = model.to(dtype).eval()
    sync(device)
    build_s = time.perf_counter() - t0
    import importlib.util

    # transformers picks fla's GDN kernels whenever `fla` imports (fla-core on PYTHONPATH), and
    # causal-conv1d's when installed; otherwise its torch fallbacks. Record which it could see.
    hf_kernels = {"fla_importable": importlib.util.find_spec("fla") is not None,
                  "causal_conv1d_importable": importlib.util.find_spec("causal_conv1d") is not None}
    emit(kind="hf_setup", shape=args.model, transformers=transformers.__version__, cls=Cls.__name__, build_s=build_s,
         parameters=sum(p.numel() for p in model.parameters()),
         weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
         attn_implementation=model.config._attn_implementation, **hf_kernels)
    vocab = cfg["vocab_size"]

    def ids(b: int, n: int) -> torch.Tensor:
        return torch.tensor([[(1009 * i + 31 * j) % (vocab - 1000) + 500 for j in range(n)] for i in range(b)],
                            device=device)

    @torch.inference_mode()
    def gen(inp: torch.Tensor, new: int) -> float:
        sync(device)
        t = time.perf_counter()
        out = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
        sync(device)
        assert out.shape[1] == inp.shape[1] + new, out.shape
        return time.perf_counter() - t

    hf_decode = {}
    for b in args.hf_batches:
        inp = ids(b, args.decode_prompt)
        gen(inp, 2)  # warm-up
        t1 = min(gen(inp, 1) for _ in range(2))
        tn = gen(inp, args.hf_new_tokens)
        rate = b * (args.hf_new_tokens - 1) / (tn - t1)
        hf_decode[b] = rate
        emit(kind="hf_decode", shape=args.model, batch=b, prompt_tokens=args.decode_prompt,
             new_tokens=args.hf_new_tokens, generate_s=tn, generate_1_token_s=t1, step_ms=(tn - t1) / (args.hf_new_tokens - 1) * 1e3,
             tok_s=rate, generate_tok_s_incl_prefill=b * args.hf_new_tokens / tn)
    RESULTS["hf_decode"] = hf_decode

    @torch.inference_mode()
    def fwd(inp: torch.Tensor) -> float:
        sync(device)
        t = time.perf_counter()
        model(inp, logits_to_keep=1)
        sync(device)
        return time.perf_counter() - t

    hf_prefill = {}
    fwd(ids(1, args.prompts[0]))  # warm-up
    prompts = args.prompts + ([args.long_prompt] if args.long_prompt else [])
    for n in prompts:
        reps = args.prefill_reps if n <= args.prompts[-1] else 1
        last = str(args.prompts[-1])
        if n > args.prompts[-1] and last in hf_prefill:  # the long prompt: only if it fits before the deadline
            est = n / hf_prefill[last] * (n / args.prompts[-1]) + 5  # attention grows with n^2: a generous bound
            if est > args.deadline - elapsed():
                emit(kind="skipped", what=f"transformers prefill {n}", reason=f"time budget: estimated {est:.0f} s > "
                     f"{args.deadline - elapsed():.0f} s left before the deadline (--deadline {args.deadline})")
                continue
        inp = ids(1, n)
        times = [fwd(inp) for _ in range(reps)]
        best = min(times)
        hf_prefill[str(n)] = n / best
        emit(kind="hf_prefill", shape=args.model, prompt_tokens=n, seconds=best,
             seconds_all=[round(x, 4) for x in times], prefill_tok_s=n / best)
    RESULTS["hf_prefill"] = hf_prefill
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    RESULTS["hf_peak_bytes"] = peak
    emit(kind="hf_memory", shape=args.model, peak_allocated_bytes=peak)
    # the model goes out of scope on return; main() then collects and empties the cache


# ---- main -------------------------------------------------------------------------------------------


def summary(args, ceil) -> None:
    """Per weight format: decode beside transformers and the roofline, prefill beside transformers;
    then the issue's goals. Rooflines are the bf16 weights' (the issue's definition) where measured."""
    hd, hp = RESULTS.get("hf_decode", {}), RESULTS.get("hf_prefill", {})
    bf16 = RESULTS.get("bf16", {})
    base_roof = (bf16 or next((v for v in RESULTS.values() if isinstance(v, dict) and "roofline" in v), {})
                 ).get("roofline", {})
    per_format, goals = {}, {}
    for fmt in ("bf16", "nvfp4"):
        r = RESULTS.get(fmt)
        if not r:
            continue
        nd, pre = r.get("ninfer_decode", {}), r.get("ninfer_prefill", {})
        rows = []
        for c in args.concurrency:
            row = {"concurrency": c, "ninfer_tok_s": nd.get(c), "ninfer_sampled_tok_s": r.get("ninfer_decode_sampled", {}).get(c),
                   "ninfer_sampled_eager_sampler_tok_s": r.get("ninfer_decode_sampled_eager_sampler", {}).get(c),
                   "hf_bf16_tok_s": hd.get(c),
                   "roofline_bf16_tok_s": base_roof.get("roofline_tok_s_b1", 0) * c or None,
                   "roofline_own_bytes_tok_s": r["roofline"]["roofline_tok_s_b1"] * c}
            if row["ninfer_tok_s"] and row["roofline_bf16_tok_s"]:
                row["ninfer_over_roofline_bf16"] = row["ninfer_tok_s"] / row["roofline_bf16_tok_s"]
            if row["ninfer_tok_s"]:
                row["ninfer_over_roofline_own_bytes"] = row["ninfer_tok_s"] / row["roofline_own_bytes_tok_s"]
            if row["ninfer_tok_s"] and row["hf_bf16_tok_s"]:
                row["ninfer_over_hf"] = row["ninfer_tok_s"] / row["hf_bf16_tok_s"]
            rows.append(row)
        prefill = [{"prompt": k, "ninfer_tok_s": v["prefill_tok_s"], "ttft_s": v["ttft_s"],
                    "fraction_of_gemm": v["fraction_of_gemm"], "hf_bf16_tok_s": hp.get(k.split("-")[0]),
                    "ninfer_over_hf": v["prefill_tok_s"] / hp[k.split("-")[0]] if hp.get(k.split("-")[0]) else None}
                   for k, v in pre.items()]
        per_format[fmt] = {"decode": rows, "prefill": prefill, "peak_bytes": r.get("ninfer_peak_bytes"),
                           "weights": r.get("weights")}
    nd = bf16.get("ninfer_decode", {})
    if 1 in nd and base_roof:
        f = nd[1] / base_roof["roofline_tok_s_b1"]
        goals["b1_decode_ge_0.90_roofline"] = {"value": f, "met": f >= 0.90}
    if 1 in nd and 8 in nd:
        goals["c8_ge_7x_c1"] = {"value": nd[8] / nd[1], "met": nd[8] / nd[1] >= 7}
    pre = bf16.get("ninfer_prefill", {})
    p8 = {k: v["fraction_of_gemm"] for k, v in pre.items() if k.startswith(str(args.prompts[-1]))}
    if p8:
        at_chunk = p8.get(str(args.prompts[-1]))
        goals["prefill_8k_ge_0.5_gemm_flops"] = {"value_at_engine_chunk": at_chunk, "met": bool(at_chunk and at_chunk >= 0.5),
                                                 "by_variant": p8}
    n4 = RESULTS.get("nvfp4", {}).get("ninfer_decode", {})
    if 1 in n4 and 1 in nd:
        goals["nvfp4_b1_ge_3x_bf16"] = {"value": n4[1] / nd[1], "met": n4[1] / nd[1] >= 3}
    else:
        goals["nvfp4_b1_ge_3x_bf16"] = {"value": None, "met": False, "reason": "bf16 and nvfp4 not both measured"}
    if args.model != "qwen3.6-27b":  # the goals are stated for the 27B shape
        goals = {"applies": False, "reason": "the issue-10 goals are defined on qwen3.6-27b", "would_be": goals}
    emit(kind="summary", shape=args.model, kv_dtype=args.kv_dtype, nvfp4_lm_head=args.nvfp4_lm_head,
         copy_gbps=ceil.get("copy_gbps"), gemm_tflops=ceil.get("gemm_tflops"), formats=per_format,
         hf_peak_bytes=RESULTS.get("hf_peak_bytes"), goals=goals, total_wall_s=elapsed())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3.6-27b", choices=["qwen3.6-27b", "qwen3.6-35b-a3b"])
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-ninfer", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (tiny-qwen3.6[-moe]): a CPU dry run")
    ap.add_argument("--deadline", type=float, default=float("inf"),
                    help="seconds from start: optional stages (32k prefill) are skipped when they would pass it")
    ap.add_argument("--hf-reserve", type=float, default=90.0, help="seconds kept for the transformers part")
    ap.add_argument("--no-long", action="store_true", help="skip the 32k prompt")
    ap.add_argument("--weights", nargs="+", default=["bf16", "nvfp4"], choices=["bf16", "nvfp4"],
                    help="ninfer weight formats to run, in order (NVFP4: the random weights quantized on the device)")
    ap.add_argument("--nvfp4-lm-head", action="store_true",
                    help="the nvfp4 format also quantizes the lm_head (bf16 otherwise); the env, ninfer_setup "
                         "(lm_head) and summary lines record which head ran")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8], help="decode lanes to measure")
    ap.add_argument("--decode-only", action="store_true", help="skip ninfer's prefill/TTFT part (time budget)")
    ap.add_argument("--sampled", action="store_true",
                    help="also time decode with the shape's non-thinking sampler preset (Qwen: temperature 0.7, "
                         "top-p 0.8, top-k 20, presence penalty 1.5): the full sampler instead of the greedy argmax")
    ap.add_argument("--kv-dtype", default="bf16", choices=list(KV_DTYPES), help="ninfer KV-cache storage")
    ap.add_argument("--long-formats", nargs="*", default=["bf16", "nvfp4"],
                    help="weight formats that also run the 32k prompt (each skipped with a line when the --deadline "
                         "leaves no time for it)")
    args = ap.parse_args()
    if args.nvfp4_lm_head and "nvfp4" not in args.weights:
        ap.error("--nvfp4-lm-head needs nvfp4 in --weights")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    args.hf_batches = list(args.concurrency)
    if args.quick:
        args.model = "tiny-qwen3.6-moe" if "a3b" in args.shape else "tiny-qwen3.6"
        args.prompts, args.long_prompt = [64, 256], (None if args.no_long else 1024)
        args.short_prompts = [21]
        args.decode_prompt, args.decode_steps, args.decode_warmup = 16, 4, 2
        args.hf_new_tokens, args.prefill_reps, args.prefill_chunk = 4, 1, 32
        copy_bytes, gemm_n = 64 << 20, 256
    else:
        args.model = args.shape
        args.prompts, args.long_prompt = [1024, 8192], (None if args.no_long else 32768)
        args.short_prompts = [100, 300, 520, 540, 700, 960]
        args.decode_prompt, args.decode_steps, args.decode_warmup = 128, 32, 3
        args.hf_new_tokens, args.prefill_reps, args.prefill_chunk = 24, 2, None
        copy_bytes, gemm_n = 4 << 30, 8192
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False

    import importlib.metadata as md

    def version(pkg):
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    emit(kind="env", device=torch.cuda.get_device_name() if device.type == "cuda" else (platform.processor() or "cpu"),
         torch=torch.__version__, triton=version("triton"), fla_core=version("fla-core"),
         transformers=version("transformers"), shape=args.model, requested_shape=args.shape, quick=args.quick,
         nvfp4_lm_head=args.nvfp4_lm_head, command=" ".join(sys.argv))
    ceil = copy_bandwidth(device, copy_bytes, 5)
    ceil["gemm_tflops"] = gemm_tflops(device, gemm_n, dtype, 5)
    ceil["gemm_n"] = gemm_n
    emit(kind="ceilings", **ceil)
    hf_reserve = 0 if args.skip_transformers else args.hf_reserve
    parts = [(f"ninfer-{w}", args.skip_ninfer, functools.partial(ninfer_bench, args, device, dtype, ceil, args.deadline,
                                                               hf_reserve, w)) for w in args.weights]
    parts.append(("transformers", args.skip_transformers, lambda: hf_bench(args, device, dtype, ceil)))
    for part, skip, fn in parts:
        if skip:
            emit(kind="skipped", what=part, reason="flag")
            continue
        if elapsed() > args.deadline:
            emit(kind="skipped", what=part, reason=f"deadline {args.deadline} s passed")
            continue
        t = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - keep the other part's figures
            import traceback
            emit(kind="error", part=part, error=f"{type(exc).__name__}: {exc}",
                 trace=traceback.format_exc()[-2000:])
        free_memory()
        emit(kind="section", part=part, wall_s=time.perf_counter() - t)
    summary(args, ceil)


if __name__ == "__main__":
    main()
