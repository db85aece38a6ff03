"""Synthetic random-weight models at named shapes.

Tiny presets are written as .ninfer files for tests. Full-size shapes (`qwen3.6-27b`,
`qwen3.6-35b-a3b`) are instantiated directly on the GPU for benchmarks, never written to disk;
`instantiate_mtp` adds a random MTP head to either.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ninfer.artifact.container import Manifest, write_artifact
from ninfer.models import build_model, prepare_for_inference_

# Contract, "Server options": registered sampler defaults by thinking mode.
_QWEN27B_PRESETS = {
    "thinking": {"temperature": 1.0, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "presence_penalty": 0.0,
                 "frequency_penalty": 0.0},
    "non_thinking": {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0, "presence_penalty": 1.5,
                     "frequency_penalty": 0.0},
}
_QWEN35B_PRESETS = {
    "thinking": {**_QWEN27B_PRESETS["thinking"], "presence_penalty": 1.5},
    "non_thinking": dict(_QWEN27B_PRESETS["non_thinking"]),
}

SAMPLING_PRESETS_BY_ARCHITECTURE = {"qwen3_5": _QWEN27B_PRESETS, "qwen3_5_moe": _QWEN35B_PRESETS}

TINY_LLAMA_CONFIG = {
    "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0, "tie_word_embeddings": True, "max_position_embeddings": 8192,
}

# A tiny Qwen3.5 vision tower (vision component config, HF field names) for tests; out_hidden_size
# is set to the text hidden size when written. An 8x8 learned position grid.
TINY_VISION_CONFIG = {
    "depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 64,
    "in_channels": 3, "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
    "num_position_embeddings": 64, "hidden_act": "gelu_pytorch_tanh",
    "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
}


@dataclass(frozen=True)
class Preset:
    name: str
    architecture: str
    tokenizer: str  # "qwen" or "smollm2"
    sampling_presets: dict[str, dict[str, float]]

    def text_config(self) -> dict[str, Any]:
        if self.architecture == "llama":
            return dict(TINY_LLAMA_CONFIG)
        from ninfer.models.qwen3_5 import QWEN3_6_SHAPES

        return dict(QWEN3_6_SHAPES[self.name])


PRESETS = {
    "tiny-llama": Preset("tiny-llama", "llama", "smollm2", {}),
    "tiny-qwen3.6": Preset("tiny-qwen3.6", "qwen3_5", "qwen", _QWEN27B_PRESETS),
    "tiny-qwen3.6-moe": Preset("tiny-qwen3.6-moe", "qwen3_5_moe", "qwen", _QWEN35B_PRESETS),
    "qwen3.6-27b": Preset("qwen3.6-27b", "qwen3_5", "qwen", _QWEN27B_PRESETS),
    "qwen3.6-35b-a3b": Preset("qwen3.6-35b-a3b", "qwen3_5_moe", "qwen", _QWEN35B_PRESETS),
}
FILE_PRESETS = ("tiny-llama", "tiny-qwen3.6", "tiny-qwen3.6-moe")


def maintained_qwen_template() -> str:
    """ninfer's maintained Qwen3.6 template: the official one with system/developer turns kept in place
    (the contract's rule), which the official template rejects."""
    return (Path(__file__).parent.parent / "chat" / "templates" / "qwen3_6_ninfer.jinja").read_text()


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]


def instantiate(name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                seed: int = 0, fuse: bool = True) -> torch.nn.Module:
    """Build a preset's model with random weights directly on `device` (no file, no CPU copy).

    fuse: bring the model to its run-time form (`prepare_for_inference_`: merged projections, decode
    GEMVs), as the loader does.
    """
    preset = get_preset(name)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(preset.architecture, preset.text_config())
            model.init_random_(seed)
            if fuse:
                prepare_for_inference_(model)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def instantiate_mtp(trunk: torch.nn.Module, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                    seed: int = 0, fuse: bool = True, kv_layer: int = 0) -> torch.nn.Module:
    """A random-weight MTP head (ninfer.models.mtp) at the trunk's shape (an `instantiate`d preset,
    full-size ones included), built directly on `device` and attached to the trunk, for tests and
    for timing draft steps. fuse: the run-time form, as load_mtp_head gives it."""
    from ninfer.models.mtp import MTPHead, mtp_config_from_text

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            head = MTPHead(mtp_config_from_text(trunk.config), kv_layer=kv_layer)
            head.init_random_(seed)
    finally:
        torch.set_default_dtype(previous)
    head.attach_(trunk)
    if fuse:
        prepare_for_inference_(head)
    return head.eval()


