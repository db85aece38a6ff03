"""Kernel-vs-reference checks on random problems, shared by tests/test_kernels.py and bench/gpu_kernels.py.

Each `check_*` builds a random problem on `device` in `dtype`, runs the CUDA-backend kernel (our
Triton kernels; fla-core for the chunked rule) and the torch reference on the same inputs, and
returns {output: max abs diff} plus the reference's scale. The Triton kernels also run on CPU
tensors under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.chat.thinking import thinking_control
from ninfer.forward import ForwardBatch
from ninfer.kernels import gdn
from ninfer.kernels.attention import paged_attention_ref


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rand(shape, gen, dtype, device, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype=dtype, device=device)


def attention_problem(device, dtype, *, hq: int, hkv: int, head_dim: int, page_size: int,
                      cached: list[int], new: list[int], num_pages: int | None = None, seed: int = 0):
    """Random caches and a ragged batch: sequence i has cached[i] tokens and appends new[i]."""
    gen = _gen(seed)
    need = [-(-(c + n) // page_size) for c, n in zip(cached, new)]
    num_pages = num_pages or sum(need) + 3
    perm = torch.randperm(num_pages, generator=gen).tolist()  # scattered pages
    tables, at = [], 0
    for k in need:
        tables.append(perm[at: at + k])
        at += k
    slots = num_pages * page_size
    k_cache = _rand((slots, hkv, head_dim), gen, dtype, device)
    v_cache = _rand((slots, hkv, head_dim), gen, dtype, device)
    batch = ForwardBatch.build([[1] * n for n in new], cached, tables, page_size, device=device)
    q = _rand((sum(new), hq, head_dim), gen, dtype, device)
    return q, k_cache, v_cache, batch


def default_lengths(decode: bool, cached: list[int] | None, new: list[int] | None) -> tuple[list[int], list[int]]:
    """The attention checks' default ragged batch: cached tokens and new tokens per sequence."""
    if cached is None:
        cached = [0, 5, 37, 130] if not decode else [0, 16, 77, 200]
    if new is None:
        new = [1] * len(cached) if decode else [33, 1, 64, 7]
    return cached, new


def check_attention(device, dtype, *, decode: bool, hq=8, hkv=2, head_dim=64, page_size=16, cached=None, new=None,
                    seed=0) -> dict:
    from ninfer.kernels import triton_attention

    cached, new = default_lengths(decode, cached, new)
    q, kc, vc, batch = attention_problem(device, dtype, hq=hq, hkv=hkv, head_dim=head_dim, page_size=page_size,
                                         cached=cached, new=new, seed=seed)
    scale = head_dim**-0.5
    ref = paged_attention_ref(q, kc, vc, batch, page_size, scale).float()
    if decode:
        got = triton_attention.paged_decode(q, kc, vc, batch.page_table, batch.seq_lens, page_size, scale)
        diffs = {"out": (got.float() - ref).abs().max().item()}
        for splits in (1, 3, 8):  # the split merge against the unsplit kernel
            alt = triton_attention.paged_decode(q, kc, vc, batch.page_table, batch.seq_lens, page_size, scale,
                                                num_splits=splits)
            diffs[f"out_splits{splits}"] = (alt.float() - ref).abs().max().item()
    else:
        got = triton_attention.paged_prefill(q, kc, vc, batch.query_start_loc, batch.seq_lens, batch.page_table,
                                             page_size, scale, max(batch.query_lens_cpu))
        diffs = {"out": (got.float() - ref).abs().max().item()}
    return {"max_abs_diff": diffs, "ref_absmax": ref.abs().max().item()}


def _meta(device, query_lens, has_init, slots):
    cached = [5 if h else 0 for h in has_init]
    batch = ForwardBatch.build([[1] * n for n in query_lens], cached, [[0]] * len(query_lens), 1 << 20,
                               state_slots=slots, device=device)
    return gdn.GDNMetadata.from_batch(batch)


