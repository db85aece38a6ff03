"""Skip markers shared by the kernel tests: Triton kernels run on CPU tensors through Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 when there is no CUDA device)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
needs_interpreter = pytest.mark.skipif(
    not INTERPRET, reason="Triton kernels on CPU need triton installed and TRITON_INTERPRET=1")
