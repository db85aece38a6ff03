"""The PDL switch (ninfer.kernels.pdl): where kernels launch with programmatic dependent launch.
On the GPU, test_kernels checks that it changes no output."""

from __future__ import annotations

import torch

from ninfer.kernels.pdl import pdl_enabled, pdl_launch


def test_pdl_is_off_on_cpu():
    assert not pdl_enabled(torch.device("cpu"))
    assert pdl_launch(torch.device("cpu")) == {}  # the kernels' USE_PDL default (False) and a plain launch


def test_env_turns_pdl_off(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # compiled kernels: only the switch says no
    monkeypatch.setenv("NINFER_PDL", "0")
    assert not pdl_enabled(torch.device("cuda"))  # decided before any CUDA query (none on a CPU host)