def check_conv_update(device, dtype, *, channels=384, width=3, seed=0) -> dict:
    from ninfer.kernels import triton_gdn

    gen = _gen(seed)
    slots, has_init = [4, 1, 6], [True, False, True]
    meta = _meta(device, [1, 1, 1], has_init, slots)
    x = _rand((3, channels), gen, dtype, device)
    w = _rand((channels, width + 1), gen, dtype, device, 0.5)
    cache = _rand((8, channels, width), gen, dtype, device)
    cache[1] = float("nan")  # a fresh sequence's slot may hold anything
    ref_cache = cache.clone()
    initial = gdn._gather_state(ref_cache, meta)
    ref_y, ref_state = gdn.causal_conv1d_update_ref(x, w, initial)
    ref_cache.index_copy_(0, meta.state_slots, ref_state.to(ref_cache.dtype))
    y = triton_gdn.conv1d_update(x, w, cache, slot_in=meta.state_slots, has_initial_state=meta.has_initial_state)
    return {"max_abs_diff": {"y": (y.float() - ref_y.float()).abs().max().item(),
                             "state": (cache[slots].float() - ref_cache[slots].float()).abs().max().item(),
                             "untouched": (cache[[0, 2, 3, 5, 7]].float() - ref_cache[[0, 2, 3, 5, 7]].float())
                             .abs().max().item()},
            "ref_absmax": ref_y.float().abs().max().item()}


def check_conv_varlen(device, dtype, *, channels=384, width=3, query_lens=(1, 9, 2, 40), seed=0) -> dict:
    from ninfer.kernels import triton_gdn

    gen = _gen(seed)
    n = len(query_lens)
    has_init = [i % 2 == 1 for i in range(n)]
    meta = _meta(device, list(query_lens), has_init, list(range(n)))
    x = _rand((sum(query_lens), channels), gen, dtype, device)
    w = _rand((channels, width + 1), gen, dtype, device, 0.5)
    initial = _rand((n, channels, width), gen, dtype, device)
    initial[~meta.has_initial_state] = 0
    ref_y, ref_final = gdn.causal_conv1d_ref(x, w, initial, meta.cu_seqlens, meta.seq_idx, meta.pos_in_seq)
    y = triton_gdn.conv1d_varlen(x, w, initial, meta.seq_idx, meta.pos_in_seq)
    return {"max_abs_diff": {"y": (y.float() - ref_y.float()).abs().max().item()},
            "ref_absmax": ref_y.float().abs().max().item()}


def gdn_problem(device, dtype, tokens, hk, hv, dk, dv, gen):
    q = _rand((tokens, hk, dk), gen, dtype, device)
    k = _rand((tokens, hk, dk), gen, dtype, device)
    v = _rand((tokens, hv, dv), gen, dtype, device)
    g = -F.softplus(_rand((tokens, hv), gen, torch.float32, device)) * 0.5  # log decay < 0
    beta = torch.sigmoid(_rand((tokens, hv), gen, torch.float32, device)).to(dtype)
    return q, k, v, g, beta


def check_recurrent(device, dtype, *, hk=2, hv=4, dk=32, dv=32, block_v=32, num_warps=4, seed=0) -> dict:
    from ninfer.kernels import triton_gdn

    gen = _gen(seed)
    slots, has_init = [3, 0, 5], [True, False, True]
    meta = _meta(device, [1, 1, 1], has_init, slots)
    q, k, v, g, beta = gdn_problem(device, dtype, 3, hk, hv, dk, dv, gen)
    cache = _rand((6, hv, dk, dv), gen, torch.float32, device, 0.1)
    cache[0] = float("nan")
    ref_cache = cache.clone()
    initial = gdn._gather_state(ref_cache, meta)
    ref_o, ref_state = gdn.fused_recurrent_gated_delta_rule_ref(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], None, initial, True, True)
    ref_cache.index_copy_(0, meta.state_slots, ref_state)
    o = triton_gdn.recurrent_gated_delta_rule(q, k, v, g, beta, cache, slot_in=meta.state_slots,
                                              has_initial_state=meta.has_initial_state, block_v=block_v,
                                              num_warps=num_warps)
    return {"max_abs_diff": {"o": (o.float() - ref_o[:, 0].float()).abs().max().item(),
                             "state": (cache[slots] - ref_cache[slots]).abs().max().item(),
                             "untouched": (cache[[1, 2, 4]] - ref_cache[[1, 2, 4]]).abs().max().item()},
            "ref_absmax": ref_o.float().abs().max().item()}


