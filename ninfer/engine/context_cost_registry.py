"""The --context-cost-presets file (ninfer.engine.context_cost): its schema and reader. Apart from the cost model
so that an engine started without the option (the GPU host's benchmarks) never imports pydantic."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TransferEntry(_Strict):
    hardware: str = Field(min_length=1)
    d2h_gib_per_s: float = Field(gt=0)
    h2d_gib_per_s: float = Field(gt=0)


class PrefillEntry(_Strict):
    hardware: str = Field(min_length=1)
    signature: str = Field(min_length=1)
    tokens_per_s: float = Field(gt=0)


class PresetFile(_Strict):
    transfer: list[TransferEntry] = []
    prefill: list[PrefillEntry] = []


class ContextCostError(ValueError):
    """--context-cost-presets names a file that cannot be read or does not hold a valid registry."""


def read_presets(path: str) -> PresetFile:
    try:
        text = Path(path).expanduser().read_text()
    except OSError as exc:
        raise ContextCostError(f"--context-cost-presets {path}: cannot read it ({exc.strerror})") from None
    try:
        return PresetFile.model_validate(json.loads(text))
    except json.JSONDecodeError as exc:
        raise ContextCostError(f"--context-cost-presets {path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ContextCostError(f"--context-cost-presets {path}: {where}: {first['msg']}") from None
