"""The flat CPU decode loop of Llama models (ninfer.models.llama_cpu, issue 23) against the module path, the
native C decode step (ninfer.kernels.cpu_native) against an fp32 oracle, and the CPU decode attention
(kernels.attention: page runs, LSE merge, long-context matmuls; the C kernel) against a gathered-context SDPA."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from ninfer.forward import KV_STORAGE, NVFP4_ROW, ForwardBatch, ModelCache
from ninfer.kernels import attention, cpu_native
from ninfer.kernels.attention import cpu_decode_rows, paged_attention_ref, sequence_slots
from ninfer.kernels.cpu_native import NativeLlamaDecode
from ninfer.models.llama import LlamaForCausalLM
from ninfer.models.llama_cpu import DecodePlan
from ninfer.quant.int8_cpu import quantize_model_int8_

PAGE = 4
CONFIG = dict(  # SmolLM2-like (GQA 3:1, tied head), tiny
    vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
    num_key_value_heads=2, head_dim=8, tie_word_embeddings=True, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 1e4},
)


def tiny_model(dtype: str, **config) -> LlamaForCausalLM:
    """Random weights (norms too), projections merged as the loader does; int8: bf16 + int8 weight-only."""
    model = LlamaForCausalLM({**CONFIG, **config}).eval()
    model.init_random_(3)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.mul_(10.0)  # std 0.2: logits far enough apart that greedy picks are stable
    model.fuse_projections_()
    if dtype == "int8":
        model.to(torch.bfloat16)
        quantize_model_int8_(model)
    return model


def layout(kind: str, pages: int) -> list[int]:
    """A sequence's pages: one run, a few runs, or more runs than MAX_RUNS (the gathered fallback)."""
    if kind == "one_run":
        return list(range(3, 3 + pages))
    if kind == "few_runs":  # runs of 3 pages with a gap between
        return [p + p // 3 for p in range(pages)]
    return list(range(0, 2 * pages, 2))  # every page its own run


def greedy(model: LlamaForCausalLM, prompts: list[list[int]], tables: list[list[int]], steps: int,
           use_plan: bool, dtype: torch.dtype, kv_dtype: str = "bf16") -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill each prompt, then `steps` greedy decode steps of all sequences as one batch; the tokens and
    each step's final hidden states."""
    if not use_plan:
        model.__dict__["_decode_plan"] = False  # what decode_plan() caches for "does not apply"
    cache = ModelCache(model.cache_spec(), max(max(t) for t in tables) + 1, PAGE, 1, dtype=dtype, kv_dtype=kv_dtype)
    lens = [0] * len(prompts)
    with torch.no_grad():
        batch = ForwardBatch.build(prompts, lens, tables, PAGE)
        hidden = model(batch, cache)
        tokens = [[int(t)] for t in model.compute_logits(hidden[batch.last_token_indices()]).argmax(-1)]
        lens = [len(p) for p in prompts]
        states = []
        for _ in range(steps):
            batch = ForwardBatch.build([t[-1:] for t in tokens], lens, tables, PAGE)
            hidden = model(batch, cache)
            states.append(hidden.float())
            for seq, t in zip(tokens, model.compute_logits(hidden).argmax(-1)):
                seq.append(int(t))
            lens = [n + 1 for n in lens]
    model.__dict__.pop("_decode_plan", None)
    return tokens, states


@pytest.fixture
def torch_loop(monkeypatch):
    """The plan's torch loop, not the native step (which int8 models take where a compiler is present)."""
    monkeypatch.setattr(NativeLlamaDecode, "build", classmethod(lambda cls, plan: None))


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
@pytest.mark.parametrize("kind", ["one_run", "few_runs", "many_runs"])
def test_decode_plan_equals_module_path(dtype, kind, monkeypatch, torch_loop):
    model = tiny_model(dtype)
    assert isinstance(model.decode_plan(), DecodePlan)
    runs = []
    real_run = DecodePlan.run
    monkeypatch.setattr(DecodePlan, "run", lambda self, *a: runs.append(1) or real_run(self, *a))
    cache_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    steps, prompt = 10, [(7 * i) % 97 for i in range(37)]  # 37 + 10 tokens: 12 pages
    table = [layout(kind, 12)]
    want_tokens, want_states = greedy(model, [prompt], table, steps, False, cache_dtype)
    assert not runs
    got_tokens, got_states = greedy(model, [prompt], table, steps, True, cache_dtype)
    assert len(runs) == steps
    assert got_tokens == want_tokens
    atol = 1e-5 if dtype == "fp32" else 2e-2
    for got, want in zip(got_states, want_states):
        torch.testing.assert_close(got, want, atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_decode_plan_batch_of_several_sequences_equals_module_path(dtype, torch_loop):
    """B > 1: the plan's loop with paged_attention_ref per row (one run, several runs, gathered)."""
    model = tiny_model(dtype)
    cache_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    prompts = [[(5 * i + 1) % 97 for i in range(30)], [(3 * i + 2) % 97 for i in range(9)],
               [(11 * i) % 97 for i in range(21)]]
    tables = [list(range(0, 11)), [40, 41, 43, 44], [20 + 2 * i for i in range(8)]]
    want_tokens, want_states = greedy(model, prompts, tables, 6, False, cache_dtype)
    got_tokens, got_states = greedy(model, prompts, tables, 6, True, cache_dtype)
    assert got_tokens == want_tokens
    atol = 1e-5 if dtype == "fp32" else 2e-2
    for got, want in zip(got_states, want_states):
        torch.testing.assert_close(got, want, atol=atol, rtol=atol)


def test_decode_plan_is_dropped_when_modules_change():
    model = tiny_model("fp32")
    plan = model.decode_plan()
    assert model.decode_plan() is plan
    model.to(torch.bfloat16)
    assert model.decode_plan() is not plan
    plan = model.decode_plan()
    quantize_model_int8_(model)
    assert model.decode_plan() is not plan


def test_no_plan_without_merged_projections():
    model = LlamaForCausalLM(CONFIG)  # fuse_projections_ not called
    assert model.decode_plan() is None


# ---- attention helpers ----------------------------------------------------------------------------------


def gathered_attention(q, k_cache, v_cache, batch, page_size, scale):
    """The oracle: each sequence's context gathered by slot, fp32 SDPA with its KV heads repeated."""
    out = []
    for i in range(q.shape[0]):
        slots = sequence_slots(batch, i, page_size)
        group = q.shape[1] // k_cache.shape[1]
        k = k_cache[slots].float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, n, D]
        v = v_cache[slots].float().repeat_interleave(group, dim=1).transpose(0, 1)
        out.append(F.scaled_dot_product_attention(q[i].float()[:, None], k, v, scale=scale)[:, 0])
    return torch.stack(out)


def decode_problem(context: list[int], tables: list[list[int]], page_size: int, dtype: torch.dtype, seed: int = 0):
    """Random caches and decode queries (Hq 9, Hkv 3, D 64: SmolLM2's heads) for sequences of `context`
    tokens (the new one included) on `tables`."""
    gen = torch.Generator().manual_seed(seed)
    slots = (max(max(t) for t in tables) + 1) * page_size
    k_cache = torch.randn(slots, 3, 64, generator=gen).to(dtype)
    v_cache = torch.randn(slots, 3, 64, generator=gen).to(dtype)
    q = (2 * torch.randn(len(context), 9, 64, generator=gen)).to(dtype)
    batch = ForwardBatch.build([[0]] * len(context), [n - 1 for n in context], tables, page_size)
    return q, k_cache, v_cache, batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context,kind", [
    (50, "one_run"), (50, "few_runs"), (50, "many_runs"),  # many: past MAX_RUNS, gathered
    (attention.LONG_CONTEXT + 333, "one_run"), (attention.LONG_CONTEXT + 333, "few_runs"),
])
def test_cpu_decode_rows_match_gathered_attention(dtype, context, kind):
    page_size = 16 if context > 100 else PAGE
    pages = -(-context // page_size)
    table = layout(kind, pages) if kind != "few_runs" or context <= 100 else \
        [p + 2 * (p // (pages // 3)) for p in range(pages)]  # long context: 3-4 runs
    q, k_cache, v_cache, batch = decode_problem([context], [table], page_size, dtype)
    runs = attention._context_runs(batch, 0, page_size)
    assert (runs is None) == (kind == "many_runs") and (kind != "one_run" or len(runs) == 1)
    want = gathered_attention(q, k_cache, v_cache, batch, page_size, 0.125)
    got = cpu_decode_rows(q, k_cache, v_cache, batch, page_size, 0.125)
    assert got.shape == q.shape and got.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    ref = paged_attention_ref(q, k_cache, v_cache, batch, page_size, 0.125)
    torch.testing.assert_close(ref.float(), want, atol=tol, rtol=tol)


def test_cpu_decode_rows_batch_of_several_sequences():
    contexts = [9, attention.LONG_CONTEXT + 100, 30]
    tables = [[0, 1, 2], list(range(10, 10 + (attention.LONG_CONTEXT + 100 + 15) // 16)), [300, 302, 303, 305]]
    tables[0], tables[2] = [p * 4 for p in tables[0]], [p * 4 for p in tables[2]]  # out of the long one's way
    q, k_cache, v_cache, batch = decode_problem(contexts, tables, 16, torch.float32)
    want = gathered_attention(q, k_cache, v_cache, batch, 16, 0.125)
    got = cpu_decode_rows(q, k_cache, v_cache, batch, 16, 0.125)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


# ---- the native C decode step (ninfer/kernels/cpu_decode.c) --------------------------------------------------

needs_native = pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler: the torch loop runs instead")


def oracle_of(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """The int8 model's weights (dequantized), norms and embedding in an fp32 model: what both int8 decode paths
    approximate, one with bf16 rounding after every op, the other with fp32 arithmetic."""
    from ninfer.quant.int8_cpu import Int8Linear

    oracle = tiny_model("fp32")
    dequantized = {name: m.weight_int8.float() * m.scale.float()[:, None]
                   for name, m in model.named_modules() if isinstance(m, Int8Linear)}
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, m in oracle.named_modules():
            if name in dequantized:
                m.weight.copy_(dequantized[name])
        for name, p in oracle.named_parameters():
            if "norm" in name or name == "embed_tokens.weight":
                p.copy_(params[name].float())
    return oracle


@needs_native
@pytest.mark.parametrize("kind", ["one_run", "few_runs", "many_runs"])
def test_native_decode_step_tracks_the_fp32_oracle(kind, monkeypatch):
    """Greedy tokens equal the oracle's, and the hidden states stay as close to it as the torch int8 path's."""
    model = tiny_model("int8")
    plan = model.decode_plan()
    assert plan.native is not None
    calls = []
    real_run = NativeLlamaDecode.run
    monkeypatch.setattr(NativeLlamaDecode, "run", lambda self, *a: calls.append(1) or real_run(self, *a))
    steps, prompt, table = 10, [(7 * i) % 97 for i in range(37)], [layout(kind, 12)]
    want_tokens, want = greedy(oracle_of(model), [prompt], table, steps, True, torch.float32)
    got_tokens, got = greedy(model, [prompt], table, steps, True, torch.bfloat16)
    assert len(calls) == steps
    monkeypatch.setattr(NativeLlamaDecode, "build", classmethod(lambda cls, plan: None))
    _, torch_states = greedy(model, [prompt], table, steps, True, torch.bfloat16)
    assert got_tokens == want_tokens
    native_err = torch.stack([(g - w).abs().mean() for g, w in zip(got, want)]).mean()
    torch_err = torch.stack([(t - w).abs().mean() for t, w in zip(torch_states, want)]).mean()
    assert native_err < 1.25 * torch_err + 1e-3, (native_err, torch_err)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0.15, rtol=0.05)


@needs_native
def test_native_decode_step_batch_of_several_sequences():
    model = tiny_model("int8")
    prompts = [[(5 * i + 1) % 97 for i in range(30)], [(3 * i + 2) % 97 for i in range(9)],
               [(11 * i) % 97 for i in range(21)]]
    tables = [list(range(0, 11)), [40, 41, 43, 44], [20 + 2 * i for i in range(8)]]
    want_tokens, want = greedy(oracle_of(model), prompts, tables, 6, True, torch.float32)
    got_tokens, got = greedy(model, prompts, tables, 6, True, torch.bfloat16)
    assert got_tokens == want_tokens
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0.15, rtol=0.05)


def bf16_problem(context: list[int], tables: list[list[int]], page_size: int, hq: int, hkv: int, d: int):
    gen = torch.Generator().manual_seed(sum(context) + hq + d)
    slots = (max(max(t) for t in tables) + 1) * page_size
    k_cache = torch.randn(slots, hkv, d, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(slots, hkv, d, generator=gen).to(torch.bfloat16)
    q = (2 * torch.randn(len(context), hq, d, generator=gen)).to(torch.bfloat16)
    batch = ForwardBatch.build([[0]] * len(context), [n - 1 for n in context], tables, page_size)
    return q, k_cache, v_cache, batch


def attention_tolerance(d: int) -> dict:
    """The vector path (AVX-512 BF16, head_dim a multiple of 32) takes the softmax weights in bf16 (relative 2^-9;
    q as well, exact here: it is bf16 already); the plain C path is fp32 throughout."""
    vector = d % 32 == 0 and "avx512_bf16" in cpu_native._cpu_flags()
    return dict(atol=4e-3, rtol=1e-2) if vector else dict(atol=2e-5, rtol=2e-5)


@needs_native
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 64), (14, 2, 64), (8, 2, 128), (30, 5, 64), (6, 2, 40)])
@pytest.mark.parametrize("context", [1, 15, 16, 17, 129, 300, 1000])
def test_native_attention_matches_gathered_attention(hq, hkv, d, context):
    """Vector path (head_dim a multiple of 32; sizes as constants for 3:1 and 7:1 heads of 64, its general form for
    8:2 of 128) and the plain C path (head_dim 40); contexts across the chunk (128) and 16-token block edges,
    pages in several runs."""
    page_size = 16
    pages = -(-context // page_size)
    table = [p + p // 3 for p in range(pages)]
    q, k_cache, v_cache, batch = bf16_problem([context], [table], page_size, hq, hkv, d)
    scale = d ** -0.5
    want = gathered_attention(q, k_cache, v_cache, batch, page_size, scale)
    got = cpu_native.decode_attention(q, k_cache, v_cache, batch.page_table, batch.seq_lens, page_size, scale)
    torch.testing.assert_close(got, want, **attention_tolerance(d))


@needs_native
def test_native_attention_batch_of_several_sequences():
    contexts = [9, 700, 130]
    tables = [[0], list(range(10, 10 + 44)), [300, 302, 303, 305, 307, 309, 311, 313, 315]]
    q, k_cache, v_cache, batch = bf16_problem(contexts, tables, 16, 9, 3, 64)
    want = gathered_attention(q, k_cache, v_cache, batch, 16, 0.125)
    got = cpu_native.decode_attention(q, k_cache, v_cache, batch.page_table, batch.seq_lens, 16, 0.125)
    torch.testing.assert_close(got, want, **attention_tolerance(64))


@needs_native
@pytest.mark.parametrize("rows", [1, 3])
def test_native_int8_logits_match_the_dequantized_matmul(rows):
    from ninfer.quant.int8_cpu import Int8Linear

    gen = torch.Generator().manual_seed(rows)
    head = Int8Linear(torch.randn(1000, 576, generator=gen) * 0.05)
    x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    got = head.logits(x)
    want = x.float() @ (head.weight_int8.float() * head.scale.float()[:, None]).T
    # activations go through int16 (16383 levels of the row's maximum): far inside bf16's rounding
    torch.testing.assert_close(got, want, atol=2e-3 * want.abs().max().item(), rtol=0)
    torch.testing.assert_close(head.logits(x[:, None, :].expand(rows, 2, 576).reshape(2 * rows, 576))[::2], got)


@needs_native
def test_plain_c_build_computes_what_the_vector_build_computes():
    """A machine without AVX-512 VNNI compiles the plain C loops: its matmul sums are the same integers in the
    same order (bitwise the same logits), its attention the same to rounding."""
    import ctypes

    plain = cpu_native.load(cpu_native.build(("-mno-avx512f",)))
    from ninfer.quant.int8_cpu import Int8Linear

    gen = torch.Generator().manual_seed(5)
    head = Int8Linear(torch.randn(300, 1000, generator=gen) * 0.05)  # K not a multiple of 32 or 256
    x = torch.randn(2, 1000, generator=gen).to(torch.bfloat16)
    y = torch.empty(2, 300)
    q = cpu_native._qlinear(head)
    assert plain.ninfer_qlinear_bf16(ctypes.byref(q), 2, x.data_ptr(), y.data_ptr(), 2) == 0
    assert torch.equal(y, head.logits(x))

    q, k_cache, v_cache, batch = bf16_problem([300], [list(range(19))], 16, 9, 3, 64)
    want = cpu_native.decode_attention(q, k_cache, v_cache, batch.page_table, batch.seq_lens, 16, 0.125)
    out = cpu_native.decode_attention(q, k_cache, v_cache, batch.page_table, batch.seq_lens, 16, 0.125, lib=plain)
    torch.testing.assert_close(out, want, **attention_tolerance(64))
    for storage in (torch.int8, NVFP4_ROW):  # the plain loops quantize and expand KV rows alike, bit for bit
        rows = kv_rows_problem(64, 40)
        values, scales = cpu_native.quantize_kv_rows(rows, storage, lib=plain)
        assert torch.equal(values.view(torch.uint8), cpu_native.quantize_kv_rows(rows, storage)[0].view(torch.uint8))
        assert torch.equal(cpu_native.dequantize_kv_rows(values, scales, 64, lib=plain),
                           cpu_native.dequantize_kv_rows(values, scales, 64))


def kv_rows_problem(d: int, n: int) -> torch.Tensor:
    """[n, d] bf16 rows of K/V-like values: several magnitudes, an all-zero row, a row of one value, rows with values
    at E2M1 / int8 rounding ties, tiny rows (E4M3 subnormal block scales)."""
    gen = torch.Generator().manual_seed(d + n)
    rows = torch.randn(n, d, generator=gen) * torch.logspace(-3, 2, n)[:, None]
    rows[0] = 0.0
    rows[1] = 0.75
    rows[2, : d // 2] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * (d // 16))
    rows[2, d // 2:] = -rows[2, : d // 2]
    rows[3] = torch.arange(d) - d / 2  # int8 ties: k * amax / 127 for integers k
    rows[4, 0] = 100.0  # one large value: every other block's scale far below it
    rows[4, 1:] = rows[4, 1:] * 1e-4
    return rows.to(torch.bfloat16)


@needs_native
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("storage", [torch.int8, NVFP4_ROW], ids=["int8", "nvfp4"])
def test_native_kv_write_is_the_torch_quantization(storage, d):
    """A decode step's KV write in C stores the bytes and scales attention.quantize_kv stores for the same bf16
    values, and its expansion for attention is dequantize_kv in bf16, bit for bit."""
    rows = kv_rows_problem(d, 64)
    want_values, want_scales = attention.quantize_kv(rows, storage)
    values, scales = cpu_native.quantize_kv_rows(rows, storage)
    assert torch.equal(scales, want_scales)
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(cpu_native.dequantize_kv_rows(values, scales, d),
                       attention.dequantize_kv(values, scales, torch.bfloat16))


def quantized_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_dtype: str):
    """bf16 caches [S, Hkv, D] quantized as a kv_dtype cache stores them: (k, v, k_scale, v_scale)."""
    k_storage, v_storage = KV_STORAGE[kv_dtype]
    (k, ks), (v, vs) = attention.quantize_kv(k_cache, k_storage), attention.quantize_kv(v_cache, v_storage)
    return k, v, ks, vs


def fused_int8(d: int, hkv: int = 3) -> bool:
    """Whether int8 K/V take the vector passes in place (AVX-512 BF16, head_dim a multiple of 32 up to 128)."""
    return "avx512_bf16" in cpu_native._cpu_flags() and d % 32 == 0 and d <= 128 and hkv * d % 64 == 0


@needs_native
@pytest.mark.parametrize("kv_dtype", ["int8", "nvfp4", "k8v4"])
@pytest.mark.parametrize("hq,hkv,d,context", [(9, 3, 64, 1), (9, 3, 64, 300), (8, 2, 128, 129), (6, 2, 48, 40)])
def test_native_attention_over_quantized_kv_is_attention_over_its_values(kv_dtype, hq, hkv, d, context):
    """Over NVFP4 rows (nvfp4, V of k8v4), and int8 rows where the vector passes do not read them in place, the C
    attention computes exactly what it computes over a bf16 cache holding the rows' dequantized values (vector path
    at head_dim 64 / 128, the plain C path at 48). int8 K and V read in place (their integers exact in bf16, the
    scales folded into scores and softmax weights) come as close to the fp32 oracle over the dequantized values as
    the bf16 cache does. Pages in several runs."""
    pages = -(-context // 16)
    q, k_cache, v_cache, batch = bf16_problem([context], [[p + p // 3 for p in range(pages)]], 16, hq, hkv, d)
    k, v, ks, vs = quantized_caches(k_cache, v_cache, kv_dtype)
    as_bf16 = [attention.dequantize_kv(x, s, torch.bfloat16) for x, s in ((k, ks), (v, vs))]
    bf16_cache = cpu_native.decode_attention(q, *as_bf16, batch.page_table, batch.seq_lens, 16, d ** -0.5)
    got = cpu_native.decode_attention(q, k, v, batch.page_table, batch.seq_lens, 16, d ** -0.5, ks, vs)
    if kv_dtype != "int8" or not fused_int8(d, hkv):
        assert torch.equal(got, bf16_cache)
        return
    exact = [attention.dequantize_kv(x, s, torch.float32) for x, s in ((k, ks), (v, vs))]
    oracle = gathered_attention(q, *exact, batch, 16, d ** -0.5)
    torch.testing.assert_close(got, oracle, **attention_tolerance(d))
    assert (got - oracle).abs().mean() <= 1.5 * (bf16_cache - oracle).abs().mean() + 1e-6


@needs_native
def test_native_attention_over_quantized_kv_batch_of_several_sequences():
    contexts = [9, 700, 130]
    tables = [[0], list(range(10, 10 + 44)), [300, 302, 303, 305, 307, 309, 311, 313, 315]]
    q, k_cache, v_cache, batch = bf16_problem(contexts, tables, 16, 9, 3, 64)
    for kv_dtype in ("k8v4", "int8"):
        k, v, ks, vs = quantized_caches(k_cache, v_cache, kv_dtype)
        got = cpu_native.decode_attention(q, k, v, batch.page_table, batch.seq_lens, 16, 0.125, ks, vs)
        if kv_dtype == "k8v4" or not fused_int8(64):
            as_bf16 = [attention.dequantize_kv(x, s, torch.bfloat16) for x, s in ((k, ks), (v, vs))]
            assert torch.equal(got, cpu_native.decode_attention(q, *as_bf16, batch.page_table, batch.seq_lens, 16, 0.125))
        else:
            exact = [attention.dequantize_kv(x, s, torch.float32) for x, s in ((k, ks), (v, vs))]
            torch.testing.assert_close(got, gathered_attention(q, *exact, batch, 16, 0.125), **attention_tolerance(64))


@pytest.fixture
def amx_restored():
    """The AMX switch as the process had it, after a test that flips it."""
    yield
    cpu_native.set_amx(os.environ.get("NINFER_CPU_AMX", "1") != "0")


@needs_native
@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "k8v4"])
@pytest.mark.parametrize("hq,hkv,d,context", [(9, 3, 64, 300), (8, 2, 128, 129), (16, 2, 64, 1000), (3, 3, 64, 7)])
def test_tile_attention_computes_what_the_vector_passes_compute(kv_dtype, hq, hkv, d, context, amx_restored):
    """On a CPU with AMX the attention's chunks run on tiles: scores one tile product per 16 tokens (int8 K against
    q's bf16 values split into two int8 parts), values one per 32 tokens and 16 dims (int8 V against the softmax
    weights in 16-bit fixed point, two 8-bit parts; k8v4 through the bf16 scratch). They give what the AVX-512
    passes give, to rounding, and come as close to the fp32 oracle over the cache's values. Pages in several runs,
    a page table that is not in order, contexts across the 16-, 32- and 64-token tile blocks and the 128-token
    chunks."""
    if not cpu_native.set_amx(True):
        pytest.skip("this CPU has no AMX (or Linux refuses its tile state): only the AVX-512 passes run")
    pages = -(-context // 16)
    q, k_cache, v_cache, batch = bf16_problem([context], [[p + p // 3 for p in range(pages)]], 16, hq, hkv, d)
    if kv_dtype == "bf16":
        k, v, ks, vs = k_cache, v_cache, None, None
        exact = [k_cache.float(), v_cache.float()]
    else:
        k, v, ks, vs = quantized_caches(k_cache, v_cache, kv_dtype)
        exact = [attention.dequantize_kv(x, s, torch.float32) for x, s in ((k, ks), (v, vs))]
    scales = () if ks is None else (ks, vs)
    tiles = cpu_native.decode_attention(q, k, v, batch.page_table, batch.seq_lens, 16, d ** -0.5, *scales)
    assert not cpu_native.set_amx(False)
    vector = cpu_native.decode_attention(q, k, v, batch.page_table, batch.seq_lens, 16, d ** -0.5, *scales)
    oracle = gathered_attention(q, *exact, batch, 16, d ** -0.5)
    torch.testing.assert_close(tiles, vector, **attention_tolerance(d))
    torch.testing.assert_close(tiles, oracle, **attention_tolerance(d))
    assert (tiles - oracle).abs().mean() <= 1.5 * (vector - oracle).abs().mean() + 1e-6


@needs_native
@pytest.mark.parametrize("kv_dtype", ["int8", "nvfp4", "k8v4"])
def test_native_decode_step_with_quantized_kv_tracks_the_module_path(kv_dtype, monkeypatch):
    """serving.md, "Server options": --kv-dtype int8 | nvfp4 | k8v4 on the CPU's int8-weight step.
    With a quantized cache the C step runs (it writes the rows quantize_kv writes), and its greedy tokens and
    hidden states follow the module path's over the same kind of cache (head_dim 16: NVFP4 needs a multiple of 16);
    an fp8 cache keeps to the module path."""
    model = tiny_model("int8", head_dim=16)
    calls, real_run = [], NativeLlamaDecode.run
    monkeypatch.setattr(NativeLlamaDecode, "run", lambda self, *a: calls.append(1) or real_run(self, *a))
    prompts = [[(5 * i + 1) % 97 for i in range(30)], [(3 * i + 2) % 97 for i in range(9)]]
    tables = [list(range(0, 11)), [40, 41, 43, 44]]
    # 5 steps: at the sixth the second sequence's two best logits lie within 0.03 (a tie either path may break)
    got_tokens, got = greedy(model, prompts, tables, 5, True, torch.bfloat16, kv_dtype)
    assert len(calls) == 5
    want_tokens, want = greedy(model, prompts, tables, 5, False, torch.bfloat16, kv_dtype)
    assert got_tokens == want_tokens
    # the two paths' k and v differ in the last bits (fp32 inside C, bf16 after every torch op), so a few elements
    # round to neighbouring 4-bit codes (a step is up to a third of a block's amax): bound the mean and the worst
    for g, w in zip(got, want):
        assert (g - w).abs().mean() < 0.05 and (g - w).abs().max() < 0.5, ((g - w).abs().mean(), (g - w).abs().max())
    calls.clear()
    greedy(model, prompts, tables, 2, True, torch.bfloat16, "fp8")
    assert not calls


@needs_native
def test_long_contexts_decode_on_every_thread(monkeypatch):
    """The served replica decodes on decode_threads (one core fewer) until the batch's longest context reaches
    LONG_CONTEXT_TOKENS, then on torch's threads (every core); the step's result does not depend on its thread
    count (matmul rows and attention chunks are each one thread's, merged in a fixed order)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(cpu_native, "decode_threads", 1)
        assert cpu_native._threads(100) == 1 and cpu_native._threads(cpu_native.LONG_CONTEXT_TOKENS) == 2
        monkeypatch.setattr(cpu_native, "decode_threads", None)
        assert cpu_native._threads(10**6) == 2 and cpu_native._threads(0) == 2
        model = tiny_model("int8")
        prompts = [[(5 * i + 1) % 97 for i in range(30)], [(3 * i + 2) % 97 for i in range(9)]]
        tables = [list(range(0, 11)), [40, 41, 43, 44]]
        runs, seen, real_run = [], [], NativeLlamaDecode.run

        def counted(self, *args):
            out = real_run(self, *args)
            seen.append(self.struct.threads)
            return out

        monkeypatch.setattr(NativeLlamaDecode, "run", counted)
        monkeypatch.setattr(cpu_native, "decode_threads", 1)
        for long_context in (10**9, 0):  # decode_threads (1) for every step, then every step on torch's (2)
            monkeypatch.setattr(cpu_native, "LONG_CONTEXT_TOKENS", long_context)
            seen.clear()
            runs.append(greedy(model, prompts, tables, 6, True, torch.bfloat16))
            assert seen and set(seen) == {1 if long_context else 2}
        (tokens_1, states_1), (tokens_2, states_2) = runs
        assert tokens_1 == tokens_2 and all(torch.equal(a, b) for a, b in zip(states_1, states_2))
    finally:
        torch.set_num_threads(threads)


def test_native_step_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("NINFER_CPU_NATIVE", "0")
    cpu_native.library.cache_clear()
    try:
        assert cpu_native.library() is None
        assert tiny_model("int8").decode_plan().native is None
    finally:
        monkeypatch.delenv("NINFER_CPU_NATIVE")
        cpu_native.library.cache_clear()


def test_served_engine_decodes_on_one_core_fewer_and_prefills_on_all(monkeypatch, tiny_llama_path):
    """The Engine replica leaves a core to the router, proxy and Ray for decode steps from three cores (on two it
    decodes on both: bench/results/2026-12-05-cpu-s23/http_threads) where it does not time its steps; by default it
    times them on one core fewer and on all (s38) and decodes on the faster; NINFER_CPU_THREADS fixes the count.
    Prefill's torch ops take every core."""
    import os

    from ninfer.config import ServerConfig
    from ninfer.server.startup import engine_cpu_threads, load_engine_for

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    monkeypatch.delenv("NINFER_CPU_THREADS", raising=False)
    assert engine_cpu_threads() == 2
    monkeypatch.setenv("NINFER_CPU_THREADS", "1")
    assert engine_cpu_threads() == 1
    monkeypatch.setattr(cpu_native, "decode_threads", None)
    monkeypatch.setattr(cpu_native, "thread_chooser", None)
    threads = torch.get_num_threads()
    try:
        engine = load_engine_for(ServerConfig(artifact=str(tiny_llama_path), max_context=64))
        engine.shutdown()
        assert cpu_native.decode_threads == 1 and torch.get_num_threads() == 3
        assert cpu_native.thread_chooser is None  # NINFER_CPU_THREADS fixes the count
        monkeypatch.delenv("NINFER_CPU_THREADS")
        engine = load_engine_for(ServerConfig(artifact=str(tiny_llama_path), max_context=64))
        engine.shutdown()
        # unset, the replica times its steps on two threads and on three and keeps the faster (tests/test_cpu_threads.py)
        assert cpu_native.thread_chooser.candidates == (2, 3)
        assert cpu_native._threads(100) in (2, 3)
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert engine_cpu_threads() == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert engine_cpu_threads() == 1
