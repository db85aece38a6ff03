"""Prefill pieces (ninfer.engine.runner; on CUDA by default, NINFER_PREFILL_PIECES overrides): a prefill
shorter than the chunk and of at most MAX_PIECES binary digits is cut into power-of-two pieces, each of which can replay a CUDA graph of its size. Here, on CPU, the
cut itself: its sizes, that the pieces continue one sequence (pages, state slot, positions), and
that the logits match one forward of the whole prefill. The graphs against eager pieces: the CUDA
test in tests/test_graphs.py. serving.md, server options: `--prefill-chunk` (1024) is the
text-prefill chunk; `--no-cuda-graph` changes no output.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ninfer.artifact.presets import get_preset, instantiate
from ninfer.engine.runner import (
    LONG_PIECE,
    MAX_PIECES,
    MAX_PIECES_LONG,
    PIECES_ENV,
    ModelRunner,
    piece_sizes,
    split_tokens,
    takes_pieces,
)


def test_piece_sizes_are_the_powers_of_two_below_the_chunk():
    assert piece_sizes(16) == [8, 4, 2, 1]
    assert piece_sizes(1024) == [512, 256, 128, 64, 32, 16, 8, 4, 2, 1]
    assert piece_sizes(1000)[0] == 512 and piece_sizes(2) == [1] and piece_sizes(1) == []


@pytest.mark.parametrize("n", [1, 2, 3, 13, 15, 1000, 1023])
def test_a_prefill_splits_into_its_binary_digits(n):
    pieces = split_tokens(n, piece_sizes(1024))
    assert sum(pieces) == n and pieces == sorted(set(pieces), reverse=True)
    assert len(pieces) == bin(n).count("1")


def test_a_prefill_past_the_pieces_is_refused():
    with pytest.raises(ValueError):
        split_tokens(16, piece_sizes(16))  # a whole chunk is the chunk graph's, never pieces


@pytest.mark.parametrize(("n", "pieces"), [(100, True), (31, True), (496, True), (511, False), (63, False),
                                           (520, True), (768, True), (960, False), (1000, False), (1, False),
                                           (1024, False), (1023, False)])
def test_many_pieces_run_as_one_forward(n, pieces):
    """A piece reads every weight once: more than MAX_PIECES of them cost more than one eager forward,
    and from LONG_PIECE tokens (a compute-bound piece) more than MAX_PIECES_LONG."""
    assert (MAX_PIECES, LONG_PIECE, MAX_PIECES_LONG) == (5, 512, 2)
    assert takes_pieces(n, 1024) is pieces


def _runner(model, vocab: int, pieces: bool, chunk: int = 16) -> ModelRunner:
    return ModelRunner(model, num_pages=32, page_size=4, num_state_slots=2, num_lanes=1, vocab_size=vocab,
                       device=torch.device("cpu"), dtype=torch.float32, prefill_chunk=chunk, prefill_pieces=pieces)


def _prefill(runner: ModelRunner, prompt: list[int]) -> list[torch.Tensor]:
    """Logits after each engine chunk (16 tokens) of `prompt`, then after one decode step."""
    seq = SimpleNamespace(num_computed=0, pages=list(range(2, 2 + -(-(len(prompt) + 1) // 4))), state_slot=1, lane=0)
    out = []
    for i in range(0, len(prompt), 16):
        part = prompt[i:i + 16]
        out.append(runner.forward([seq], [part]).clone())
        seq.num_computed += len(part)
    out.append(runner.forward([seq], [[7]]).clone())  # the next token reads the cache the pieces wrote
    return out


def test_pieces_compute_what_one_forward_computes():
    """16 + 13 tokens: a whole chunk, then pieces of 8, 4 and 1 (the last one a decode step)."""
    name = "tiny-qwen3.6"  # hybrid: the pieces carry the recurrent and conv states as well as the KV
    vocab = get_preset(name).text_config()["vocab_size"]
    model = instantiate(name, "cpu", torch.float32, seed=0)
    prompt = [(37 * i + 11) % (vocab - 10) + 5 for i in range(29)]
    cut, whole = _runner(model, vocab, True), _runner(model, vocab, False)
    assert cut.prefill_pieces == [8, 4, 2, 1] and whole.prefill_pieces == []
    ours, theirs = _prefill(cut, prompt), _prefill(whole, prompt)
    assert cut.eager_steps == 1 + 3 + 1 and whole.eager_steps == 1 + 1 + 1
    for got, want in zip(ours, theirs):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # chunked fp32 sums in another order
    assert ours[1].argmax(-1).tolist() == theirs[1].argmax(-1).tolist()


def test_a_prefill_of_six_pieces_is_one_forward():
    """63 tokens (chunk 64) would be six pieces: one eager forward instead, with the same logits."""
    name = "tiny-qwen3.6"
    vocab = get_preset(name).text_config()["vocab_size"]
    model = instantiate(name, "cpu", torch.float32, seed=0)
    runner = _runner(model, vocab, True, chunk=64)
    seq = SimpleNamespace(num_computed=0, pages=list(range(2, 18)), state_slot=1, lane=0)
    prompt = [(11 * i + 3) % (vocab - 10) + 5 for i in range(63)]
    runner.forward([seq], [prompt])
    assert runner.eager_steps == 1
    seq.num_computed, runner.eager_steps = 0, 0
    runner.forward([seq], [prompt[:62]])  # 32 + 16 + 8 + 4 + 2: five pieces
    assert runner.eager_steps == 5


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
