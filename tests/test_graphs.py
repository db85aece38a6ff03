"""CUDA graphs' static inputs (CPU) and the prefill graph against the eager forward (CUDA).

serving.md, server options: `--no-cuda-graph` turns the graphs off; `--prefill-chunk` (1024) is the
text-prefill chunk a long prompt is cut into. A graph must compute exactly what the eager forward
computes: on CPU the host fills of the graphs' input buffers are checked against the eager batch
(`ForwardBatch.build`), on CUDA the replayed chunks' logits against eager ones, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from kernel_markers import needs_cuda

from ninfer.engine.graphs import DecodeInputs, PrefillInputs, SamplerInputs
from ninfer.forward import ForwardBatch

PAGE = 4
FIELDS = ("input_ids", "positions", "query_start_loc", "seq_lens", "slot_mapping", "state_slots")


def _assert_same_batch(ours: ForwardBatch, eager: ForwardBatch, pages: list[list[int]]) -> None:
    for name in FIELDS:
        assert getattr(ours, name).tolist() == getattr(eager, name).tolist(), name
    for row, seq_pages in enumerate(pages):  # entries past a sequence's pages are never read
        assert ours.page_table[row, : len(seq_pages)].tolist() == seq_pages
    assert ours.query_lens_cpu == eager.query_lens_cpu
    with pytest.raises(RuntimeError, match="no host sequence lengths"):
        ours.seq_lens_cpu[0]


def test_prefill_inputs_match_the_eager_batch():
    inputs = PrefillInputs(tokens=10, width=8, device=torch.device("cpu"))
    # two chunks in a row: the fills alternate between the two host images
    for start, pages, slot in ((0, [5, 2, 7], 3), (10, [5, 2, 7, 0, 6, 1], 1)):
        tokens = [100 + 3 * i + start for i in range(10)]
        inputs.fill(tokens, start, pages, slot, PAGE)
        eager = ForwardBatch.build([tokens], [start], [pages], PAGE, state_slots=[slot])
        _assert_same_batch(inputs.batch(), eager, [pages])


def test_padded_prefill_inputs_match_the_eager_batch():
    """A prefill graph of 10 tokens taking 4 (ForwardBatch.num_valid): the padding as the eager padded
    batch has it, after a full fill (the host images keep nothing of it)."""
    inputs = PrefillInputs(tokens=10, width=8, device=torch.device("cpu"))
    for tokens, start, pages in (([1] * 10, 0, [5, 2, 7]), ([9, 8, 7, 6], 10, [5, 2, 7, 0]),
                                 ([4] * 10, 0, [1, 2, 3]), ([3, 2], 20, [1, 2, 3, 4, 5, 0])):
        inputs.fill(tokens, start, pages, 2, PAGE)
        eager = ForwardBatch.build([tokens], [start], [pages], PAGE, state_slots=[2], pad_to=10)
        ours = inputs.batch()
        padded_pages = eager.page_table[0].tolist()
        _assert_same_batch(ours, eager, [padded_pages])
        assert ours.num_valid.tolist() == eager.num_valid.tolist() == [len(tokens)]
        assert ours.last_token_indices().tolist() == [len(tokens) - 1]
    assert not inputs.fits(31, [1] * 8, PAGE) and inputs.fits(22, [1] * 8, PAGE)


def test_decode_inputs_match_the_eager_batch():
    from types import SimpleNamespace

    inputs = DecodeInputs(max_batch=4, width=6, device=torch.device("cpu"))
    seqs = [SimpleNamespace(num_computed=n, pages=p, state_slot=s)
            for n, p, s in ((0, [3], 0), (9, [1, 4, 2], 5), (4, [0, 7], None))]
    for step in range(2):
        toks = [[11 + step], [12 + step], [13 + step]]
        inputs.fill(seqs, toks, PAGE)
        eager = ForwardBatch.build(toks, [s.num_computed for s in seqs], [s.pages for s in seqs], PAGE,
                                   state_slots=[s.state_slot or 0 for s in seqs])
        _assert_same_batch(inputs.batch(3), eager, [s.pages for s in seqs])
        for s in seqs:
            s.num_computed += 1


def _sampled_seqs(n: int) -> list:
    """n sequences with different sampler settings per row (greedy and penalised rows among them)."""
    from types import SimpleNamespace

    seqs = []
    for i in range(n):
        params = SimpleNamespace(temperature=[0.7, 0.0, 1.3][i % 3], top_p=[0.9, 1.0, 0.5][i % 3],
                                 top_k=[0, 20, 5, 40][i % 4], min_p=0.05 * (i % 2), presence_penalty=0.3 * (i % 2),
                                 frequency_penalty=0.1 * (i % 3), seed=(2**62 + 977 * i) * (-1) ** i)
        seqs.append(SimpleNamespace(sampling=params, lane=n - 1 - i, output_ids=list(range(i))))
    return seqs


def test_sampler_inputs_match_the_eager_sampling_batch():
    from ninfer.engine.runner import ModelRunner

    inputs = SamplerInputs(max_batch=8, device=torch.device("cpu"))
    for n in (3, 8, 1):  # fills alternate between the host images; shorter batches leave stale columns
        seqs = _sampled_seqs(n)
        rows_f, rows_l = ModelRunner._sampling_rows(seqs)
        inputs.fill(*rows_l, rows_f)
        ours, lanes = inputs.batch(n)
        assert lanes.tolist() == [s.lane for s in seqs]
        for name, values in zip(("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"), rows_f):
            assert torch.equal(getattr(ours, name), torch.tensor(values, dtype=torch.float32)), name
        for name, values in zip(("top_k", "seed", "step"), rows_l):
            assert getattr(ours, name).tolist() == values, name
        assert ours.top_k.tolist() == [[20, 20, 5, 20][i % 4] for i in range(n)]  # 0 and past the cap: 20


# ---- CUDA ---------------------------------------------------------------------------------------


def _prefill_logits(model, runner_kwargs: dict, prompt: list[int], chunk: int) -> tuple[list[torch.Tensor], object]:
    """Logits after each chunk of `prompt` (one sequence), and the runner."""
    from types import SimpleNamespace

    from ninfer.engine.runner import ModelRunner

    runner = ModelRunner(model, prefill_chunk=chunk, **runner_kwargs)
    seq = SimpleNamespace(num_computed=0, pages=list(range(3, 3 + -(-len(prompt) // 16))), state_slot=1, lane=0)
    out = []
    for i in range(0, len(prompt), chunk):
        part = prompt[i:i + chunk]
        out.append(runner.forward([seq], [part]).clone())
        seq.num_computed += len(part)
    return out, runner


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("name,kv_dtype", [("tiny-qwen3.6", "bf16"), ("tiny-qwen3.6", "fp8"),
                                           ("tiny-qwen3.6-moe", "bf16")])
def test_prefill_graph_logits_equal_eager(name, kv_dtype):
    """Chunks of 64 tokens, the second and later continuing from cached KV and recurrent state; the
    last chunk is shorter and runs eagerly in both runners (prefill pieces off: the next test's)."""
    from ninfer.artifact.presets import get_preset, instantiate
    from ninfer.kernels import backend

    if not backend.triton_available():
        pytest.skip("graphs need the Triton backend")
    model = instantiate(name, "cuda", torch.bfloat16, seed=0)
    vocab = get_preset(name).text_config()["vocab_size"]
    prompt = [(37 * i + 11) % (vocab - 10) + 5 for i in range(64 * 3 + 21)]
    kwargs = dict(num_pages=64, page_size=16, num_state_slots=4, num_lanes=2, vocab_size=vocab,
                  device=torch.device("cuda"), dtype=torch.bfloat16, max_seq_len=512, kv_dtype=kv_dtype,
                  prefill_pieces=False)
    graphs, runner = _prefill_logits(model, kwargs | {"cuda_graphs": True}, prompt, 64)
    eager, off = _prefill_logits(model, kwargs | {"cuda_graphs": False}, prompt, 64)
    if name.endswith("moe") and runner.prefill_graph is None:
        # a MoE prefill that cannot be captured must say why and still run (eagerly)
        assert "prefill off: capture failed" in runner.graph_status, runner.graph_status
    else:
        assert "prefill chunk of 64 tokens" in runner.graph_status, runner.graph_status
        assert runner.prefill_replays == 3 and off.prefill_replays == 0
    for g, e in zip(graphs, eager):
        assert torch.equal(g, e)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("name,kv_dtype", [("tiny-qwen3.6", "bf16"), ("tiny-qwen3.6", "fp8"),
                                           ("tiny-qwen3.6-moe", "bf16")])
def test_prefill_piece_graphs_equal_eager_pieces(name, kv_dtype):
    """NINFER_PREFILL_PIECES, chunk 1024: prompts of 1624 tokens (the chunk's graph, then 512 and 88
    padded to 128; MoE: 600 padded to 1024), 100 (padded to 128) and 520 (512 + 8; MoE: padded to
    1024) replay the graphs of their plans; the same
    plans run eagerly give the same logits, bit for bit; and they stay close to the prompts' unpadded
    eager prefill (tests/test_prefill_pieces.py checks the plans and the padding on CPU)."""
    from types import SimpleNamespace

    from ninfer.artifact.presets import get_preset, instantiate
    from ninfer.engine.runner import ModelRunner, piece_sizes, prefill_plan
    from ninfer.kernels import backend

    if not backend.triton_available():
        pytest.skip("graphs need the Triton backend")
    model = instantiate(name, "cuda", torch.bfloat16, seed=0)
    vocab = get_preset(name).text_config()["vocab_size"]
    kwargs = dict(num_pages=256, page_size=16, num_state_slots=4, num_lanes=2, vocab_size=vocab,
                  device=torch.device("cuda"), dtype=torch.bfloat16, max_seq_len=2048, kv_dtype=kv_dtype,
                  prefill_chunk=1024)
    runners = {"graphs": ModelRunner(model, prefill_pieces=True, **kwargs),
               "eager": ModelRunner(model, prefill_pieces=True, cuda_graphs=False, **kwargs),
               "unpadded": ModelRunner(model, prefill_pieces=False, cuda_graphs=False, **kwargs)}
    assert "prefill pieces of 2..512 tokens" in runners["graphs"].graph_status, runners["graphs"].graph_status
    logits = {key: [] for key in runners}
    for n, length in enumerate((1624, 100, 520)):
        prompt = [(37 * i + 11 * n) % (vocab - 10) + 5 for i in range(length)]
        for key, runner in runners.items():
            seq = SimpleNamespace(num_computed=0, pages=list(range(3 + 110 * n, 3 + 110 * n + -(-length // 16) + 1)),
                                  state_slot=1 + n, lane=0)
            for i in range(0, length, 1024):
                part = prompt[i:i + 1024]
                logits[key].append(runner.forward([seq], [part]).clone())
                seq.num_computed += len(part)
            logits[key].append(runner.forward([seq], [[7]]).clone())  # reads the cache the pieces wrote
    costs = runners["graphs"].piece_costs  # MoE: knee 1024, every plan one padded forward
    plans = [prefill_plan(n, piece_sizes(1024), 1024, costs) for n in (600, 100, 520)]
    assert plans == ([[512, 128], [128], [512, 8]] if costs.knee == 128 else [[1024], [128], [1024]])
    forwards = 1 + sum(len(p) for p in plans)  # the whole first chunk, then the plans
    assert runners["graphs"].prefill_replays == forwards, runners["graphs"].graph_status
    assert runners["eager"].eager_steps == forwards + 3 and runners["eager"].prefill_replays == 0
    for g, e in zip(logits["graphs"], logits["eager"]):
        assert torch.equal(g, e)
    for g, u in zip(logits["graphs"], logits["unpadded"]):  # other GEMM shapes: bf16 rounding apart
        torch.testing.assert_close(g, u, rtol=0.05, atol=0.05)


@pytest.mark.cuda
@needs_cuda
def test_sampler_graphs_draw_the_eager_samplers_tokens():
    """For every batch size, the sampler replayed over the decode graph's logits equals the same sampler
    run eagerly on the same logits (mixed greedy, sampled and penalised rows); the fused sampler is
    the one in use on the GPU (its start-up check passed)."""
    from ninfer.artifact.presets import get_preset, instantiate
    from ninfer.engine.runner import ModelRunner
    from ninfer.kernels import backend

    if not backend.triton_available():
        pytest.skip("graphs need the Triton backend")
    vocab = get_preset("tiny-qwen3.6").text_config()["vocab_size"]
    model = instantiate("tiny-qwen3.6", "cuda", torch.bfloat16, seed=0)
    runner = ModelRunner(model, num_pages=64, page_size=16, num_state_slots=8, num_lanes=8, vocab_size=vocab,
                         device=torch.device("cuda"), dtype=torch.bfloat16, max_seq_len=256)
    assert "sampling in graphs" in runner.graph_status, runner.graph_status
    assert runner.fused_sampler, runner.sampler_status
    runner.count_tokens([0, 0, 3, 5], [7, 7, 9, 11])
    gen = torch.Generator(device="cuda").manual_seed(0)
    for b in (8, 3, 1, 5):
        seqs = _sampled_seqs(b)
        static = runner.graphs[(b, 1)].logits
        for _ in range(3):
            with torch.inference_mode():  # the graph's output is an inference tensor
                static.copy_(torch.randn(static.shape, generator=gen, device="cuda") * 3)
            eager = runner.sample(seqs, static.clone(), graphs=False)  # same sampler (fused or torch), no graph
            replays = runner.sampler_replays
            got = runner.sample(seqs, static)
            assert runner.sampler_replays == replays + 1
            assert torch.equal(got, eager), (b, got.tolist(), eager.tolist())
            for s in seqs:
                s.output_ids.append(0)  # the next output index: other noise


def test_piecewise_capture_cuts_between_layers():
    """NINFER_GRAPH_PIECES=1 (ninfer.engine.graphs.PieceGraphs): decode and verify graphs are captured in pieces,
    cut after the layers graph_cut_layers names; the model calls the cut there and computes what it computes
    uncut."""
    from ninfer.artifact.presets import instantiate
    from ninfer.engine.runner import graph_cut_layers
    from ninfer.forward import ModelCache

    assert graph_cut_layers(64) == {3, 15, 39}  # pieces of 4, 12, 24 and 24 layers
    assert graph_cut_layers(4) == {0, 1} and graph_cut_layers(1) == frozenset()
    model = instantiate("tiny-qwen3.6", "cpu", torch.float32, seed=0)
    cache = ModelCache(model.cache_spec(), 8, PAGE, 2, torch.float32, "cpu")
    batch = ForwardBatch.build([[5, 9, 3], [7]], [0, 0], [[0], [1]], PAGE, state_slots=[0, 1])
    with torch.inference_mode():
        whole = model(batch, cache)
        cuts = []
        model.graph_cuts, model.graph_cut = graph_cut_layers(len(model.layers)), lambda: cuts.append(1)
        batch.derived.clear()
        pieces = model(batch, cache)
        model.graph_cuts, model.graph_cut = frozenset(), None
    assert len(cuts) == len(graph_cut_layers(len(model.layers))) > 0
    assert torch.equal(whole, pieces)


@pytest.mark.cuda
@needs_cuda
def test_piecewise_graphs_greedy_equals_eager(monkeypatch):
    """Decode graphs captured in pieces replay what the eager forward computes (greedy output, 8 lanes)."""
    from test_kernels import greedy_with_and_without_graphs

    graphs, eager = greedy_with_and_without_graphs(monkeypatch, "NINFER_GRAPH_PIECES")
    assert "pieces each" in graphs["graph_status"] and graphs["graph_replays"] > 0, graphs
    assert graphs["outputs"] == eager["outputs"]
