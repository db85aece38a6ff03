"""Int8 weight-only CPU matmuls (`--dtype int8`, ninfer.quant.int8_cpu; issue 23: CPU decode speed)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ninfer.config import ServerConfig
from ninfer.engine.engine import EngineSettings
from ninfer.engine.loader import load_engine, pick_dtype
from ninfer.engine.types import EngineRequest, SamplingParams, TokenEvent
from ninfer.quant.int8_cpu import Int8Linear, quantize_rows


def test_rows_quantize_within_half_a_step_and_the_kernel_matches_the_dequantized_product():
    torch.manual_seed(0)
    w, x = torch.randn(96, 64), torch.randn(5, 64)
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (96,)
    assert ((q.float() * scale.float()[:, None] - w).abs() <= scale.float()[:, None] * 0.51 + 1e-3).all()
    layer = Int8Linear(w, torch.randn(96))
    want = F.linear(x.bfloat16().float(), q.float() * scale.float()[:, None]) + layer.bias.float()
    got = layer(x)
    assert got.dtype == x.dtype and got.shape == (5, 96)
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.02)


def test_int8_is_a_cpu_dtype_of_the_server_config():
    assert ServerConfig(artifact="m.ninfer", dtype="int8").dtype == "int8"
    assert pick_dtype("int8", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="CPU path"):
        pick_dtype("int8", torch.device("cuda"))


def test_smollm2_with_int8_weights_continues_as_fp32_does(smollm2_path):
    """The real SmolLM2 weights: every linear and the tied head become Int8Linear, and a factual prompt's
    greedy continuation starts with the same word as in fp32."""
    prompt = "The capital of France is"
    outputs = {}
    for dtype in ("fp32", "int8"):
        engine = load_engine(smollm2_path, EngineSettings(max_context=128), dtype=dtype)
        try:
            if dtype == "int8":
                kinds = {type(m).__name__ for m in engine.runner.model.modules()}
                assert "Int8Linear" in kinds and "Linear" not in kinds and "DecodeLinear" not in kinds
            ids = engine.tokenizer.encode(prompt)
            events = engine.generate(EngineRequest(f"q-{dtype}", ids, max_tokens=4,
                                                   sampling=SamplingParams(temperature=0.0)))
            outputs[dtype] = engine.tokenizer.decode([i for e in events if isinstance(e, TokenEvent)
                                                      for i in e.token_ids])
        finally:
            engine.shutdown()
    assert outputs["fp32"].split()[0] == outputs["int8"].split()[0], outputs
