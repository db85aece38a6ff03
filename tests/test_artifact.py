"""The .ninfer v3 container: round trip, lazy component loading and clear failures."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from ninfer.artifact.container import Artifact, ArtifactError, Manifest, write_artifact


def _write(path, components=("text",), **manifest_kw):
    tensors = {"text.w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    if "mtp" in components:
        tensors["mtp.fc.weight"] = torch.ones(2, 2, dtype=torch.bfloat16)
    manifest = Manifest(name=manifest_kw.get("name", "demo"), architecture="llama",
                        components={c: {"hidden_size": 3} for c in components},
                        quantization={c: "fp32" for c in components},
                        sampling_presets={"thinking": {"temperature": 0.6}})
    write_artifact(path, tensors, manifest, '{"version": "1.0"}', "{{ messages }}")
    return path


def test_round_trip_and_selected_components(tmp_path):
    path = _write(tmp_path / "a.ninfer", components=("text", "mtp"))
    art = Artifact(path)
    assert art.name == "demo" and art.architecture == "llama" and art.public_name == "demo"
    assert art.chat_template == "{{ messages }}" and json.loads(art.tokenizer_json) == {"version": "1.0"}
    assert art.manifest.sampling_presets["thinking"]["temperature"] == 0.6
    text_only = art.load()
    assert set(text_only) == {"text"}  # MTP not materialized unless asked
    assert torch.equal(text_only["text"]["w"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    both = art.load(["mtp"], dtype=torch.float32)
    assert both["mtp"]["fc.weight"].dtype == torch.float32


def test_public_name_falls_back_to_architecture(tmp_path):
    art = Artifact(_write(tmp_path / "a.ninfer", name=""))
    assert art.public_name == "llama"


def test_missing_requested_component_names_file_and_component(tmp_path):
    path = _write(tmp_path / "a.ninfer")
    with pytest.raises(ArtifactError, match=r"a\.ninfer: component 'vision' was requested"):
        Artifact(path).load(["vision"])


def test_wrong_version(tmp_path):
    path = tmp_path / "old.ninfer"
    save_file({"text.w": torch.zeros(1)}, str(path), metadata={"ninfer.format_version": "2"})
    with pytest.raises(ArtifactError, match=r"old\.ninfer: unsupported \.ninfer format version 2"):
        Artifact(path)


def test_plain_safetensors_is_not_an_artifact(tmp_path):
    path = tmp_path / "plain.safetensors"
    save_file({"w": torch.zeros(1)}, str(path))
    with pytest.raises(ArtifactError, match="not a .ninfer artifact"):
        Artifact(path)


def test_random_bytes_are_not_an_artifact(tmp_path):
    path = tmp_path / "junk.ninfer"
    path.write_bytes(b"GGUF" + bytes(range(200)))
    with pytest.raises(ArtifactError, match=r"junk\.ninfer: not a .ninfer artifact"):
        Artifact(path)


def test_truncated_file(tmp_path):
    path = _write(tmp_path / "t.ninfer")
    data = path.read_bytes()
    path.write_bytes(data[:-5])
    with pytest.raises(ArtifactError, match=r"t\.ninfer: file is truncated: 5 bytes"):
        Artifact(path)


def test_corrupt_header(tmp_path):
    path = tmp_path / "c.ninfer"
    header = b"{not json"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(ArtifactError, match="header is not JSON"):
        Artifact(path)


def test_missing_file(tmp_path):
    with pytest.raises(ArtifactError, match="does not exist"):
        Artifact(tmp_path / "nope.ninfer")


def test_tensor_outside_known_components_is_refused(tmp_path):
    manifest = Manifest(name="x", architecture="llama", components={"text": {}})
    with pytest.raises(ValueError, match="no known component prefix"):
        write_artifact(tmp_path / "x.ninfer", {"other.w": torch.zeros(1)}, manifest, "{}", "")
