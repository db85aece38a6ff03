"""Artifact -> model on a device -> Engine. The composition point: the engine gets the artifact's
reasoning-channel control from the chat frontend (ninfer.chat.thinking), not from engine constants."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from ninfer.artifact.container import Artifact
from ninfer.chat.thinking import thinking_control
from ninfer.engine.engine import Engine, EngineSettings
from ninfer.models import build_model, prepare_for_inference_
from ninfer.tokenizer import Tokenizer

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def pick_device(index: int = 0) -> torch.device:
    return torch.device(f"cuda:{index}") if torch.cuda.is_available() else torch.device("cpu")


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on CUDA; fp32 on CPU, where bf16 matmuls are slower and parity needs fp32. int8: bf16
    activations with int8 weight-only matmuls (CPU only; load_engine quantizes the loaded model)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name == "int8":
        if device.type != "cpu":
            raise ValueError("--dtype int8 (int8 weight-only matmuls) is a CPU path; use bf16 or NVFP4 weights on CUDA")
        return torch.bfloat16
    return _DTYPES[name]


def _nvfp4_modules(artifact: Artifact, key: str = "modules") -> list[str]:
    """The NVFP4 modules the manifest lists under `key` (ninfer.quant.nvfp4.manifest_entry): the text
    component's, or "mtp_modules", the MTP head's."""
    quant = artifact.manifest.quantization or {}
    kind = quant.get("weights")
    if kind in (None, "bf16"):
        return []
    if kind != "nvfp4":
        raise ValueError(f"{artifact.path}: weight format {kind!r} is not supported (bf16, nvfp4)")
    return list(quant.get(key, []))


def _cast_floating(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Artifact.load's dtype cast, except for NVFP4 row scales (fp32 by format)."""
    if tensor.is_floating_point() and tensor.element_size() >= 2 and not name.endswith("row_scale"):
        return tensor.to(dtype)
    return tensor


