"""Prefill pieces (ninfer.engine.runner; on CUDA by default, NINFER_PREFILL_PIECES overrides): a prefill
shorter than the chunk runs as the forwards `prefill_plan` picks (power-of-two pieces and the chunk,
the last one padded), each of which can replay a CUDA graph of its size. Here, on CPU: the plans, that
the pieces continue one sequence (pages, state slot, positions), that padding writes no KV and leaves
the recurrent state alone, and that the logits match one forward of the whole prefill. The graphs
against eager pieces: the CUDA tests in tests/test_graphs.py. serving.md, server options:
`--prefill-chunk` (1024) is the text-prefill chunk; `--no-cuda-graph` changes no output.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kernel_markers import HAS_CUDA, INTERPRET

from ninfer.artifact.presets import get_preset, instantiate
from ninfer.engine.runner import (
    KNEE_MOE,
    KNEE_NVFP4,
    PIECE_KNEE,
    PIECES_ENV,
    REPLAY_COST,
    ModelRunner,
    PieceCosts,
    piece_costs,
    piece_sizes,
    prefill_plan,
)
from ninfer.forward import ForwardBatch
from ninfer.kernels.attention import write_kv


def test_piece_sizes_are_the_powers_of_two_below_the_chunk():
    assert piece_sizes(16) == [8, 4, 2, 1]
    assert piece_sizes(1024) == [512, 256, 128, 64, 32, 16, 8, 4, 2, 1]
    assert piece_sizes(1000)[0] == 512 and piece_sizes(2) == [1] and piece_sizes(1) == []


@pytest.mark.parametrize(("n", "plan"), [
    (1, [1]), (2, [2]), (3, [4]), (100, [128]), (129, [256]), (300, [256, 64]), (520, [512, 8]),
    (600, [512, 128]), (768, [512, 256]), (960, [1024]), (1023, [1024]), (1024, [1024]),
])
def test_the_plan_of_a_short_prefill(n, plan):
    """Up to PIECE_KNEE tokens a forward costs one read of the weights: a short prompt is one padded
    forward; a compute-bound piece is not padded to twice its work (520 = 512 + 8, not 1024)."""
    assert (PIECE_KNEE, REPLAY_COST) == (128, 16)
    assert prefill_plan(n, piece_sizes(1024), 1024) == plan


@pytest.mark.parametrize(("n", "plan"), [(100, [128]), (300, [512]), (520, [1024]), (700, [1024]), (3, [4])])
def test_a_moe_model_pads_to_one_forward(n, plan):
    """Knee 1024 (a MoE model): every forward up to the chunk costs about the same, so one padded forward."""
    assert prefill_plan(n, piece_sizes(1024), 1024, PieceCosts(KNEE_MOE)) == plan


@pytest.mark.parametrize(("n", "plan"), [(100, [128]), (300, [512]), (520, [512, 8]), (540, [1024]),
                                         (700, [1024]), (12, [8, 4]), (6, [8])])
def test_an_nvfp4_model_pads_to_few_forwards(n, plan):
    """Knee 512, but forwards of up to 8 tokens take the NVFP4 GEMV (no dequantized weights): 520 tokens
    run as 512 + 8 (540 as 512 + 16 + 16 took 121 ms on the H200 against 103-108 for 1024)."""
    assert prefill_plan(n, piece_sizes(1024), 1024, PieceCosts(KNEE_NVFP4, 8)) == plan


def test_the_costs_of_each_kind_of_model():
    from ninfer.kernels.triton_nvfp4 import HFMA_MAX_M
    from ninfer.quant.nvfp4 import quantize_model_

    dense = instantiate("tiny-qwen3.6", "cpu", torch.float32, seed=0, fuse=False)
    assert piece_costs(dense) == PieceCosts(PIECE_KNEE) and PIECE_KNEE == 128
    assert piece_costs(instantiate("tiny-qwen3.6-moe", "cpu", torch.float32, seed=0)) == PieceCosts(KNEE_MOE)
    quantize_model_(dense)
    assert piece_costs(dense) == PieceCosts(KNEE_NVFP4, HFMA_MAX_M) and HFMA_MAX_M == 8 and (KNEE_NVFP4, KNEE_MOE) == (512, 1024)


@pytest.mark.parametrize("costs", [PieceCosts(), PieceCosts(KNEE_NVFP4, 8), PieceCosts(KNEE_MOE)])
@pytest.mark.parametrize("chunk", [16, 1000, 1024])
def test_every_plan_covers_its_tokens_and_beats_the_simple_ones(chunk, costs):
    sizes = piece_sizes(chunk)
    for n in range(1, chunk + 1):
        plan = prefill_plan(n, sizes, chunk, costs)
        assert all(s in sizes or s == chunk for s in plan), (n, plan)
        assert sum(plan[:-1]) < n <= sum(plan), (n, plan)  # only the last forward is padded
        binary = [s for s in sizes if n & s] if n < chunk else [chunk]
        one = min(s for s in [*sizes, chunk] if s >= n)
        total = sum(map(costs.cost, plan))
        assert total <= min(sum(map(costs.cost, binary)), costs.cost(one)), (n, plan)


def test_a_plan_needs_a_prefill_within_the_chunk():
    for n in (0, 17):
        with pytest.raises(ValueError):
            prefill_plan(n, piece_sizes(16), 16)


def test_a_padded_batch():
    """Padding: token 0 at the following positions, KV slot -1, page-table entries for its positions,
    the sequence length of the padded forward, logits of the last real token."""
    batch = ForwardBatch.build(tokens=[[5, 6, 7]], cached_lens=[3], page_tables=[[9, 4]], page_size=4,
                               state_slots=[1], pad_to=8)
    assert batch.input_ids.tolist() == [5, 6, 7, 0, 0, 0, 0, 0]
    assert batch.positions.tolist() == list(range(3, 11))
    assert batch.slot_mapping.tolist() == [39, 16, 17, -1, -1, -1, -1, -1]
    assert batch.page_table.tolist() == [[9, 4, 0]] and batch.seq_lens.tolist() == [11]
    assert batch.num_valid.tolist() == [3] and batch.last_token_indices().tolist() == [2]
    with pytest.raises(ValueError):
        ForwardBatch.build(tokens=[[1, 2], [3]], cached_lens=[0, 0], page_tables=[[0], [1]], page_size=4, pad_to=4)


@pytest.mark.parametrize("storage", [torch.float32, torch.float8_e4m3fn, torch.int8])
def test_padding_writes_no_kv(storage):
    k_cache = torch.full((8, 2, 4), 3.0).to(storage)
    v_cache = k_cache.clone()
    scales = (torch.ones(8, 2), torch.ones(8, 2)) if storage != torch.float32 else (None, None)
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    write_kv(k_cache, v_cache, k, v, torch.tensor([5, -1, 2]), *scales)
    untouched = [i for i in range(8) if i not in (5, 2)]
    assert torch.equal(k_cache[untouched].float(), torch.full((6, 2, 4), 3.0))
    assert not torch.equal(k_cache[5].float(), torch.full((2, 4), 3.0))
    if scales[0] is not None:
        assert torch.equal(scales[0][untouched], torch.ones(6, 2)) and not torch.equal(scales[0][2], torch.ones(2))


def _runner(model, vocab: int, pieces: bool, chunk: int = 16, pages: int = 32) -> ModelRunner:
    return ModelRunner(model, num_pages=pages, page_size=4, num_state_slots=2, num_lanes=1, vocab_size=vocab,
                       device=torch.device("cpu"), dtype=torch.float32, prefill_chunk=chunk, prefill_pieces=pieces)


def _prefill(runner: ModelRunner, prompt: list[int], chunk: int) -> list[torch.Tensor]:
    """Logits after each engine chunk of `prompt`, then after one decode step. Pages from 2 on: pages
    0 and 1 are nobody's (padding positions past the sequence's pages map to page 0)."""
    seq = SimpleNamespace(num_computed=0, pages=list(range(2, 2 + -(-(len(prompt) + 1) // 4))), state_slot=1, lane=0)
    out = []
    for i in range(0, len(prompt), chunk):
        part = prompt[i:i + chunk]
        out.append(runner.forward([seq], [part]).clone())
        seq.num_computed += len(part)
    out.append(runner.forward([seq], [[7]]).clone())  # the next token reads the cache the pieces wrote
    return out


@pytest.mark.parametrize(("chunk", "length", "forwards"), [
    (16, 29, 1 + 1),  # a whole chunk, then 13 tokens padded to the chunk's 16
    (1024, 600, 2),  # 512, then 88 tokens padded to 128
    (1024, 520, 2),  # 512 + 8, no padding
])
def test_pieces_compute_what_one_forward_computes(chunk, length, forwards):
    name = "tiny-qwen3.6"  # hybrid: the pieces carry the recurrent and conv states as well as the KV
    vocab = get_preset(name).text_config()["vocab_size"]
    model = instantiate(name, "cpu", torch.float32, seed=0)
    prompt = [(37 * i + 11) % (vocab - 10) + 5 for i in range(length)]
    pages = 2 + -(-(length + 1) // 4)
    cut, whole = _runner(model, vocab, True, chunk, pages), _runner(model, vocab, False, chunk, pages)
    assert cut.prefill_pieces == piece_sizes(chunk) and whole.prefill_pieces == []
    ours, theirs = _prefill(cut, prompt, chunk), _prefill(whole, prompt, chunk)
    assert cut.eager_steps == forwards + 1 and whole.eager_steps == -(-length // chunk) + 1
    for got, want in zip(ours, theirs):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # chunked fp32 sums in another order
    assert ours[-1].argmax(-1).tolist() == theirs[-1].argmax(-1).tolist()
    # the padding wrote no KV (pages 0 and 1 are still zero) and the states match the unpadded run's
    assert not cut.cache.k[:, :8].any() and not cut.cache.v[:, :8].any()
    torch.testing.assert_close(cut.cache.conv[:, 1], whole.cache.conv[:, 1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cut.cache.ssm[:, 1], whole.cache.ssm[:, 1], rtol=1e-4, atol=1e-5)


def test_pieces_are_off_on_cpu_unless_asked(monkeypatch):
    """On CPU there are no graphs for pieces to replay; NINFER_PREFILL_PIECES=1 / 0 turns them on / off
    (on CUDA they are on by default: ModelRunner's docstring)."""
    name = "tiny-qwen3.6"
    vocab = get_preset(name).text_config()["vocab_size"]
    model = instantiate(name, "cpu", torch.float32, seed=0)
    monkeypatch.delenv(PIECES_ENV, raising=False)
    assert _runner(model, vocab, None).prefill_pieces == []
    monkeypatch.setenv(PIECES_ENV, "1")
    assert _runner(model, vocab, None).prefill_pieces == [8, 4, 2, 1]
    monkeypatch.setenv(PIECES_ENV, "0")
    assert _runner(model, vocab, None).prefill_pieces == []


@pytest.mark.skipif(not (HAS_CUDA or INTERPRET), reason="the Triton kernels need CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("storage", [torch.float32, torch.float8_e4m3fn, torch.int8])
def test_triton_kv_writes_skip_padding(storage):
    """The Triton KV writes (fused RoPE + write into a 16/32-bit cache; quantizing write into fp8/int8)
    store nothing for slot -1: each cache is a view one row into a larger tensor, so a write at -1
    would land in that guard row."""
    from ninfer.kernels import triton_attention, triton_fused

    device = "cuda" if HAS_CUDA else "cpu"
    g = torch.Generator().manual_seed(3)
    rows = [torch.full((9, 2, 32), 3.0).to(storage).to(device) for _ in range(2)]  # row 0: the guard
    scale_rows = [torch.ones(9, 2, device=device) for _ in range(2)]
    caches, scales = [r[1:] for r in rows], [s[1:] for s in scale_rows]
    before = [r.float().clone() for r in rows]
    q, k, v = (torch.randn(3, h, 32, generator=g).to(device) for h in (4, 2, 2))
    slots = torch.tensor([5, -1, 2], device=device)
    if storage == torch.float32:
        cos, sin = torch.ones(3, 32, device=device), torch.zeros(3, 32, device=device)
        triton_fused.rope_qk_write_kv(q, k, v, cos, sin, *caches, slots)
    else:
        triton_attention.write_kv_quantized(*caches, *scales, k, v, slots)
    for r, b in zip(rows, before):
        changed = [i for i in range(9) if not torch.equal(r[i].float(), b[i])]
        assert changed == [1 + 2, 1 + 5], changed  # slots 2 and 5 only: not the guard (slot -1)
    for s in scale_rows:
        assert torch.equal(s[0], torch.ones(2, device=device))
