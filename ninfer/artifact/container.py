"""The .ninfer v3 container: one safetensors file plus a JSON manifest in its metadata.

Layout of the safetensors metadata (a str -> str map):
  ninfer.format_version  "3"
  ninfer.manifest        JSON: name, architecture, components {name: config}, quantization
                         {tensor-group prefix: format}, sampling_presets, special token ids
  ninfer.tokenizer       the HF tokenizer.json text
  ninfer.chat_template   the Jinja chat template text

Tensors are named "<component>.<module path>", e.g. "text.layers.0.self_attn.q_proj.weight".
Reading memory-maps the file and materializes only the components asked for.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT_VERSION = 3
COMPONENTS = ("text", "vision", "mtp", "dflash", "dflash2", "draft_head")
_KEY_VERSION = "ninfer.format_version"
_KEY_MANIFEST = "ninfer.manifest"
_KEY_TOKENIZER = "ninfer.tokenizer"
_KEY_TEMPLATE = "ninfer.chat_template"
# safetensors refuses headers above 100 MB; a Qwen tokenizer.json is ~12 MB.
_MAX_HEADER_BYTES = 100_000_000


class ArtifactError(ValueError):
    """A .ninfer file cannot be used; the message names the file and the problem."""

    def __init__(self, path: str | os.PathLike, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem


@dataclass
class Manifest:
    name: str
    architecture: str
    components: dict[str, dict[str, Any]]
    quantization: dict[str, Any] = field(default_factory=dict)
    sampling_presets: dict[str, dict[str, float]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(
            {
                "name": self.name,
                "architecture": self.architecture,
                "components": self.components,
                "quantization": self.quantization,
                "sampling_presets": self.sampling_presets,
                "extra": self.extra,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        raw = json.loads(text)
        return cls(
            name=raw.get("name") or "",
            architecture=raw["architecture"],
            components=raw["components"],
            quantization=raw.get("quantization", {}),
            sampling_presets=raw.get("sampling_presets", {}),
            extra=raw.get("extra", {}),
        )


def write_artifact(
    path: str | os.PathLike,
    tensors: dict[str, torch.Tensor],
    manifest: Manifest,
    tokenizer_json: str,
    chat_template: str,
) -> None:
    """Write tensors and metadata atomically (temp file, then rename)."""
    for name in tensors:
        component = name.split(".", 1)[0]
        if component not in COMPONENTS:
            raise ValueError(f"tensor {name!r} has no known component prefix {COMPONENTS}")
        if component not in manifest.components:
            raise ValueError(f"tensor {name!r} belongs to component {component!r} missing from the manifest")
    metadata = {
        _KEY_VERSION: str(FORMAT_VERSION),
        _KEY_MANIFEST: manifest.to_json(),
        _KEY_TOKENIZER: tokenizer_json,
        _KEY_TEMPLATE: chat_template,
    }
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    contiguous = {k: v.contiguous() for k, v in tensors.items()}
    save_file(contiguous, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def _read_header(path: Path) -> dict[str, Any]:
    """Parse and sanity-check the safetensors header before handing the file to the mmap reader."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ArtifactError(path, "file does not exist") from None
    if path.is_dir():
        raise ArtifactError(path, "is a directory, not a .ninfer file")
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ArtifactError(path, f"not a .ninfer artifact (file is only {size} bytes)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len == 0 or header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
            raise ArtifactError(path, "not a .ninfer artifact (no safetensors header), or the file is truncated")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ArtifactError(path, "not a .ninfer artifact (safetensors header is not JSON)") from None
    if not isinstance(header, dict):
        raise ArtifactError(path, "not a .ninfer artifact (safetensors header is not an object)")
    data_end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise ArtifactError(path, f"corrupt header entry for tensor {name!r}") from None
        data_end = max(data_end, int(end))
    if 8 + header_len + data_end > size:
        missing = 8 + header_len + data_end - size
        raise ArtifactError(path, f"file is truncated: {missing} bytes of tensor data are missing")
    return header


class Artifact:
    """A memory-mapped .ninfer file. Tensors are read lazily, per component."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        header = _read_header(self.path)
        meta = header.get("__metadata__") or {}
        if _KEY_VERSION not in meta:
            raise ArtifactError(self.path, "safetensors file without ninfer metadata: not a .ninfer artifact")
        version = meta[_KEY_VERSION]
        if version != str(FORMAT_VERSION):
            raise ArtifactError(
                self.path, f"unsupported .ninfer format version {version} (this build reads version {FORMAT_VERSION})"
            )
        for key in (_KEY_MANIFEST, _KEY_TOKENIZER, _KEY_TEMPLATE):
            if key not in meta:
                raise ArtifactError(self.path, f"metadata key {key!r} is missing")
        try:
            self.manifest = Manifest.from_json(meta[_KEY_MANIFEST])
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ArtifactError(self.path, f"manifest is corrupt ({exc})") from None
        self.tokenizer_json: str = meta[_KEY_TOKENIZER]
        self.chat_template: str = meta[_KEY_TEMPLATE]
        self.tensor_names = [k for k in header if k != "__metadata__"]

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def architecture(self) -> str:
        return self.manifest.architecture

    @property
    def public_name(self) -> str:
        """metadata.name, falling back to the architecture when no name is stored (contract: --model-id)."""
        return self.manifest.name or self.manifest.architecture

    def has_component(self, component: str) -> bool:
        return component in self.manifest.components

    def config(self, component: str = "text") -> dict[str, Any]:
        if component not in self.manifest.components:
            raise ArtifactError(self.path, f"component {component!r} was requested but the artifact has none")
        return self.manifest.components[component]

    def load(
        self, components: Iterable[str] = ("text",), device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Materialize the selected components; returns {component: {name without prefix: tensor}}.

        Floating tensors are cast to `dtype` when given; quantized (integer / fp8) tensors keep theirs.
        """
        wanted = list(dict.fromkeys(["text", *components]))
        for component in wanted:
            self.config(component)  # raises a clear error when missing
        out: dict[str, dict[str, torch.Tensor]] = {c: {} for c in wanted}
        device = str(device)
        try:
            with safe_open(str(self.path), framework="pt", device=device) as f:
                for name in self.tensor_names:
                    component, rest = name.split(".", 1)
                    if component not in out:
                        continue
                    tensor = f.get_tensor(name)
                    if dtype is not None and tensor.is_floating_point() and tensor.element_size() >= 2:
                        tensor = tensor.to(dtype)
                    out[component][rest] = tensor
        except ArtifactError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt data
            raise ArtifactError(self.path, f"cannot read tensors ({exc})") from exc
        return out
