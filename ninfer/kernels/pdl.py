"""Programmatic dependent launch (PDL, Hopper and later) for our Triton kernels.

A decode step is ~1,000 short kernels in a row, each a few microseconds: between two of them the
GPU drains the first kernel's last wave, then launches the next one, whose first loads wait a full
memory latency. With PDL a kernel is launched while its predecessor still runs; it may do work that
depends on nothing the predecessor writes (a GEMV loads its first weight tiles) and then waits at
`griddepcontrol.wait` until the predecessor has finished and its writes are visible. It also lets
its own successor launch early (`griddepcontrol.launch_dependents`). CUDA graphs keep these
programmatic edges when the step is captured.

The rule that keeps this correct: a kernel launched with PDL calls `pdl_wait` on every path before
it reads anything an earlier kernel wrote and before it writes anything at all, so its completion
still implies its predecessors' (the chain stays ordered through kernels that trigger early).
Kernels take a `USE_PDL: tl.constexpr` flag; `pdl_launch(device)` gives the flag and the launch
option together, or nothing where PDL is off: CPU, the interpreter, GPUs before Hopper, a Triton
without PDL (before 3.3), or NINFER_PDL=0.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ninfer.kernels.triton_compat import interpreting

_ON = {"USE_PDL": True, "launch_pdl": True}
_OFF: dict = {}


def _triton_has_pdl() -> bool:
    """Triton >= 3.3 has the griddepcontrol helpers and the launch option (pyproject allows 3.2)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except Exception:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.cache
def _enabled(device_index: int | None, flag: str, interpret: bool) -> bool:
    if flag == "0" or interpret or not _triton_has_pdl():
        return False
    index = device_index if device_index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (CUDA, compute capability >= 9, NINFER_PDL != 0)."""
    if device.type != "cuda":
        return False
    return _enabled(device.index, os.environ.get("NINFER_PDL", "1"), interpreting())


def pdl_launch(device: torch.device) -> dict:
    """Launch keywords: the kernel's USE_PDL flag and Triton's launch_pdl option, or none (defaults off).
    Called at every launch (eager steps issue hundreds): two environment reads and a cached answer."""
    return _ON if pdl_enabled(device) else _OFF


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait until the kernels this one depends on have finished and their writes are visible."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_release(USE_PDL: tl.constexpr):
    """Let the next kernel launch now (it waits for this one before touching shared data)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """A kernel with nothing to prefetch: wait for its inputs, then let the next kernel launch."""
    pdl_wait(USE_PDL)
    pdl_release(USE_PDL)
