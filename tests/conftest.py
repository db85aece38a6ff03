"""Shared fixtures: each tiny artifact and tokenizer is built once per test run."""

from __future__ import annotations

import os

import pytest
import torch

from ninfer.tokenizer import Tokenizer

# Without a GPU, our Triton kernels run on CPU tensors in Triton's interpreter (tests/test_kernels.py,
# tests/test_kv_dtype.py). triton.jit reads TRITON_INTERPRET when a kernel module is imported, so it
# must be set here, before any `ninfer.kernels.triton_*` import. Model code on CPU never calls Triton
# (`backend.use_triton` needs CUDA tensors), so nothing else changes.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (the README's `make test` runs two workers) each worker computes on one thread: two
# workers of two torch threads each on two cores would only take turns.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER and not torch.cuda.is_available():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def qwen_tokenizer() -> Tokenizer:
    from ninfer.artifact.qwen_tokenizer import build_qwen_tokenizer_json

    return Tokenizer.from_json_str(build_qwen_tokenizer_json())


@pytest.fixture(scope="session")
def artifacts_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("artifacts")


def _preset_artifact(name: str, folder):
    from ninfer.artifact.presets import write_preset

    return write_preset(name, folder / f"{name}.ninfer", seed=0)


@pytest.fixture(scope="session")
def tiny_llama_path(artifacts_dir):
    return _preset_artifact("tiny-llama", artifacts_dir)


@pytest.fixture(scope="session")
def tiny_qwen_path(artifacts_dir):
    return _preset_artifact("tiny-qwen3.6", artifacts_dir)


@pytest.fixture(scope="session")
def tiny_qwen_mtp_path(artifacts_dir):
    """tiny-qwen3.6 with a random MTP head (the `mtp` component): the speculative tests' artifact."""
    from ninfer.artifact.presets import write_preset

    return write_preset("tiny-qwen3.6", artifacts_dir / "tiny-qwen3.6-mtp.ninfer", seed=0, mtp=True)


@pytest.fixture(scope="session")
def tiny_qwen_moe_path(artifacts_dir):
    return _preset_artifact("tiny-qwen3.6-moe", artifacts_dir)


@pytest.fixture(scope="session")
def smollm2_path(artifacts_dir, tmp_path_factory):
    """Exactly what `make serve` builds. Converting the GGUF takes ~20 s, so xdist's workers share one: the first
    converts it into the run's common folder while the others wait on the lock."""
    from filelock import FileLock

    from ninfer.cli import build_default

    folder = tmp_path_factory.getbasetemp().parent if XDIST_WORKER else artifacts_dir
    with FileLock(str(folder / "smollm2.lock")):
        return build_default(folder / "smollm2-135m-instruct.ninfer")  # reuses one that exists


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`-n 2 --dist loadgroup`), the tests that start a Ray instance run on one worker, one
    after the other: two local Ray clusters at once would contend for the same two cores and ports."""
    for item in items:
        if item.get_closest_marker("ray"):
            item.add_marker(pytest.mark.xdist_group("ray"))
