"""The runner's sampling entry point: an all-greedy batch without penalties takes a plain argmax,
which must be exactly the sampler's greedy answer; anything else goes through the full sampler
(serving.md, sampling: temperature 0 is greedy; presence/frequency penalties apply to greedy too)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ninfer.engine.runner import ModelRunner
from ninfer.engine.sampler import sample

VOCAB = 300


class _NoModel(torch.nn.Module):
    def cache_spec(self):
        from ninfer.forward import CacheSpec

        return CacheSpec(num_attn_layers=0, num_kv_heads=1, head_dim=1)


def _runner() -> ModelRunner:
    return ModelRunner(_NoModel(), num_pages=1, page_size=16, num_state_slots=0, num_lanes=4, vocab_size=VOCAB,
                       device=torch.device("cpu"), dtype=torch.float32)


def _seq(lane: int, temperature: float = 0.0, presence: float = 0.0, frequency: float = 0.0):
    params = SimpleNamespace(temperature=temperature, top_p=1.0, top_k=0, min_p=0.0, presence_penalty=presence,
                             frequency_penalty=frequency, seed=7 + lane)
    return SimpleNamespace(sampling=params, lane=lane, output_ids=[1, 2])


def _full_sampler(runner: ModelRunner, seqs, logits: torch.Tensor) -> torch.Tensor:
    return sample(logits[:, :VOCAB], *runner.sampling_inputs(seqs, VOCAB))


def test_all_greedy_batch_matches_the_sampler_exactly():
    runner = _runner()
    gen = torch.Generator().manual_seed(0)
    seqs = [_seq(i) for i in range(4)]
    for _ in range(20):
        # padded vocabulary (rows past the tokenizer are ignored) and ties at the top
        logits = torch.randn(4, VOCAB + 20, generator=gen).round(decimals=1)
        logits[:, VOCAB:] = 100.0
        got = runner.sample(seqs, logits)
        assert torch.equal(got, _full_sampler(runner, seqs, logits))
        assert torch.equal(got, logits[:, :VOCAB].argmax(-1))


def test_penalties_and_sampled_rows_take_the_full_sampler():
    runner = _runner()
    runner.count_tokens([0, 0, 0], [5, 5, 5])  # lane 0 produced token 5 three times
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 1.0
    logits[:, 9] = 0.5
    greedy_penalised = [_seq(0, presence=1.0), _seq(1)]
    assert runner.sample(greedy_penalised, logits).tolist() == [9, 5]  # the penalty moves lane 0 off token 5
    mixed = [_seq(0, temperature=0.8), _seq(1)]
    got = runner.sample(mixed, logits)
    assert torch.equal(got, _full_sampler(runner, mixed, logits)) and got[1].item() == 5


def test_seeds_outside_int64_wrap_instead_of_failing_the_step():
    """The protocol rejects such seeds (test_server_validation); any other caller's seed still becomes a
    valid int64 tensor value instead of an overflow inside the engine's step."""
    from ninfer.engine.engine import EngineSettings, resolve_sampling
    from ninfer.engine.types import EngineRequest, SamplingParams

    for given, want in ((2**64 + 5, 5), (-(2**63) - 1, 2**63 - 1), (-7, -7)):
        request = EngineRequest("r", [1, 2], max_tokens=1, sampling=SamplingParams(seed=given))
        assert resolve_sampling(EngineSettings(), request).seed == want
