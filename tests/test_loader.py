"""Loading an artifact: the model is built without parameter storage and adopts the artifact's
tensors, so no weight exists twice on the device (a 27B bf16 model must load on a GPU that holds
it once, not twice)."""

from __future__ import annotations

import pytest
import torch
from kernel_markers import needs_cuda

from ninfer.artifact.container import Artifact
from ninfer.engine.loader import _parameters_on_meta, load_model
from ninfer.models import build_model


def test_build_puts_parameters_on_meta_and_keeps_computed_buffers(tiny_qwen_path):
    art = Artifact(tiny_qwen_path)
    with _parameters_on_meta():
        model = build_model(art.architecture, art.config("text"))
    assert all(p.is_meta for p in model.parameters())
    inv_freq = model.rotary.inv_freq
    assert not inv_freq.is_meta and torch.isfinite(inv_freq).all() and inv_freq[0] == 1.0
    # registration is restored afterwards
    assert not torch.nn.Linear(2, 2).weight.is_meta


@pytest.mark.parametrize("fixture", ["tiny_qwen_path", "tiny_qwen_moe_path", "tiny_llama_path"])
def test_loaded_model_holds_the_artifact_tensors(fixture, request):
    art = Artifact(request.getfixturevalue(fixture))
    model = load_model(art, torch.device("cpu"), torch.float32)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    stored = art.load(("text",), device="cpu", dtype=torch.float32)["text"]
    state = model.state_dict()
    unfused = [k for k in stored if k in state]  # fused projections are stored under new names
    assert unfused and all(torch.equal(state[k], stored[k]) for k in unfused)


@pytest.mark.cuda
@needs_cuda
def test_load_peaks_at_the_model_size_on_cuda(tiny_qwen_path):
    device = torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = load_model(Artifact(tiny_qwen_path), device, torch.bfloat16)
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    peak = torch.cuda.max_memory_allocated() - before
    # the projection fusion copies one layer's projections at a time: a few MiB over the model
    assert peak <= 1.25 * weights, (peak, weights)