def check_fla(device, dtype, *, hk=2, hv=4, dk=64, dv=64, query_lens=(1, 70, 5, 130), seed=0) -> dict:
    """fla-core's chunked (varlen) and fused-recurrent rules through our dispatch signatures."""
    from ninfer.kernels import fla_gdn

    gen = _gen(seed)
    n = len(query_lens)
    q, k, v, g, beta = gdn_problem(device, dtype, sum(query_lens), hk, hv, dk, dv, gen)
    h0 = _rand((n, hv, dk, dv), gen, torch.float32, device, 0.1)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    args = (q[None], k[None], v[None], g[None], beta[None])
    ref_o, ref_h = gdn.chunk_gated_delta_rule_ref(*args, None, h0, True, True, cu, list(query_lens))
    o, h = fla_gdn.chunk_gated_delta_rule(*args, None, h0, True, True, cu, list(query_lens))
    out = {"chunk_o": (o.float() - ref_o.float()).abs().max().item(),
           "chunk_state": (h.float() - ref_h.float()).abs().max().item()}
    # our once-per-forward chunk table (GDNMetadata) must be fla's own, and give the same result
    from fla.ops.utils.index import prepare_chunk_indices

    ours = gdn._chunk_indices(list(query_lens), cu)
    out["chunk_indices_mismatch"] = float(not torch.equal(ours, prepare_chunk_indices(cu.long(), gdn.CHUNK_SIZE)))
    o2, h2 = fla_gdn.chunk_gated_delta_rule(*args, None, h0, True, True, cu.long(), list(query_lens), ours)
    out["chunk_o_with_indices"] = (o2.float() - ref_o.float()).abs().max().item()
    out["chunk_state_with_indices"] = (h2.float() - ref_h.float()).abs().max().item()
    # the direct call into fla's forward must match fla's public entry point bit for bit
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_public

    o3, h3 = fla_public(*args[:3], args[3].float(), args[4], initial_state=h0, output_final_state=True,
                        use_qk_l2norm_in_kernel=True, cu_seqlens=cu.long())
    out["chunk_o_vs_fla_public"] = (o2.float() - o3.float()).abs().max().item()
    out["chunk_state_vs_fla_public"] = (h2.float() - h3.float()).abs().max().item()
    b = n  # one token each, dense batch
    q1, k1, v1, g1, beta1 = gdn_problem(device, dtype, b, hk, hv, dk, dv, gen)
    args1 = (q1[:, None], k1[:, None], v1[:, None], g1[:, None], beta1[:, None])
    ref_o1, ref_h1 = gdn.fused_recurrent_gated_delta_rule_ref(*args1, None, h0, True, True)
    o1, h1 = fla_gdn.fused_recurrent_gated_delta_rule(*args1, None, h0, True, True)
    out["recurrent_o"] = (o1.float() - ref_o1.float()).abs().max().item()
    out["recurrent_state"] = (h1.float() - ref_h1.float()).abs().max().item()
    return {"max_abs_diff": out, "ref_absmax": ref_o.float().abs().max().item()}


# ---------------------------------------------------------------------------------------------
# Engine-level checks (CUDA graphs, host synchronization)


