"""Context-cost coefficients: what bringing a paused request back costs by each route, so a pause takes the cheaper
one (contract, "Server options": --context-cost-presets).

The snapshot route copies the request's context to the host and back: its bytes over the device-to-host and
host-to-device bandwidths. The replay route recomputes the request's committed tokens: their count over the prefill
rate. A pause takes the snapshot route only where host room allows it and it costs less than replay.

Coefficients resolve once at startup: generic defaults for the device type, replaced by the entries of
--context-cost-presets FILE that match this hardware (transfer) and, for prefill, this hardware and the engine's
prefill signature (the model, its weight and KV formats, the prefill chunk, vision). A malformed file aborts
startup. The file is JSON:

    {"transfer": [{"hardware": "NVIDIA H200", "d2h_gib_per_s": 24.0, "h2d_gib_per_s": 25.0}],
     "prefill": [{"hardware": "NVIDIA H200", "signature": "Qwen35ForCausalLM/bfloat16/kv-fp8/chunk1024",
                  "tokens_per_s": 9000}]}

`ninfer serve --help` and the engine's startup record name the signature to measure against.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass

import torch

GIB = float(1 << 30)
# Generic coefficients: pinned PCIe copies on a GPU host and a mid-size model's prefill rate there; a memcpy and a
# small model's prefill on the CPU. A measured file entry replaces them.
GENERIC = {"cuda": {"d2h_gib_per_s": 20.0, "h2d_gib_per_s": 20.0, "tokens_per_s": 4000.0},
           "cpu": {"d2h_gib_per_s": 5.0, "h2d_gib_per_s": 5.0, "tokens_per_s": 200.0}}


@dataclass(frozen=True)
class ContextCosts:
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    prefill_tokens_per_s: float
    hardware: str
    signature: str
    transfer_source: str  # "generic" or "presets:FILE"
    prefill_source: str

    def snapshot_seconds(self, nbytes: int) -> float:
        """To the host at the pause and back at the restore."""
        return nbytes / self.d2h_bytes_per_s + nbytes / self.h2d_bytes_per_s

    def replay_seconds(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def hardware_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name (Linux), else its architecture."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def resolve(device: torch.device, signature: str, presets_path: str | None) -> ContextCosts:
    """The coefficients for this engine: generic ones for its device type, replaced by matching file entries."""
    generic = GENERIC["cuda" if device.type == "cuda" else "cpu"]
    hardware = hardware_name(device)
    d2h, h2d, rate = generic["d2h_gib_per_s"], generic["h2d_gib_per_s"], generic["tokens_per_s"]
    transfer_source = prefill_source = "generic"
    if presets_path is not None:
        from ninfer.engine.context_cost_registry import read_presets  # pydantic: only where a file is given

        presets = read_presets(presets_path)
        source = f"presets:{presets_path}"
        transfer = next((e for e in presets.transfer if e.hardware == hardware), None)
        if transfer is not None:
            d2h, h2d, transfer_source = transfer.d2h_gib_per_s, transfer.h2d_gib_per_s, source
        prefill = next((e for e in presets.prefill if e.hardware == hardware and e.signature == signature), None)
        if prefill is not None:
            rate, prefill_source = prefill.tokens_per_s, source
    return ContextCosts(d2h * GIB, h2d * GIB, rate, hardware, signature, transfer_source, prefill_source)


def storage_dtypes(model: torch.nn.Module) -> list[str]:
    """The dtypes its tensors are stored in (quantized weights are buffers), sorted."""
    return sorted({str(t.dtype).removeprefix("torch.") for t in (*model.parameters(), *model.buffers())})


def prefill_signature(model: torch.nn.Module, kv_dtype: str, prefill_chunk: int, vision: bool) -> str:
    """What a prefill rate was measured for: the model class, its storage dtypes, the KV format, the chunk, vision."""
    dtypes = "+".join(storage_dtypes(model)) or "none"
    return f"{type(model).__name__}/{dtypes}/kv-{kv_dtype}/chunk{prefill_chunk}" + ("/vision" if vision else "")