@contextmanager
def _parameters_on_meta():
    """Build modules with every nn.Parameter moved to the meta device (no storage) as it is
    registered; buffers stay where they are made (the rotary tables are computed, not loaded).
    The loader then assigns the artifact's tensors, so a weight never exists twice on the device:
    load peaks at the model's size, not twice it. The patch is process-wide while active: the
    loader builds one model at a time."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def load_model(artifact: Artifact, device: torch.device, dtype: torch.dtype,
               components: tuple[str, ...] = ("text",)) -> torch.nn.Module:
    """Build the module (parameters without storage) and adopt the artifact's tensors on the device.

    NVFP4 artifacts (manifest quantization {"weights": "nvfp4", "modules": [...]}): the listed
    linears (the decoder's, and "lm_head" when the converter quantized it) become NVFP4Linear before
    loading; their fp32 row scales keep fp32.
    """
    nvfp4_modules = _nvfp4_modules(artifact)
    if nvfp4_modules:
        weights = {k: _cast_floating(k, v, dtype) for k, v in artifact.load(components, device="cpu")["text"].items()}
    else:
        weights = artifact.load(components, device="cpu", dtype=dtype)["text"]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), _parameters_on_meta():
            model = build_model(artifact.architecture, artifact.config("text"))
    finally:
        torch.set_default_dtype(previous)
    if nvfp4_modules:
        from ninfer.quant.nvfp4 import replace_with_nvfp4_

        replace_with_nvfp4_(model, nvfp4_modules)  # empty NVFP4 modules on the meta device
    expected = set(model.state_dict())
    missing = sorted(expected - set(weights))
    unexpected = sorted(set(weights) - expected)
    if missing or unexpected:
        raise ValueError(f"{artifact.path}: weights do not match the {artifact.architecture} model "
                         f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    for name in list(weights):  # one tensor at a time onto the device, each host copy dropped as it goes
        weights[name] = weights[name].to(device)
    model.load_state_dict(weights, strict=False, assign=True)
    del weights
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{artifact.path}: no tensor for {left[:5]}")
    return prepare_for_inference_(model).eval()


def load_vision_tower(artifact: Artifact, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The artifact's vision tower (ninfer.models.vision) on the device. Reads the `vision.`
    tensors only (Artifact.load would materialize the text weights too)."""
    from safetensors import safe_open

    from ninfer.models.vision import build_vision_tower

    config = artifact.config("vision")  # a clear error when the artifact has no tower
    with safe_open(str(artifact.path), framework="pt", device=str(device)) as f:
        weights = {name.removeprefix("vision."): _cast_floating(name, f.get_tensor(name), dtype)
                   for name in artifact.tensor_names if name.startswith("vision.")}
    with torch.device("meta"):  # no buffers: the rotary angles are computed per forward
        tower = build_vision_tower(config)
    tower.load_state_dict(weights, strict=True, assign=True)
    return tower.eval()


def load_mtp_head(artifact: Artifact, trunk: nn.Module, device: torch.device, dtype: torch.dtype, *,
                  kv_layer: int = 0) -> nn.Module:
    """The artifact's MTP head (ninfer.models.mtp) on the device, attached to `trunk` (whose
    embedding, lm_head and rotary tables it shares) and in its run-time form. Reads only the `mtp.`
    tensors; its KV is one attention layer the caller allocates (MTPHead.cache_spec): a cache of its
    own (kv_layer 0) or one more layer of the trunk's (kv_layer = trunk.num_attn_layers)."""
    from safetensors import safe_open

    from ninfer.models.mtp import MTPHead

    config = artifact.config("mtp")  # a clear error when the artifact has no head
    with safe_open(str(artifact.path), framework="pt", device=str(device)) as f:
        weights = {name.removeprefix("mtp."): _cast_floating(name, f.get_tensor(name), dtype)
                   for name in artifact.tensor_names if name.startswith("mtp.")}
    with torch.device("meta"):  # no buffers: the rotary tables are the trunk's
        head = MTPHead(config, kv_layer=kv_layer)
    nvfp4_modules = _nvfp4_modules(artifact, "mtp_modules")  # a quantized checkpoint's, or --nvfp4-mtp's
    if nvfp4_modules:
        from ninfer.quant.nvfp4 import replace_with_nvfp4_

        replace_with_nvfp4_(head, nvfp4_modules)
    head.load_state_dict(weights, strict=True, assign=True)
    return prepare_for_inference_(head.attach_(trunk)).eval()


def load_proposer(artifact: Artifact, trunk: nn.Module, settings: EngineSettings, device: torch.device,
                  dtype: torch.dtype):
    """The drafter --spec selects, from the artifact's components (before the engine sizes its KV)."""
    if settings.spec in ("dflash", "dflash2"):
        return load_block_drafter(artifact, trunk, settings, device, dtype)
    if settings.spec != "mtp":
        raise ValueError(f"--spec {settings.spec} is not supported (supported: mtp, dflash, dflash2)")
    if not settings.draft_tokens:
        settings.draft_tokens = 3
    from ninfer.engine.mtp_proposer import MTPProposer

    head = load_mtp_head(artifact, trunk, device, dtype, kv_layer=trunk.cache_spec().num_attn_layers)
    draft_head = load_draft_head(artifact, device, dtype) if settings.lm_head_draft else None
    if draft_head is not None and _nvfp4_modules(artifact, "mtp_modules"):  # an NVFP4 drafter scores in NVFP4 too
        draft_head.quantize_nvfp4_()
    return MTPProposer(head, draft_head)


def load_block_drafter(artifact: Artifact, trunk: nn.Module, settings: EngineSettings, device: torch.device,
                       dtype: torch.dtype):
    """The artifact's DFlash / DFlash2 drafter (component of --spec's name) as the engine's proposer; draft
    tokens beyond the drafter's block (block_size - 1) are refused."""
    from safetensors import safe_open

    from ninfer.engine.dflash_proposer import DFlashProposer
    from ninfer.models.dflash import DFlashDrafter

    name = settings.spec
    config = artifact.config(name)
    with safe_open(str(artifact.path), framework="pt", device=str(device)) as f:
        weights = {k.removeprefix(name + "."): _cast_floating(k, f.get_tensor(k), dtype)
                   for k in artifact.tensor_names if k.startswith(name + ".")}
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):  # not meta: its rotary tables are buffers of its own (a few GB at most)
            drafter = DFlashDrafter(config)
    finally:
        torch.set_default_dtype(previous)
    drafter.load_state_dict(weights, strict=True)
    drafter = prepare_for_inference_(drafter.attach_(trunk)).eval()
    settings.draft_tokens = settings.draft_tokens or min(7, drafter.block_size - 1)
    if settings.draft_tokens > drafter.block_size - 1:
        raise ValueError(f"--draft-tokens {settings.draft_tokens}: the {name} drafter's block of "
                         f"{drafter.block_size} gives at most {drafter.block_size - 1} drafts")
    return DFlashProposer(drafter)


