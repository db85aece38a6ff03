"""NVFP4 routed experts (ninfer.quant.nvfp4.NVFP4Experts, ninfer.kernels.triton_nvfp4_moe): the
decode kernels under Triton's interpreter (PTX emulated) against the torch path on the same
dequantized weights; quantized MoE artifacts from the synthetic preset and from a Hugging Face
folder load, stay close to their source and generate.

Tolerances: kernels vs the torch path in bf16, max abs diff <= 2e-2 * max |ref| (both round every
intermediate to bf16; the kernel multiplies exact codes by fp32 scales where the reference rounds
each dequantized weight to bf16). Whole tiny models: relative RMS error of the logits against the
unquantized source < 0.3, as for the dense NVFP4 model (tests/test_nvfp4.py).
"""

from __future__ import annotations

import pytest
import torch
from kernel_markers import HAS_TRITON, needs_cuda, needs_interpreter
from test_nvfp4 import TOKENS, _logits, assert_engine_generates  # CPU fp32 logits of TOKENS; a greedy request

from ninfer.artifact.container import Artifact
from ninfer.kernels.moe import Experts, routed_experts
from ninfer.quant.nvfp4 import NVFP4Experts, quantize_model_


def _experts(num_experts=8, hidden=64, intermediate=32, seed=0) -> Experts:
    gen = torch.Generator().manual_seed(seed)
    mod = Experts(num_experts, hidden, intermediate)
    with torch.no_grad():
        mod.gate_up_proj.copy_(torch.randn(mod.gate_up_proj.shape, generator=gen) * 0.1)
        mod.down_proj.copy_(torch.randn(mod.down_proj.shape, generator=gen) * 0.1)
        mod.down_proj[3] *= 1e-4  # an expert with tiny (subnormal E4M3) block scales
    return mod


@needs_interpreter
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (3, 4), (2, 8)])
def test_decode_kernels_match_the_torch_path(tokens, top_k):
    from ninfer.kernels.triton_nvfp4_moe import fused_experts_nvfp4

    q = NVFP4Experts.from_experts(_experts())
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 64, generator=gen).to(torch.bfloat16)
    top_ids = torch.stack([torch.randperm(8, generator=gen)[:top_k] for _ in range(tokens)])
    top_weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), -1).to(torch.bfloat16)
    ref = routed_experts(x, top_ids, top_weights, q.dequantize("gate_up", torch.bfloat16),
                         q.dequantize("down", torch.bfloat16)).float()
    got = fused_experts_nvfp4(x, top_ids, top_weights, q.weights("gate_up"), q.weights("down")).float()
    assert (got - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()


def test_quantize_model_replaces_the_routed_experts():
    from ninfer.artifact.presets import instantiate

    model = instantiate("tiny-qwen3.6-moe", "cpu", torch.float32, seed=0, fuse=False)
    source = model.layers[0].mlp.experts
    gate_up = source.gate_up_proj.detach().clone()
    names = quantize_model_(model)
    assert "layers.0.mlp.experts" in names
    q = model.layers[0].mlp.experts
    assert isinstance(q, NVFP4Experts) and q.gate_up_packed.dtype == torch.uint8
    err = (q.dequantize("gate_up") - gate_up).pow(2).mean().sqrt() / gate_up.pow(2).mean().sqrt()
    assert err.item() < 0.11  # the quantizer's bound on Gaussian weights (tests/test_nvfp4.py)


def _rel_rms(a, b):
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def test_synthetic_moe_artifact_quantizes_experts_and_generates(tmp_path):
    from ninfer.cli import main

    paths = {}
    for weights in ("bf16", "nvfp4"):
        paths[weights] = tmp_path / f"moe-{weights}.ninfer"
        assert main(["convert", "synthetic", "--preset", "tiny-qwen3.6-moe", "--weights", weights,
                     "-o", str(paths[weights])]) == 0
    modules = Artifact(paths["nvfp4"]).manifest.quantization["modules"]
    assert "layers.0.mlp.experts" in modules
    ours, model = _logits(paths["nvfp4"])
    assert isinstance(model.layers[0].mlp.experts, NVFP4Experts)
    assert _rel_rms(ours, _logits(paths["bf16"])[0]) < 0.3
    assert_engine_generates(paths["nvfp4"])


def _per_expert(hf_state: dict) -> dict:
    """Fused [E, 2I, H] / [E, H, I] expert tensors -> per-expert gate/up/down weights (the layout of
    FP8 exports and of some checkpoints)."""
    out = {}
    for name, t in hf_state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix, inter = name[: -len(".gate_up_proj")], t.shape[1] // 2
            for j in range(t.shape[0]):
                out[f"{prefix}.{j}.gate_proj.weight"] = t[j, :inter].contiguous()
                out[f"{prefix}.{j}.up_proj.weight"] = t[j, inter:].contiguous()
        elif name.endswith(".mlp.experts.down_proj"):
            for j in range(t.shape[0]):
                out[f"{name[: -len('.down_proj')]}.{j}.down_proj.weight"] = t[j].contiguous()
        else:
            out[name] = t
    return out


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
def test_hf_moe_folder_converts_with_nvfp4_experts(tmp_path, layout):
    from test_convert_hf import _hf_logits, _save_folder, _small_qwen_config
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from ninfer.artifact.convert_hf import convert_hf

    torch.manual_seed(2)
    text_cfg = _small_qwen_config(True)
    hf = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**text_cfg)).eval()
    config = {"model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"], **text_cfg}
    _save_folder(tmp_path / "moe", hf, config)
    if layout == "per_expert":
        from safetensors.torch import load_file, save_file

        path = tmp_path / "moe" / "model.safetensors"
        state = _per_expert(load_file(str(path)))
        assert any(".mlp.experts.3.down_proj.weight" in k for k in state)
        save_file(state, str(path))
    out = convert_hf(tmp_path / "moe", tmp_path / "moe.ninfer", dtype=torch.float32, progress=False,
                     weights="nvfp4")
    modules = Artifact(out).manifest.quantization["modules"]
    assert "layers.0.mlp.experts" in modules and not any(".experts." in m for m in modules)
    ours, model = _logits(out, TOKENS[:7])
    assert isinstance(model.layers[0].mlp.experts, NVFP4Experts)
    assert _rel_rms(ours, _hf_logits(hf, TOKENS[:7])) < 0.3


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("tokens,top_k", [(1, 8), (4, 8), (16, 8)])
def test_decode_kernels_on_cuda_bf16(tokens, top_k):
    """The 35B-A3B expert shapes (H 2048, I 512; 32 of its 256 experts) on the GPU."""
    if not HAS_TRITON:
        pytest.skip("triton is not importable")
    from ninfer.kernels.triton_nvfp4_moe import fused_experts_nvfp4

    experts = _experts(num_experts=32, hidden=2048, intermediate=512)  # CPU generator: built on the host
    with torch.device("cuda"):
        q = NVFP4Experts.from_experts(experts.cuda())
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        x = torch.randn(tokens, 2048, generator=gen, device="cuda").to(torch.bfloat16)
        top_ids = torch.stack([torch.randperm(32, generator=gen, device="cuda")[:top_k] for _ in range(tokens)])
        top_weights = torch.softmax(torch.randn(tokens, top_k, generator=gen, device="cuda"), -1).to(torch.bfloat16)
    ref = routed_experts(x, top_ids, top_weights, q.dequantize("gate_up", torch.bfloat16),
                         q.dequantize("down", torch.bfloat16)).float()
    got = fused_experts_nvfp4(x, top_ids, top_weights, q.weights("gate_up"), q.weights("down")).float()
    assert (got - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
