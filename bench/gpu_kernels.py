"""CUDA kernels against the torch references, kernel timings, decode CUDA graphs, and a 27B decode
profile. One JSON object per line.

  python bench/gpu_kernels.py                        # checks, timings, engine graph checks
  python bench/gpu_kernels.py --only profile         # 27B-shape decode: graph vs eager step, kernel profile
  NINFER_QWEN_TOKENIZER_JSON=... for the engine checks on an offline host; fla-core on PYTHONPATH
  for the chunked Gated DeltaNet backend.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench import selfcheck  # noqa: E402
from ninfer.kernels import backend, gdn  # noqa: E402
from ninfer.kernels.attention import paged_attention_ref  # noqa: E402

# Qwen3.6-27B text shape
Q27 = dict(hq=24, hkv=4, head_dim=256, conv=10240, hk=16, hv=48, dk=128, dv=128)


def emit(**record):
    print(json.dumps(record), flush=True)


def guarded(fn):
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # keep going: one failure must not cost the rest of the device run
            emit(check=fn.__name__, args=repr(args)[:200], error=f"{type(exc).__name__}: {exc}"[:2000])
    return run


def bench_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


# ---- correctness ---------------------------------------------------------------------------------


@guarded
def check(name, fn, dtype, **kwargs):
    r = fn("cuda", dtype, **kwargs)
    emit(check=name, dtype=str(dtype).removeprefix("torch."), shape=kwargs, **r)


def checks():
    for dtype in (torch.float32, torch.bfloat16):
        check("attention_decode", selfcheck.check_attention, dtype, decode=True)
        check("attention_decode", selfcheck.check_attention, dtype, decode=True, hq=24, hkv=4, head_dim=256,
              cached=[0, 127, 1000, 4095], new=[1, 1, 1, 1])
        check("attention_prefill", selfcheck.check_attention, dtype, decode=False)
        check("attention_prefill", selfcheck.check_attention, dtype, decode=False, hq=24, hkv=4, head_dim=256,
              cached=[0, 300, 0], new=[513, 64, 1])
        check("attention_prefill", selfcheck.check_attention, dtype, decode=False, hq=4, hkv=2, head_dim=16,
              page_size=4)
        check("conv1d_update", selfcheck.check_conv_update, dtype)
        check("conv1d_update", selfcheck.check_conv_update, dtype, channels=Q27["conv"])
        check("conv1d_varlen", selfcheck.check_conv_varlen, dtype)
        check("conv1d_varlen", selfcheck.check_conv_varlen, dtype, channels=Q27["conv"], query_lens=(1, 300, 7))
        check("gdn_recurrent_slots", selfcheck.check_recurrent, dtype)
        check("gdn_recurrent_slots", selfcheck.check_recurrent, dtype, hk=16, hv=48, dk=128, dv=128)
    if backend.fla_available():  # bf16 only, at the tiny and 27B shapes: each new shape/dtype costs fla an autotune
        check("fla_gdn", selfcheck.check_fla, torch.bfloat16, hk=2, hv=4, dk=32, dv=32)
        check("fla_gdn", selfcheck.check_fla, torch.bfloat16, hk=16, hv=48, dk=128, dv=128,
              query_lens=(1, 300, 64, 5))


# ---- timings ---------------------------------------------------------------------------------------


@guarded
def time_attention_decode(batch, ctx):
    from ninfer.kernels import triton_attention

    c = Q27
    q, kc, vc, fb = selfcheck.attention_problem("cuda", torch.bfloat16, hq=c["hq"], hkv=c["hkv"],
                                                head_dim=c["head_dim"], page_size=16, cached=[ctx - 1] * batch,
                                                new=[1] * batch)
    scale = c["head_dim"] ** -0.5
    tri = bench_ms(lambda: triton_attention.paged_decode(q, kc, vc, fb.page_table, fb.seq_lens, 16, scale))
    ref = bench_ms(lambda: paged_attention_ref(q, kc, vc, fb, 16, scale))
    kv_bytes = 2 * batch * ctx * c["hkv"] * c["head_dim"] * 2
    emit(timing="attention_decode", batch=batch, context=ctx, triton_ms=tri, reference_ms=ref,
         triton_gbps=kv_bytes / tri / 1e6,
         splits=triton_attention.pick_num_splits(q.device, c["hkv"], kc.shape[0]))


@guarded
def time_attention_prefill(tokens):
    from ninfer.kernels import triton_attention

    c = Q27
    q, kc, vc, fb = selfcheck.attention_problem("cuda", torch.bfloat16, hq=c["hq"], hkv=c["hkv"],
                                                head_dim=c["head_dim"], page_size=16, cached=[0], new=[tokens])
    scale = c["head_dim"] ** -0.5
    tri = bench_ms(lambda: triton_attention.paged_prefill(q, kc, vc, fb.query_start_loc, fb.seq_lens, fb.page_table,
                                                          16, scale, tokens))
    ref = bench_ms(lambda: paged_attention_ref(q, kc, vc, fb, 16, scale))
    flops = 4 * tokens * tokens / 2 * c["hq"] * c["head_dim"]
    emit(timing="attention_prefill", tokens=tokens, triton_ms=tri, reference_ms=ref, triton_tflops=flops / tri / 1e9)


def _gdn_meta(n, cached=True):
    return selfcheck._meta("cuda", [1] * n, [cached] * n, list(range(n)))


@guarded
def time_conv_update(n):
    from ninfer.kernels import triton_gdn

    ch = Q27["conv"]
    meta = _gdn_meta(n)
    x = torch.randn(n, ch, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(ch, 4, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(2 * n, ch, 3, device="cuda", dtype=torch.bfloat16)

    def ref():
        init = gdn._gather_state(cache, meta)
        y, st = gdn.causal_conv1d_update_ref(x, w, init)
        cache.index_copy_(0, meta.state_slots, st)

    tri = bench_ms(lambda: triton_gdn.conv1d_update(x, w, cache, slot_in=meta.state_slots,
                                                    has_initial_state=meta.has_initial_state))
    emit(timing="conv1d_update", seqs=n, channels=ch, triton_ms=tri, reference_ms=bench_ms(ref))


@guarded
def time_recurrent(n):
    from ninfer.kernels import triton_gdn

    c = Q27
    meta = _gdn_meta(n)
    q, k, v, g, beta = selfcheck.gdn_problem("cuda", torch.bfloat16, n, c["hk"], c["hv"], c["dk"], c["dv"],
                                             torch.Generator().manual_seed(0))
    cache = torch.randn(2 * n, c["hv"], c["dk"], c["dv"], device="cuda") * 0.1
    record = {}
    for bv, warps in ((8, 1), (16, 2), (32, 4), (64, 4)):
        record[f"ours_bv{bv}_w{warps}_ms"] = bench_ms(lambda bv=bv, warps=warps: triton_gdn.recurrent_gated_delta_rule(
            q, k, v, g, beta, cache, slot_in=meta.state_slots, has_initial_state=meta.has_initial_state,
            block_v=bv, num_warps=warps))

    def dense(fn):
        def run():
            init = gdn._gather_state(cache, meta)
            o, st = fn(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], None, init, True, True)
            cache.index_copy_(0, meta.state_slots, st)
        return run

    if backend.fla_available():
        from ninfer.kernels import fla_gdn

        record["fla_gather_scatter_ms"] = bench_ms(dense(fla_gdn.fused_recurrent_gated_delta_rule))
    record["reference_ms"] = bench_ms(dense(gdn.fused_recurrent_gated_delta_rule_ref))
    state_bytes = 2 * n * c["hv"] * c["dk"] * c["dv"] * 4
    best = min(v for key, v in record.items() if key.startswith("ours"))
    emit(timing="gdn_recurrent", seqs=n, state_rw_bytes=state_bytes, ours_best_gbps=state_bytes / best / 1e6, **record)


@guarded
def time_prefill_gdn(tokens):
    from ninfer.kernels import triton_gdn

    c = Q27
    meta = selfcheck._meta("cuda", [tokens], [False], [0])
    q, k, v, g, beta = selfcheck.gdn_problem("cuda", torch.bfloat16, tokens, c["hk"], c["hv"], c["dk"], c["dv"],
                                             torch.Generator().manual_seed(0))
    h0 = torch.zeros(1, c["hv"], c["dk"], c["dv"], device="cuda")
    args = (q[None], k[None], v[None], g[None], beta[None], None, h0, True, True, meta.cu_seqlens, [tokens])
    record = {"reference_ms": bench_ms(lambda: gdn.chunk_gated_delta_rule_ref(*args))}
    if backend.fla_available():
        from ninfer.kernels import fla_gdn

        record["fla_ms"] = bench_ms(lambda: fla_gdn.chunk_gated_delta_rule(*args))
    x = torch.randn(tokens, c["conv"], device="cuda", dtype=torch.bfloat16)
    w = torch.randn(c["conv"], 4, device="cuda", dtype=torch.bfloat16)
    init = torch.zeros(1, c["conv"], 3, device="cuda", dtype=torch.bfloat16)
    record["conv_triton_ms"] = bench_ms(lambda: triton_gdn.conv1d_varlen(x, w, init, meta.seq_idx, meta.pos_in_seq))
    record["conv_reference_ms"] = bench_ms(lambda: gdn.causal_conv1d_ref(x, w, init, meta.cu_seqlens, meta.seq_idx,
                                                                         meta.pos_in_seq))
    emit(timing="gdn_prefill", tokens=tokens, **record)


def timings():
    for batch, ctx in ((1, 200), (8, 200), (1, 4096), (8, 4096)):
        time_attention_decode(batch, ctx)
    time_attention_prefill(4096)
    for n in (1, 8):
        time_conv_update(n)
        time_recurrent(n)
    time_prefill_gdn(4096)


# ---- engine: graphs and host syncs ---------------------------------------------------------------


@guarded
def engine_graph_check(name, dtype):
    from ninfer.artifact.presets import get_preset, instantiate, tokenizer_json_for
    from ninfer.tokenizer import Tokenizer

    model = instantiate(name, "cuda", dtype, seed=0)
    tok = Tokenizer.from_json_str(tokenizer_json_for(get_preset("tiny-qwen3.6"))[0])
    prompts = [[(7 * i + 13 * j) % 900 + 50 for j in range(n)] for i, n in enumerate([3, 17, 5, 40, 9, 26, 2, 33])]
    t0 = time.perf_counter()
    on = selfcheck.engine_greedy(model, tok, "cuda", dtype, no_cuda_graph=False, concurrency=8, prompts=prompts)
    t1 = time.perf_counter()
    off = selfcheck.engine_greedy(model, tok, "cuda", dtype, no_cuda_graph=True, concurrency=8, prompts=prompts)
    t2 = time.perf_counter()
    alone = selfcheck.engine_greedy(model, tok, "cuda", dtype, no_cuda_graph=False, concurrency=1, prompts=prompts)
    emit(check="engine_greedy_graphs_vs_eager", model=name, dtype=str(dtype).removeprefix("torch."),
         identical=on["outputs"] == off["outputs"], batch8_equals_alone=on["outputs"] == alone["outputs"],
         graph_status=on["graph_status"], graph_replays=on["graph_replays"], eager_steps_with_graphs=on["eager_steps"],
         eager_decode_steps_without=off["eager_steps"], wall_s_graphs=t1 - t0, wall_s_eager=t2 - t1,
         first_output=on["outputs"][0])


@guarded
def sync_check(cuda_graphs):
    from ninfer.artifact.presets import instantiate

    model = instantiate("tiny-qwen3.6", "cuda", torch.bfloat16, seed=0)
    emit(check="decode_step_host_syncs", cuda_graphs=cuda_graphs,
         **selfcheck.runner_sync_check(model, "cuda", torch.bfloat16, cuda_graphs=cuda_graphs))


def engine_checks():
    # Qwen in bf16 only (its prefill goes through fla, which autotunes per dtype)
    for name, dtype in (("tiny-qwen3.6", torch.bfloat16), ("tiny-llama", torch.float32), ("tiny-llama", torch.bfloat16)):
        engine_graph_check(name, dtype)
    engine_graph_check("tiny-qwen3.6-moe", torch.bfloat16)  # grouped GEMM under capture
    sync_check(True)
    sync_check(False)


# ---- 27B decode profile --------------------------------------------------------------------------


def copy_bandwidth() -> float:
    src = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * (1 << 31) / ms / 1e6  # GB/s, read + write


@guarded
def profile_model(shape: str = "qwen3.6-27b", batches=(1, 8), prompt=128, weights: str = "bf16",
                  nvfp4_lm_head: bool = False):
    from types import SimpleNamespace

    from ninfer.artifact.presets import instantiate
    from ninfer.engine.runner import ModelRunner
    from ninfer.models import prepare_for_inference_

    bw = copy_bandwidth()
    model = instantiate(shape, "cuda", torch.bfloat16, seed=0, fuse=False)
    if weights == "nvfp4":  # as bench/gpu_decode.py builds it: quantize, then merge the projections
        from ninfer.quant.nvfp4 import quantize_model_

        quantize_model_(model, lm_head=nvfp4_lm_head)
        torch.cuda.empty_cache()
    prepare_for_inference_(model)
    tag = shape.removeprefix("qwen3.6-").replace("-", "_")  # "27b", "35b_a3b"
    tag += ("_nvfp4" + ("_lm_head" if nvfp4_lm_head else "")) if weights == "nvfp4" else ""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_decode import weight_stats  # NVFP4 weights are buffers, not parameters: counted there

    weight_bytes = weight_stats(model, model.config)["decode_bytes_b1_no_embed"]  # what a batch-1 step reads
    vocab = model.config["vocab_size"]
    max_b = max(batches)
    pages_per_seq = 32
    t0 = time.perf_counter()
    runner = ModelRunner(model, num_pages=pages_per_seq * max_b + 8192 // 16 + 1, page_size=16, num_state_slots=2 * max_b,
                         num_lanes=max_b, vocab_size=vocab, device=torch.device("cuda"), dtype=torch.bfloat16,
                         cuda_graphs=True, max_seq_len=8192 + 16, prefill_chunk=1024)
    capture_s = time.perf_counter() - t0
    emit(profile=f"{tag}_setup", copy_gbps=bw, weight_bytes=weight_bytes, roofline_tok_s_b1=bw * 1e9 / weight_bytes,
         graph_status=runner.graph_status, capture_s=capture_s)
    sampling = SimpleNamespace(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, presence_penalty=0.0,
                               frequency_penalty=0.0, seed=0)
    for b in batches:
        seqs = [SimpleNamespace(num_computed=0, pages=list(range(pages_per_seq * i, pages_per_seq * (i + 1))),
                                state_slot=i, lane=i, output_ids=[], sampling=sampling) for i in range(b)]
        for s in seqs:  # prefill each
            logits = runner.forward([s], [[(31 * j) % 5000 + 100 for j in range(prompt)]])
            s.output_ids.append(int(runner.sample([s], logits)[0]))
            s.num_computed = prompt

        def step(seqs=seqs):
            logits = runner.forward(seqs, [[s.output_ids[-1]] for s in seqs])
            toks = runner.sample(seqs, logits).tolist()
            for s, t in zip(seqs, toks):
                s.num_computed += 1
                s.output_ids.append(t)

        def timed(n, step=step):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(n):
                step()
            torch.cuda.synchronize()
            return (time.perf_counter() - t) / n

        step()
        graph_step = timed(20)
        replay_ms = None
        if (b, 1) in runner.graphs:
            graph = runner.graphs[(b, 1)].graph
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                graph.replay()
            end.record()
            end.synchronize()
            replay_ms = start.elapsed_time(end) / 20
        graphs, runner.graphs = runner.graphs, {}
        step()
        eager_step = timed(5)
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        runner.graphs = graphs
        per_kernel = defaultdict(float)
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                per_kernel[ev.name] += ev.time_range.elapsed_us() / 3 / 1000  # ms per step
        total = sum(per_kernel.values())
        groups = defaultdict(float)
        for name, ms in per_kernel.items():
            low = name.lower()
            if any(s in low for s in ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "splitk")):
                key = "matmul"
            elif "_decode_kernel" in low or "_combine_kernel" in low:
                key = "attention"
            elif "_recurrent_kernel" in low or "_conv_update_kernel" in low:
                key = "gdn"
            elif "_fused_" in low:  # ninfer.kernels.triton_fused: norms, rope, gates, silu-mul
                key = "fused elementwise"
            else:
                key = "other (elementwise, norms, copies, sampling)"
            groups[key] += ms
        top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:15]
        emit(profile=f"{tag}_decode", batch=b, step_ms_graphs=graph_step * 1e3, tok_s_graphs=b / graph_step,
             replay_only_ms=replay_ms, step_ms_eager=eager_step * 1e3, tok_s_eager=b / eager_step,
             gpu_kernel_ms_per_step=total, weight_floor_ms=weight_bytes / bw / 1e6,
             groups_ms={k: round(v, 3) for k, v in groups.items()},
             top_kernels_ms=[[n[:90], round(ms, 3)] for n, ms in top])
    profile_prefill(runner, vocab, first_page=pages_per_seq * max_b, tag=tag)


def _kernel_groups(prof, reps: int) -> tuple[float, dict, list]:
    per_kernel = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[ev.name] += ev.time_range.elapsed_us() / reps / 1000
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:12]
    return sum(per_kernel.values()), per_kernel, [[n[:90], round(ms, 3)] for n, ms in top]


def profile_prefill(runner, vocab: int, first_page: int, prompt: int = 8192, chunk: int = 1024,
                    tag: str = "27b") -> None:
    """One 8k prompt in 1024-token chunks: wall vs GPU-kernel time per chunk, eager and replayed from
    the prefill graph, and inside one eager chunk's forward the host's synchronising calls, its
    memcpy calls (which block only for pageable host memory) and its kernel launches: a chunk whose
    eager wall time exceeds its kernel time is host-bound."""
    from types import SimpleNamespace

    need_pages = -(-prompt // 16) + 1
    if runner.cache.num_pages < first_page + need_pages:
        emit(profile=f"{tag}_prefill", skipped=f"cache has {runner.cache.num_pages} pages, needs {first_page + need_pages}")
        return
    seq = SimpleNamespace(num_computed=0, pages=list(range(first_page, first_page + need_pages)), state_slot=0,
                          lane=0, output_ids=[], sampling=None)
    ids = [(31 * j) % 5000 + 100 for j in range(prompt)]
    walls, prompt_s, last = {}, {}, prompt - chunk
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    # with the prefill graph (if any), then without; the eager pass profiles its longest-context chunk
    for mode, forward in (("graph", runner.forward), ("eager", runner.forward_eager)):
        seq.num_computed = 0
        walls[mode] = []
        torch.cuda.synchronize()
        t_prompt = time.perf_counter()
        for i in range(0, prompt, chunk):
            torch.cuda.synchronize()
            t = time.perf_counter()
            if i == last and mode == "eager":
                with torch.profiler.profile(activities=acts) as prof:
                    forward([seq], [ids[i:i + chunk]])
                    torch.cuda.synchronize()
            else:
                forward([seq], [ids[i:i + chunk]])
                torch.cuda.synchronize()
                walls[mode].append(round((time.perf_counter() - t) * 1e3, 2))
            seq.num_computed += chunk
        prompt_s[mode] = round(time.perf_counter() - t_prompt, 4)
    total, _, top = _kernel_groups(prof, 1)
    syncs, copies, launches = defaultdict(int), defaultdict(int), 0
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CPU:
            continue
        if any(k in ev.name for k in ("Synchronize", "aten::item", "aten::_local_scalar_dense", "cudaHostAlloc",
                                      "aten::nonzero")):
            syncs[ev.name] += 1
        elif "cudaMemcpy" in ev.name:  # device-to-device copies too, which do not block the host
            copies[ev.name] += 1
        elif ev.name.startswith(("cudaLaunchKernel", "cuLaunchKernel")):
            launches += 1
    prof_wall = max((ev.time_range.end for ev in prof.events()), default=0) - \
        min((ev.time_range.start for ev in prof.events()), default=0)
    host_ops = sorted(((a.key, a.self_cpu_time_total / 1000, a.count) for a in prof.key_averages()),
                      key=lambda r: -r[1])[:20]
    emit(profile=f"{tag}_prefill", prompt=prompt, chunk=chunk, prefill_graph=runner.prefill_graph is not None,
         chunk_wall_ms_graph=walls["graph"], chunk_wall_ms_eager=walls["eager"], prompt_s_synced_per_chunk=prompt_s,
         host_self_ms_top=[[k[:60], round(ms, 2), n] for k, ms, n in host_ops],
         last_chunk_gpu_kernel_ms=round(total, 3), last_chunk_profiled_wall_ms=round(prof_wall / 1000, 3),
         host_syncs=dict(syncs), memcpy_calls=dict(copies), kernel_launches=launches, top_kernels_ms=top)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=["checks", "timings", "engine"],
                    choices=["checks", "timings", "engine", "profile"])
    ap.add_argument("--shape", default="qwen3.6-27b", choices=["qwen3.6-27b", "qwen3.6-35b-a3b"],
                    help="the preset the profile part builds")
    ap.add_argument("--weights", default="bf16", choices=["bf16", "nvfp4"], help="the profile part's weight format")
    ap.add_argument("--nvfp4-lm-head", action="store_true", help="NVFP4 weights: the lm_head quantized too")
    args = ap.parse_args()
    if args.nvfp4_lm_head and args.weights != "nvfp4":
        ap.error("--nvfp4-lm-head needs --weights nvfp4")
    import importlib.metadata as md

    def version(pkg):
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    emit(check="device", name=torch.cuda.get_device_name(), torch=torch.__version__, triton=version("triton"),
         fla_core=version("fla-core"), backends=backend.describe("cuda"))
    t0 = time.perf_counter()
    for part in args.only:
        start = time.perf_counter()
        {"checks": checks, "timings": timings, "engine": engine_checks,
         "profile": lambda: profile_model(args.shape, weights=args.weights, nvfp4_lm_head=args.nvfp4_lm_head)}[part]()
        emit(section=part, wall_s=time.perf_counter() - start)
    emit(total_wall_s=time.perf_counter() - t0)


if __name__ == "__main__":
    main()
