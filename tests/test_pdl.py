"""The PDL switch (ninfer.kernels.pdl): where kernels launch with programmatic dependent launch.
On the GPU, test_kernels checks that it changes no output."""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels.pdl import pdl_enabled, pdl_launch


def test_pdl_is_off_on_cpu():
    assert not pdl_enabled(torch.device("cpu"))
    assert pdl_launch(torch.device("cpu")) == {}  # the kernels' USE_PDL default (False) and a plain launch


def test_env_turns_pdl_off(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # compiled kernels: only the switch says no
    monkeypatch.setenv("NINFER_PDL", "0")
    assert not pdl_enabled(torch.device("cuda"))  # decided before any CUDA query (none on a CPU host)


def test_this_triton_offers_pdl():
    """The pinned Triton range starts at 3.2, which lacks PDL, so the switch checks the installed
    Triton for the griddepcontrol helpers and the launch option. 3.6 (CI, the device) has both: a
    check that said no would turn PDL off on the GPU without a word."""
    import triton

    from ninfer.kernels.pdl import _triton_has_pdl

    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 6):
        pytest.skip(f"triton {triton.__version__}: PDL support is not asserted before 3.6")
    assert _triton_has_pdl()
