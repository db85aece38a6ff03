"""Which kernel backend runs an op: the CUDA one for CUDA tensors when it can, else the torch reference.

- Paged attention, the conv1d of Gated DeltaNet and its recurrent decode step: our Triton kernels
  (need `triton`).
- Chunked Gated DeltaNet for prefill: fla-core's Triton kernels (need `fla` importable).
- `NINFER_KERNELS=reference` forces the torch references everywhere (read at every call, so tests
  and benchmarks can flip it); unset or `auto` picks per tensor.

CPU tensors always take the reference. The Triton kernels can still be run on CPU tensors under
`TRITON_INTERPRET=1` by calling their modules directly (tests/test_kernels.py does).
"""

from __future__ import annotations

import functools
import os

import torch

ENV_VAR = "NINFER_KERNELS"


def forced_reference() -> bool:
    return os.environ.get(ENV_VAR, "").strip().lower() == "reference"


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


@functools.cache
def fla_available() -> bool:
    if not triton_available():
        return False
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception:
        return False
    return True


def _on_cuda(t: torch.Tensor | torch.device | str) -> bool:
    device = t.device if isinstance(t, torch.Tensor) else torch.device(t)
    return device.type == "cuda"


def use_triton(t: torch.Tensor | torch.device | str) -> bool:
    """Our Triton kernels (attention, conv1d, recurrent GDN decode) for this tensor/device."""
    return _on_cuda(t) and not forced_reference() and triton_available()


def use_fla(t: torch.Tensor | torch.device | str) -> bool:
    """fla-core's chunked Gated DeltaNet for this tensor/device."""
    return _on_cuda(t) and not forced_reference() and fla_available()


def describe(device: torch.device | str) -> dict[str, str]:
    """Backend of each op on `device`, for logs and benchmark records."""
    tri = "triton" if use_triton(device) else "reference"
    return {
        "paged_attention": tri,
        "gdn_chunk": "fla" if use_fla(device) else "reference",
        "gdn_recurrent": tri,
        "conv1d": tri,
    }
