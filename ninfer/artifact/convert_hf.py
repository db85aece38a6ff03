"""Hugging Face checkpoint folder -> .ninfer (Llama, Qwen3.5/3.6 dense and MoE).

Carries the text backbone and, when present, the MTP head (`mtp.*` -> the `mtp` component, its
config the MTP layer's shape from the text config, checked against the head's parameters) and the
vision tower (`model.visual.*` -> the `vision` component, its config from config.json's
vision_config). Drafter weights have their own components in the format (`dflash.`, ...) and are
mapped when their model code lands; until then they are skipped with a note.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from tqdm import tqdm

from ninfer.artifact.container import Manifest, write_artifact
from ninfer.artifact.presets import SAMPLING_PRESETS_BY_ARCHITECTURE, maintained_qwen_template

_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def _model_type(config: dict[str, Any]) -> str:
    kind = config.get("model_type", "")
    if kind in ("llama",):
        return "llama"
    if kind in ("qwen3_5", "qwen3_5_text"):
        return "qwen3_5"
    if kind in ("qwen3_5_moe", "qwen3_5_moe_text"):
        return "qwen3_5_moe"
    raise ValueError(f"unsupported model_type {kind!r} (supported: llama, qwen3_5, qwen3_5_moe)")


def _family(architecture: str) -> tuple[Callable[[str], Any], Callable[[dict], dict]]:
    """(HF name -> (component, name) or None, HF config -> our text config) for one family."""
    if architecture == "llama":
        from ninfer.models import llama

        def mapper(name: str):
            mapped = llama.hf_to_artifact_name(name)
            return None if mapped is None else ("text", mapped)

        return mapper, llama.text_config_from_hf
    from ninfer.models import qwen3_5

    return qwen3_5.hf_to_artifact_name, qwen3_5.text_config_from_hf


def _fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert weights (FP8 exports, MTP layers) -> the fused [E, 2I, H] / [E, H, I] layout."""
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    out = {}
    for name, tensor in tensors.items():
        m = _PER_EXPERT.match(name)
        if m:
            groups[m["prefix"]][m["proj"]][int(m["expert"])] = tensor
        else:
            out[name] = tensor
    for prefix, projs in groups.items():
        n = len(projs["gate_proj"])
        gate = torch.stack([projs["gate_proj"][j] for j in range(n)])
        up = torch.stack([projs["up_proj"][j] for j in range(n)])
        out[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[f"{prefix}.down_proj"] = torch.stack([projs["down_proj"][j] for j in range(n)])
    return out


def _quantize_experts(tensors: dict[str, torch.Tensor], keep: set[str]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """weights="nvfp4": the fused routed experts ([E, 2I, H] gate_up_proj, [E, H, I] down_proj) of a
    bf16 source -> NVFP4Experts tensors. Experts in `keep` (an NVFP4 checkpoint's, which arrive
    dequantized) stay bf16: re-quantizing their fused gate/up would re-round them."""
    from ninfer.quant.nvfp4 import quantizable_experts, quantize_nvfp4_stack

    out, kept = dict(tensors), []
    for name, tensor in tensors.items():
        if not name.endswith(".mlp.experts.gate_up_proj") or tensor.dim() != 3:
            continue
        module = name[: -len(".gate_up_proj")]
        if module in keep or not quantizable_experts(module, tensor.shape):
            continue
        for proj in ("gate_up", "down"):
            q = quantize_nvfp4_stack(out.pop(f"{module}.{proj}_proj"))
            out[f"{module}.{proj}_packed"], out[f"{module}.{proj}_scale"] = q.packed, q.scale
            out[f"{module}.{proj}_row_scale"] = q.row_scale.float()
        kept.append(module)
    return out, kept


def _chat_template(folder: Path) -> str:
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    cfg = folder / "tokenizer_config.json"
    if cfg.exists():
        template = json.loads(cfg.read_text()).get("chat_template")
        if isinstance(template, str):
            return template
    raise ValueError(f"{folder}: no chat template (chat_template.jinja or tokenizer_config.json chat_template)")


def _eos_ids(folder: Path, config: dict[str, Any]) -> list[int]:
    """generation_config.json's EOS list when present (what HF generate stops on), else config.json's."""
    gen = folder / "generation_config.json"
    sources = [json.loads(gen.read_text())] if gen.exists() else []
    sources += [config, config.get("text_config", {})]
    for src in sources:
        eos = src.get("eos_token_id")
        ids = [x for x in (eos if isinstance(eos, list) else [eos]) if isinstance(x, int)]
        if ids:
            return list(dict.fromkeys(ids))
    return []


# NVFP4 checkpoints. ModelOpt: `<m>.weight` (uint8, packed), `<m>.weight_scale` (E4M3 [N, K/16]),
# `<m>.weight_scale_2` (fp32 multiplier), `<m>.input_scale`. compressed-tensors (nvfp4-pack-quantized):
# `<m>.weight_packed`, `<m>.weight_scale`, `<m>.weight_global_scale` (fp32 divisor),
# `<m>.input_global_scale`. Both pack element 2j in the low nibble, as ninfer does, so the codes and
# block scales are taken as they are; the per-tensor scale becomes ninfer's per-row fp32 row scale.
# Activation scales are dropped (ninfer's NVFP4 is weight-only).
_NVFP4_AUX = ("weight_scale_2", "weight_global_scale", "input_scale", "input_global_scale", "weight_shape",
              "weight_zero_point")


def _nvfp4_target(module: str, lm_head: bool = False) -> bool:
    """A checkpoint-quantized module kept as NVFP4: a linear of a decoder layer, the text's or the MTP
    head's (the routed experts are fused bf16 parameters in ninfer, so their quantized weights are
    dequantized), and with lm_head=True (--nvfp4-lm-head) a quantized lm_head, kept rather than re-rounded."""
    if lm_head and module == "lm_head":
        return True
    return re.match(r"^layers\.\d+\.", module) is not None and ".mlp.experts." not in module


def _quantized_here(component: str, weights: str, nvfp4_mtp: bool) -> bool:
    """Whether conversion quantizes this component's bf16 decoder linears: the text's with weights="nvfp4",
    the MTP head's too with nvfp4_mtp."""
    return weights == "nvfp4" and (component == "text" or (component == "mtp" and nvfp4_mtp))


def _convert_nvfp4(tensors: dict[str, torch.Tensor], component: str, weights: str, dtype: torch.dtype,
                   lm_head: bool = False, nvfp4_mtp: bool = False) -> tuple[dict[str, torch.Tensor], list[str], set[str]]:
    """Checkpoint NVFP4 modules -> ninfer's NVFP4 tensors (or dequantized weights), and with
    weights="nvfp4" the quantizable bf16 linears quantized (the text's lm_head too with lm_head=True; the MTP
    head's only with nvfp4_mtp). Returns the tensors, the NVFP4 modules and the routed experts
    ("layers.N.mlp.experts") that arrived as NVFP4 and were dequantized."""
    from ninfer.quant.nvfp4 import (
        GROUP_SIZE,
        dequantize_nvfp4,
        positive_block_scales,
        quantizable,
        quantize_nvfp4,
    )

    out = dict(tensors)
    kept = []
    dequantized_experts: set[str] = set()
    quantized = sorted(n[: -len(".weight_scale")] for n, t in tensors.items()
                       if n.endswith(".weight_scale") and t.dtype == torch.float8_e4m3fn)
    for module in quantized:
        packed = out.pop(f"{module}.weight_packed", None)
        if packed is None:
            packed = out.pop(f"{module}.weight", None)
        scale = out.pop(f"{module}.weight_scale")
        global_scale = out.get(f"{module}.weight_global_scale")
        multiplier = out.get(f"{module}.weight_scale_2")
        for aux in _NVFP4_AUX:
            out.pop(f"{module}.{aux}", None)
        if packed is None or packed.dtype != torch.uint8 or (global_scale is None and multiplier is None):
            raise ValueError(f"{module}: NVFP4 scales without a packed uint8 weight and a global scale")
        n, half = packed.shape
        if tuple(scale.shape) != (n, half * 2 // GROUP_SIZE):
            raise ValueError(f"{module}: NVFP4 block scales {tuple(scale.shape)} do not fit weight [{n}, {half * 2}]")
        packed, scale = positive_block_scales(packed, scale)
        per_tensor = 1.0 / global_scale.float() if global_scale is not None else multiplier.float()
        row_scale = per_tensor.reshape(-1).expand(n).clone() if per_tensor.numel() == 1 else per_tensor.reshape(n)
        # the MTP head's layer too: its drafts then read a quarter of the bytes (on the H100 at C=1, s21,
        # -0.34 ms of a 12.5 ms k=3 round), from the checkpoint's own values (dequantizing changes none)
        if weights != "bf16" and component in ("text", "mtp") and _nvfp4_target(module, lm_head):
            out[f"{module}.weight_packed"], out[f"{module}.weight_scale"] = packed, scale
            out[f"{module}.weight_row_scale"] = row_scale
            kept.append(module)
        else:
            out[f"{module}.weight"] = dequantize_nvfp4(packed, scale, row_scale, dtype)
            if ".mlp.experts." in module:  # keep it bf16 (see _quantize_experts)
                dequantized_experts.add(module.split(".mlp.experts.")[0] + ".mlp.experts")
    if _quantized_here(component, weights, nvfp4_mtp):
        for name, tensor in list(out.items()):
            module = name[: -len(".weight")]
            if (name.endswith(".weight") and tensor.dim() == 2 and tensor.is_floating_point()
                    and ".mlp.experts." not in module  # per-expert: fused first, then _quantize_experts
                    and quantizable(module, tensor.shape[0], tensor.shape[1], lm_head=lm_head)):
                q = quantize_nvfp4(out.pop(name))
                out[f"{module}.weight_packed"], out[f"{module}.weight_scale"] = q.packed, q.scale
                out[f"{module}.weight_row_scale"] = q.row_scale
                kept.append(module)
    return out, kept, dequantized_experts


def convert_hf(folder: str | Path, out_path: str | Path, *, dtype: torch.dtype = torch.bfloat16,
               name: str | None = None, progress: bool = True, keep_template: bool = False,
               weights: str = "auto", nvfp4_lm_head: bool = False, nvfp4_mtp: bool = False) -> Path:
    """Convert a checkpoint folder. Qwen3.5/3.6 artifacts get ninfer's maintained chat template
    (mid-conversation system/developer turns) unless keep_template asks for the checkpoint's own.

    weights: "auto" keeps the checkpoint's format (an NVFP4 ModelOpt / compressed-tensors checkpoint
    stays NVFP4), "bf16" dequantizes NVFP4 weights to `dtype`, "nvfp4" also quantizes the decoder's
    bf16 linears (ninfer.quant.nvfp4.quantizable decides which).
    nvfp4_lm_head (with weights="nvfp4" only): the untied lm_head is NVFP4 too (quantized, or kept
    as the checkpoint's NVFP4); a tied head is the embedding table and stays in `dtype`.
    nvfp4_mtp (with weights="nvfp4" only): the MTP head's decoder layer is quantized too (a checkpoint's
    quantized MTP layer stays NVFP4 whenever weights is not "bf16").
    """
    if weights not in ("auto", "bf16", "nvfp4"):
        raise ValueError(f"weights must be auto, bf16 or nvfp4, not {weights!r}")
    if nvfp4_lm_head and weights != "nvfp4":
        raise ValueError("nvfp4_lm_head needs weights='nvfp4'")
    if nvfp4_mtp and weights != "nvfp4":
        raise ValueError("nvfp4_mtp needs weights='nvfp4'")
    from ninfer.quant.nvfp4 import manifest_entry, quantizable

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    architecture = _model_type(config)
    mapper, config_from_hf = _family(architecture)
    text_config = config_from_hf(config)
    vision_config = None
    if architecture != "llama":
        from ninfer.models.vision import vision_config_from_hf

        vision_config = vision_config_from_hf(config)
    tokenizer_path = folder / "tokenizer.json"
    if not tokenizer_path.exists():
        raise ValueError(f"{folder}: tokenizer.json is missing")

    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{folder}: no *.safetensors weight files")
    names = []
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            names += [(shard, key) for key in f.keys()]

    by_component: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    skipped: set[str] = set()
    for shard, key in tqdm(names, desc=f"convert {folder.name}", unit="tensor", disable=not progress):
        mapped = mapper(key)
        if mapped is None:
            continue
        component, inner = mapped
        if component == "text" and inner == "lm_head.weight" and text_config.get("tie_word_embeddings"):
            continue  # tied: the head reads embed_tokens.weight
        if component not in ("text", "mtp") and not (component == "vision" and vision_config is not None):
            skipped.add(component)  # drafters (or visual weights without a vision_config): not mapped yet
            continue
        with safe_open(str(shard), framework="pt") as f:
            tensor = f.get_tensor(key)
        keep_precision = inner.endswith(("A_log", "dt_bias")) or inner.rpartition(".")[2] in _NVFP4_AUX or (
            _quantized_here(component, weights, nvfp4_mtp) and tensor.dim() == 2 and inner.endswith(".weight")
            and quantizable(inner[: -len(".weight")], *tensor.shape, lm_head=nvfp4_lm_head and component == "text")
        )  # kept at full precision: quantized from the checkpoint's values
        if tensor.is_floating_point() and tensor.element_size() >= 2 and not keep_precision:
            tensor = tensor.to(dtype)
        by_component[component][inner] = tensor

    components: dict[str, dict[str, Any]] = {"text": text_config}
    if by_component.get("mtp"):
        from ninfer.models.mtp import mtp_config_from_text

        components["mtp"] = mtp_config_from_text(text_config)  # the layer's shape: the head loads on its own
    if by_component.get("vision"):
        components["vision"] = vision_config
    tensors = {}
    nvfp4_modules, mtp_modules = [], []
    for component, group in by_component.items():
        group, kept, dequantized_experts = _convert_nvfp4(group, component, weights, dtype,
                                                          nvfp4_lm_head and component == "text", nvfp4_mtp)
        group = _fuse_experts(group)
        if _quantized_here(component, weights, nvfp4_mtp):
            group, experts = _quantize_experts(group, dequantized_experts)
            kept += experts
        if component == "text":
            nvfp4_modules = kept
        if component == "mtp":
            mtp_modules = kept
        if component == "vision":  # after dequantization: a partial or mis-shaped tower fails here
            from ninfer.models.vision import check_vision_weights

            check_vision_weights(vision_config, group)
        if component == "mtp":  # after expert fusion: per-expert MTP experts arrive fused here
            from ninfer.models.mtp import check_mtp_weights

            check_mtp_weights(components["mtp"], group, kept)
        for inner, tensor in group.items():
            tensors[f"{component}.{inner}"] = tensor
    quantization: dict[str, Any] = {c: str(dtype).removeprefix("torch.") for c in components}
    if nvfp4_modules or mtp_modules:
        quantization.update(manifest_entry(nvfp4_modules, mtp_modules))
    model_name = name or folder.name.lower()
    manifest = Manifest(
        name=model_name,
        architecture=architecture,
        components=components,
        quantization=quantization,
        sampling_presets=SAMPLING_PRESETS_BY_ARCHITECTURE.get(architecture, {}),
        extra={"eos_token_ids": _eos_ids(folder, config), "add_bos": False, "skipped_components": sorted(skipped)},
    )
    out_path = Path(out_path)
    template = _chat_template(folder)
    if architecture != "llama" and not keep_template:
        template = maintained_qwen_template()
    write_artifact(out_path, tensors, manifest, tokenizer_path.read_text(), template)
    return out_path
