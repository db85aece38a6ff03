"""Shared fixtures: each tiny artifact and tokenizer is built once per test run."""

from __future__ import annotations

import pytest

from ninfer.tokenizer import Tokenizer


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
def tiny_qwen_moe_path(artifacts_dir):
    return _preset_artifact("tiny-qwen3.6-moe", artifacts_dir)


@pytest.fixture(scope="session")
def smollm2_path(artifacts_dir):
    from ninfer.cli import build_default

    return build_default(artifacts_dir / "smollm2-135m-instruct.ninfer")  # exactly what `make serve` builds
