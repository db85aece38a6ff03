"""Add a z-lab DFlash / DFlash2 drafter checkpoint to an existing .ninfer artifact.

The drafter folder is z-lab's layout: config.json (`DFlashDraftModel` / `DFlash2DraftModel`, the
draft fields in `dflash_config` or at top level) and *.safetensors whose tensor names are the
drafter's module names (fc.weight, layers.0.self_attn.q_proj.weight, ...). They become the
`dflash` or `dflash2` component as they are: ninfer.models.dflash names its parameters the same.
The artifact's other components, tokenizer and template are copied unchanged; an existing
component of the same variant is replaced.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ninfer.artifact.container import Artifact, Manifest, write_artifact
from ninfer.models.dflash import check_dflash_weights, dflash_config_from_hf


def _check_against_trunk(config: dict[str, Any], text: dict[str, Any]) -> None:
    """The drafter reads the trunk's embedding, lm_head and hidden states: their shapes must agree."""
    if config["hidden_size"] != text["hidden_size"]:
        raise ValueError(f"drafter hidden_size {config['hidden_size']} != the trunk's {text['hidden_size']}")
    vocab = text["vocab_size"]
    if config.get("vocab_size", vocab) != vocab or not 0 <= config["mask_token_id"] < vocab:
        raise ValueError(f"drafter vocabulary (vocab_size {config.get('vocab_size')}, mask_token_id "
                         f"{config['mask_token_id']}) does not fit the trunk's {vocab} tokens")
    if not all(0 <= i < text["num_hidden_layers"] for i in config["target_layer_ids"]):
        raise ValueError(f"target_layer_ids {config['target_layer_ids']} name layers the trunk "
                         f"({text['num_hidden_layers']} layers) does not have")


def _read_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{folder}: no *.safetensors weight files")
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def _text_dtype(manifest: Manifest) -> torch.dtype | None:
    """The floating dtype the artifact stores its text weights in, when the manifest records one."""
    dtype = getattr(torch, str(manifest.quantization.get("text", "")), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def import_drafter(artifact_in: str | Path, drafter_folder: str | Path, out_path: str | Path,
                   variant: str | None, *, dtype: torch.dtype | None = None) -> Path:
    """Write `out_path`: `artifact_in` plus the drafter in `drafter_folder` as the `variant` component
    ("dflash" or "dflash2"; None: as the checkpoint's `architectures` declares). Floating tensors are
    stored in `dtype` (default: the artifact's text dtype). Validated against the drafter's
    parameters (check_dflash_weights) and the trunk's shapes before anything is written."""
    art = Artifact(artifact_in)
    folder = Path(drafter_folder)
    config_path = folder / "config.json"
    if not config_path.exists():
        raise ValueError(f"{folder}: config.json is missing")
    config = dflash_config_from_hf(json.loads(config_path.read_text()), variant)
    variant = config["variant"]
    _check_against_trunk(config, art.config("text"))
    dtype = dtype or _text_dtype(art.manifest)
    drafter = _read_checkpoint(folder)
    if dtype is not None:
        drafter = {k: v.to(dtype) if v.is_floating_point() else v for k, v in drafter.items()}
    check_dflash_weights(config, drafter)

    kept = [c for c in art.manifest.components if c != variant]
    tensors = {f"{c}.{name}": t for c, group in art.load(kept).items() for name, t in group.items()}
    tensors.update({f"{variant}.{name}": t for name, t in drafter.items()})
    m = art.manifest
    stored = next(iter(drafter.values())).dtype
    manifest = Manifest(
        name=m.name, architecture=m.architecture, components={**m.components, variant: config},
        quantization={**m.quantization, variant: str(stored).removeprefix("torch.")},
        sampling_presets=m.sampling_presets, extra=m.extra,
    )
    out_path = Path(out_path)
    write_artifact(out_path, tensors, manifest, art.tokenizer_json, art.chat_template)
    return out_path
