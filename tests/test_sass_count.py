"""bench/sass_count.py: Triton compiles the NVFP4 GEMVs for sm_90 on this CPU host, and the packed
fp16 loop stays well under the fp32-decode loop in instructions per weight (the reason it exists:
both kernels are bound by instruction issue on the H200, ninfer/kernels/triton_nvfp4.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kernel_markers import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")


def _count(*specs: str) -> list[dict]:
    # a fresh interpreter: conftest turns on TRITON_INTERPRET, under which nothing compiles
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).resolve().parent.parent / "bench" / "sass_count.py"
    out = subprocess.run([sys.executable, str(script), *specs], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    return [json.loads(line) for line in out.splitlines()]


def test_packed_fp16_gemv_needs_fewer_instructions_per_weight():
    packed, fp32 = _count("hfma:8,128,2", "fma:8,64,2")
    assert packed["loop_instructions"] > 0 and fp32["loop_instructions"] > 0
    assert dict(packed["top_ops"]).get("HFMA2", 0) > 0  # the PTX's packed fp16 math made it through
    assert packed["instructions_per_weight"] < 0.8 * fp32["instructions_per_weight"], (packed, fp32)


@pytest.mark.parametrize("kernel", ["rmsnorm", "recurrent", "recurrent_steps", "conv_steps"])
def test_small_decode_kernels_load_everything_before_their_first_barrier(kernel):
    """The residual-add RMSNorm, the GDN recurrent step (raw gates as split-K partial sums) and a verify's four GDN
    positions in one launch (recurrent and conv), compiled for sm_90: every global load comes before the first
    barrier or store, so a decode step (one of these kernels is mostly a memory round trip at batch 1) pays one
    round trip, not one a position: less of serving.md's request_done.engine_timing device_wait for the same tokens.
    The arithmetic is the references' either way (tests/test_fused.py, tests/test_kernels.py)."""
    (out,) = _count(f"order:{kernel}")
    runs = out["memory_order"].split()
    assert runs[0].startswith("LDG") and not any(r.startswith("LDG") for r in runs[1:]), out


def test_decode_attention_table_tile_fits_without_spilling():
    """The paged decode attention at the 27B head shape, bf16 K/V, its table tile (64 tokens, 4 warps, 2 stages)
    compiled for sm_90: no register spills (a spill is a local-memory round trip in the loop of every served
    decode step's attention, serving.md's request_done.engine_timing device_wait), and the tile narrower by half
    takes fewer registers (the candidates `bench/attn_decode_tiles.py` times)."""
    table, narrow = _count("attn:64,4,2", "attn:32,4,2")
    assert table["local_bytes"] == 0, table
    assert 0 < narrow["registers"] < table["registers"], (narrow, table)
