"""`--kv-capacity auto` (serving.md, server options and resource scheduling: "auto accounts for the
complete enabled runtime and leaves 1 GiB of sizing headroom"; capacity resolves once at startup).

On CPU there is no device memory to share out: auto gives every lane a full --max-context. The CUDA
sizing (workspace probe, free-memory ledger) runs on the device only.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.engine.engine import EngineSettings
from ninfer.engine.kv_sizing import HEADROOM_BYTES, auto_kv_capacity
from ninfer.engine.loader import load_engine


def test_auto_on_cpu_gives_every_lane_a_full_context(tiny_qwen_path):
    settings = EngineSettings(max_context=512, kv_capacity="auto", max_concurrency=3, page_size=16)
    engine = load_engine(tiny_qwen_path, settings, start=False)
    assert engine.kv_capacity == 512 * 3
    assert engine.snapshot()["kv_pages_capacity"] == 512 * 3 // 16
    assert engine.snapshot()["kv_capacity_tokens"] == 512 * 3
    assert engine.kv_sizing.tokens == 512 * 3 and engine.kv_sizing.kv_bytes_per_token > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="sizes the pool from free CUDA memory")
def test_auto_on_cuda_fills_free_memory_but_the_headroom(tiny_qwen_path):
    from ninfer.artifact.container import Artifact
    from ninfer.engine.loader import load_model

    device = torch.device("cuda")
    model = load_model(Artifact(tiny_qwen_path), device, torch.bfloat16)
    sizing = auto_kv_capacity(model, page_size=16, prefill_chunk=256, num_state_slots=4, max_context=512,
                              max_concurrency=2, vocab_size=1000, device=device, dtype=torch.bfloat16,
                              kv_dtype="bf16")
    assert sizing.tokens % 16 == 0 and sizing.tokens > 512
    used = sizing.tokens * sizing.kv_bytes_per_token + sizing.workspace_bytes + sizing.state_bytes
    spare = sizing.free_bytes - used - sizing.graph_allowance_bytes
    assert HEADROOM_BYTES <= spare < HEADROOM_BYTES + 16 * sizing.kv_bytes_per_token
