"""The fused Triton sampler against the torch sampler (ninfer.engine.sampler), under Triton's CPU
interpreter: same tokens for mixed greedy, sampled and penalised rows, ties broken to the lowest id as
torch.argmax does, vocabularies smaller than the top-k cap, and the runner's start-up check.

serving.md, sampling: temperature 0 is exact argmax; top_k 0..20 (0 selects the cap); presence and
frequency penalties apply to the request's generated tokens; a seed makes sampling reproducible.
"""

from __future__ import annotations

import pytest
import torch
from kernel_markers import needs_cuda, needs_interpreter

from ninfer.engine.sampler import SamplingBatch, sample


def _random_batch(gen: torch.Generator, rows: int) -> SamplingBatch:
    temperature = torch.rand(rows, generator=gen) * 1.5
    temperature[::3] = 0.0  # greedy rows among sampled ones
    return SamplingBatch(
        temperature=temperature, top_p=torch.rand(rows, generator=gen) * 0.9 + 0.1,
        top_k=torch.randint(1, 21, (rows,), generator=gen), min_p=torch.rand(rows, generator=gen) * 0.2,
        presence_penalty=torch.rand(rows, generator=gen) * 2 - 0.5,
        frequency_penalty=torch.rand(rows, generator=gen) * 0.5, seed=torch.randint(-2**62, 2**62, (rows,), generator=gen),
        step=torch.randint(0, 2**34, (rows,), generator=gen))


@needs_interpreter
@pytest.mark.parametrize("width,chunk", [(300, 64), (12, 32)])  # several chunks; fewer tokens than the cap
def test_fused_sampler_draws_the_torch_samplers_tokens(width, chunk):
    from ninfer.kernels.triton_sampler import fused_sample

    gen = torch.Generator().manual_seed(width)
    rows, lanes_total = 8, 10
    for _ in range(2):
        logits = torch.randn(rows, width, generator=gen) * 3
        counts = torch.randint(0, 3, (lanes_total, width), generator=gen).float()
        lanes = torch.randperm(lanes_total, generator=gen)[:rows]
        batch = _random_batch(gen, rows)
        got = fused_sample(logits, batch, counts, lanes, chunk=chunk)
        assert got.tolist() == sample(logits, batch, counts[lanes]).tolist()


@needs_interpreter
def test_greedy_ties_go_to_the_lowest_id_like_argmax():
    from ninfer.kernels.triton_sampler import fused_sample

    logits = torch.zeros(3, 200)
    logits[0, [150, 40, 99]] = 5.0  # a three-way tie across chunks
    logits[1, [63, 64]] = 2.0  # across a chunk boundary
    logits[2] = -1.0  # everything ties
    batch = SamplingBatch(*(torch.zeros(3) for _ in range(2)), top_k=torch.full((3,), 20), min_p=torch.zeros(3),
                          presence_penalty=torch.zeros(3), frequency_penalty=torch.zeros(3),
                          seed=torch.zeros(3, dtype=torch.long), step=torch.zeros(3, dtype=torch.long))
    got = fused_sample(logits, batch, torch.zeros(3, 200), torch.arange(3), chunk=64)
    assert got.tolist() == logits.argmax(-1).tolist() == [40, 63, 0]


@needs_interpreter
def test_start_up_check_passes_on_this_platform():
    from ninfer.kernels.triton_sampler import check_against_reference

    assert check_against_reference(torch.device("cpu"), width=700, chunk=128) is None


@pytest.mark.cuda
@needs_cuda
def test_start_up_check_passes_on_the_gpu():
    """The runner keeps the torch sampler unless this passes; on the GPU it should (compiled kernels)."""
    from ninfer.kernels import backend
    from ninfer.kernels.triton_sampler import check_against_reference

    if not backend.triton_available():
        pytest.skip("needs Triton")
    assert check_against_reference(torch.device("cuda")) is None