def engine_greedy(model, tokenizer, device, dtype, *, no_cuda_graph: bool, concurrency: int,
                  prompts: list[list[int]], max_tokens: int = 12, kv_dtype: str = "bf16", sampling=None) -> dict:
    """Tokens of every prompt through a fresh Engine, greedy unless `sampling` (SamplingParams, request
    i's seed plus i) is given; with the runner's graph status and step counts."""
    import asyncio

    from ninfer.engine.engine import Engine, EngineSettings
    from ninfer.engine.types import EngineRequest, SamplingParams, TokenEvent

    settings = EngineSettings(max_context=256, max_concurrency=concurrency, prefill_chunk=16, eos_ids=set(),
                              no_cuda_graph=no_cuda_graph, kv_dtype=kv_dtype)
    engine = Engine(model, tokenizer, settings, device=device, dtype=dtype, thinking=thinking_control(tokenizer)).start()
    engine.settings.eos_ids = set()
    from dataclasses import replace

    sampling = sampling or SamplingParams(temperature=0.0)
    reqs = [EngineRequest(f"g{i}", p, max_tokens=max_tokens,
                          sampling=replace(sampling, seed=None if sampling.seed is None else sampling.seed + i))
            for i, p in enumerate(prompts)]

    async def main():
        async def one(r):
            return [i for e in [x async for x in engine.stream(r)] if isinstance(e, TokenEvent) for i in e.token_ids]
        return await asyncio.gather(*(one(r) for r in reqs))

    try:
        outputs = asyncio.run(main())
    finally:
        engine.shutdown()
    runner = engine.runner
    return {"outputs": outputs, "graph_status": runner.graph_status, "graph_replays": runner.graph_replays,
            "prefill_replays": runner.prefill_replays, "sampler_replays": runner.sampler_replays,
            "eager_steps": runner.eager_steps}


def runner_sync_check(model, device, dtype, *, batch: int = 4, steps: int = 3, cuda_graphs: bool = True,
                      kv_dtype: str = "bf16") -> dict:
    """Prefill `batch` sequences eagerly, then run decode steps (forward + sample + penalty counts)
    under torch.cuda.set_sync_debug_mode("error"): any host synchronization raises."""
    from types import SimpleNamespace

    from ninfer.engine.runner import ModelRunner

    vocab = model.config["vocab_size"]
    runner = ModelRunner(model, num_pages=64, page_size=16, num_state_slots=2 * batch, num_lanes=batch,
                         vocab_size=vocab, device=torch.device(device), dtype=dtype, cuda_graphs=cuda_graphs,
                         max_seq_len=256, kv_dtype=kv_dtype)
    sampling = SimpleNamespace(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, presence_penalty=0.5,
                               frequency_penalty=0.1, seed=1234)
    seqs = [SimpleNamespace(num_computed=0, pages=[4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3], state_slot=i, lane=i,
                            output_ids=[], sampling=sampling) for i in range(batch)]
    prompt = [[(31 * i + 7 * j) % 1000 + 10 for j in range(5 + 3 * i)] for i in range(batch)]
    logits = runner.forward(seqs, prompt)
    tokens = runner.sample(seqs, logits).tolist()
    for s, p, t in zip(seqs, prompt, tokens):
        s.num_computed = len(p)
        s.output_ids.append(t)
    error = None
    torch.cuda.synchronize()
    for _ in range(steps):
        torch.cuda.set_sync_debug_mode("error")
        try:
            logits = runner.forward(seqs, [[s.output_ids[-1]] for s in seqs])
            ids = runner.sample(seqs, logits)
            runner.count_tokens([s.lane for s in seqs], ids)
        except RuntimeError as exc:
            error = str(exc).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if error:
            break
        for s, t in zip(seqs, ids.tolist()):  # the engine's one sync per step, outside the checked region
            s.num_computed += 1
            s.output_ids.append(t)
    return {"host_sync_in_decode_step": error or "none", "graph_status": runner.graph_status,
            "graph_replays": runner.graph_replays, "sampler_replays": runner.sampler_replays}