def _random_vision_tower(config: dict[str, Any], dtype: torch.dtype, seed: int) -> torch.nn.Module:
    from ninfer.models.vision import build_vision_tower

    tower = build_vision_tower(config).to(dtype)
    tower.init_random_(seed)
    return tower


def _tokenizer_and_template(kind: str) -> tuple[str, str, dict[str, Any]]:
    if kind == "qwen":
        from ninfer.artifact.qwen_tokenizer import QWEN_EOS_IDS, build_qwen_tokenizer_json

        template = maintained_qwen_template()
        return build_qwen_tokenizer_json(), template, {"eos_token_ids": list(QWEN_EOS_IDS), "add_bos": False}
    from ninfer.artifact.convert_gguf import default_smollm2_gguf
    from ninfer.artifact.gguf_tokenizer import tokenizer_from_gguf

    tok_json, template, info = tokenizer_from_gguf(default_smollm2_gguf())
    eos = info.get("eos_token_id")
    return tok_json, template or "", {"eos_token_ids": [eos] if eos is not None else [], "add_bos": False}


def unique_tensors(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Prefix names and drop aliases (tied embeddings share one storage; safetensors stores it once)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        out[prefix + name] = tensor.detach()
    return out


def tokenizer_json_for(preset: Preset) -> tuple[str, dict[str, Any]]:
    tok_json, _, extra = _tokenizer_and_template(preset.tokenizer)
    return tok_json, extra


def write_preset(name: str, out_path: str | Path, seed: int = 0, dtype: torch.dtype = torch.float32,
                 weights: str = "bf16", nvfp4_lm_head: bool = False, vision: bool = False,
                 mtp: bool = False) -> Path:
    """Write a tiny preset as a .ninfer artifact (random weights, real tokenizer and template).

    weights="nvfp4" quantizes the decoder's linears (ninfer.quant.nvfp4) from the same random
    weights that weights="bf16" (unquantized, stored in `dtype`) writes; nvfp4_lm_head also the
    untied lm_head (a tied preset has none: nothing more is quantized).
    vision (Qwen presets): add a random TINY_VISION_CONFIG tower as the `vision` component.
    mtp (Qwen presets): add a random MTP head at the preset's shape as the `mtp` component (kept in
    `dtype` with weights="nvfp4", as the converter keeps a checkpoint's).
    """
    if name not in FILE_PRESETS:
        raise ValueError(f"preset {name!r} is a full-size shape: it is instantiated on the GPU, not written")
    if weights not in ("bf16", "nvfp4"):
        raise ValueError(f"weights must be bf16 or nvfp4, not {weights!r}")
    if nvfp4_lm_head and weights != "nvfp4":
        raise ValueError("nvfp4_lm_head needs weights='nvfp4'")
    preset = get_preset(name)
    if vision and preset.architecture == "llama":
        raise ValueError(f"preset {name!r} has no vision tower (Qwen presets only)")
    if mtp and preset.architecture == "llama":
        raise ValueError(f"preset {name!r} has no MTP head (Qwen presets only)")
    model = instantiate(name, "cpu", dtype, seed, fuse=False)  # separate tensors, no shared storage to save
    quantization: dict[str, Any] = {"text": str(dtype).removeprefix("torch.")}
    if weights == "nvfp4":
        from ninfer.quant.nvfp4 import manifest_entry, quantize_model_

        quantization.update(manifest_entry(quantize_model_(model, lm_head=nvfp4_lm_head)))
    tensors = unique_tensors(model.state_dict(), prefix="text.")
    components = {"text": preset.text_config()}
    if mtp:
        head = instantiate_mtp(model, "cpu", dtype, seed + 1, fuse=False)
        components["mtp"] = head.config
        tensors.update(unique_tensors(head.state_dict(), prefix="mtp."))
        quantization["mtp"] = str(dtype).removeprefix("torch.")
    if vision:
        components["vision"] = dict(TINY_VISION_CONFIG, out_hidden_size=components["text"]["hidden_size"])
        tensors.update(unique_tensors(_random_vision_tower(components["vision"], dtype, seed).state_dict(),
                                      prefix="vision."))
        quantization["vision"] = quantization["text"]
    tok_json, template, extra = _tokenizer_and_template(preset.tokenizer)
    manifest = Manifest(
        name=name,
        architecture=preset.architecture,
        components=components,
        quantization=quantization,
        sampling_presets=preset.sampling_presets,
        extra=extra,
    )
    out_path = Path(out_path)
    write_artifact(out_path, tensors, manifest, tok_json, template)
    return out_path