def load_draft_head(artifact: Artifact, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The artifact's proposal head (`draft_head` component, ninfer.models.draft_head) on the device."""
    from safetensors import safe_open

    from ninfer.models.draft_head import DraftHead

    config = artifact.config("draft_head")
    with safe_open(str(artifact.path), framework="pt", device=str(device)) as f:
        weights = {name.removeprefix("draft_head."): f.get_tensor(name)
                   for name in artifact.tensor_names if name.startswith("draft_head.")}
    head = DraftHead(config["num_tokens"], config["hidden_size"], dtype=dtype, device=device)
    head.load_state_dict({k: (v if k == "token_ids" else v.to(dtype)) for k, v in weights.items()}, strict=True)
    return head.eval()


def load_engine(path: str | Path, settings: EngineSettings | None = None, *, device: torch.device | None = None,
                dtype: str = "auto", start: bool = True, proposer=None) -> Engine:
    """Load an artifact into a started engine; the load itself runs on the engine's thread. proposer: a
    speculative drafter (ninfer.engine.speculative), used with settings.draft_tokens > 0."""
    if start:
        return Engine.build_and_start(lambda: load_engine(path, settings, device=device, dtype=dtype, start=False,
                                                          proposer=proposer))
    artifact = Artifact(path)
    device = device or pick_device()
    torch_dtype = pick_dtype(dtype, device)
    model = load_model(artifact, device, torch_dtype)
    if dtype == "int8":
        from ninfer.kernels import cpu_native
        from ninfer.quant.int8_cpu import quantize_model_int8_

        quantize_model_int8_(model)
        cpu_native.library()  # its first build (~3 s) at load, not in the first request's first decode step
    tokenizer = Tokenizer.from_json_str(artifact.tokenizer_json)
    settings = dataclasses.replace(settings) if settings else EngineSettings()
    if not settings.eos_ids:
        settings.eos_ids = set(artifact.manifest.extra.get("eos_token_ids", []))
    if not settings.sampling_presets:
        settings.sampling_presets = artifact.manifest.sampling_presets
    # without --vision no tower is read or allocated; with it, before the engine sizes its KV from free memory
    tower = load_vision_tower(artifact, device, torch_dtype) if settings.vision else None
    if proposer is None and settings.spec:
        proposer = load_proposer(artifact, model, settings, device, torch_dtype)
    engine = Engine(model, tokenizer, settings, device=device, dtype=torch_dtype, thinking=thinking_control(tokenizer),
                    proposer=proposer)
    engine.runner.vision_tower = tower
    engine.artifact = artifact
    return engine


def engine_from_preset(name: str, settings: EngineSettings | None = None, *, device: torch.device | None = None,
                       dtype: str = "auto", seed: int = 0, start: bool = True, weights: str = "bf16",
                       nvfp4_lm_head: bool = False, proposer=None) -> Engine:
    """A random-weight preset built directly on the device (full-size shapes for benchmarks: no file).
    proposer: a drafter, or a function of the built trunk that returns one.

    weights="nvfp4": the random weights are quantized in place on the device (one linear at a time,
    so peak memory stays near the unquantized model's), then the model gets its run-time form;
    nvfp4_lm_head also quantizes the (untied) lm_head.
    """
    if start:
        return Engine.build_and_start(
            lambda: engine_from_preset(name, settings, device=device, dtype=dtype, seed=seed, start=False,
                                       weights=weights, nvfp4_lm_head=nvfp4_lm_head, proposer=proposer))
    from ninfer.artifact.presets import get_preset, instantiate, tokenizer_json_for

    if weights not in ("bf16", "nvfp4"):
        raise ValueError(f"weights must be bf16 or nvfp4, not {weights!r}")
    if nvfp4_lm_head and weights != "nvfp4":
        raise ValueError("nvfp4_lm_head needs weights='nvfp4'")
    preset = get_preset(name)
    device = device or pick_device()
    torch_dtype = pick_dtype(dtype, device)
    if weights == "nvfp4":
        from ninfer.quant.nvfp4 import quantize_model_

        model = instantiate(name, device, torch_dtype, seed, fuse=False)
        quantize_model_(model, lm_head=nvfp4_lm_head)
        prepare_for_inference_(model)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # hand the freed bf16 weights back before the KV cache is sized
    else:
        model = instantiate(name, device, torch_dtype, seed)
    tokenizer_json, extra = tokenizer_json_for(preset)
    settings = dataclasses.replace(settings) if settings else EngineSettings()
    if not settings.eos_ids:
        settings.eos_ids = set(extra.get("eos_token_ids", []))
    if not settings.sampling_presets:
        settings.sampling_presets = preset.sampling_presets
    tokenizer = Tokenizer.from_json_str(tokenizer_json)
    if proposer is not None and not hasattr(proposer, "propose"):  # a factory of the trunk (a random MTP head)
        proposer = proposer(model)
    return Engine(model, tokenizer, settings, device=device, dtype=torch_dtype, thinking=thinking_control(tokenizer),
                  proposer=proposer)
