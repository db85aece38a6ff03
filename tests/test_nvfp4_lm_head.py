"""Opt-in NVFP4 lm_head (quantize_model_(lm_head=True), `ninfer convert ... --nvfp4-lm-head`): the
head becomes an NVFP4Linear, a tied head (the embedding table) never does, artifacts record and load
it, and the benchmark counts its bytes.

Stated tolerances (tiny-qwen3.6, random N(0, 0.02) head, H = 64): the head's logits against the
unquantized head on the same hidden states have a relative RMS error of 0.095 (seeds 0, 1, 2: 0.095
each) -> bound 0.11, the quantizer's own bound in tests/test_nvfp4.py (a logit is a sum over K of
weight errors, so it inherits their relative size); max |error| / max |logit| 0.100-0.107 -> bound
0.2. Each logit is also within sum_k |h_k| * unit[n, k], unit being one block-scale step of the
weight (the quantizer's per-element bound), which holds exactly, not statistically.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_nvfp4 import TOKENS, _hf_folder, _logits, assert_engine_generates
from torch import nn

from ninfer.artifact.container import Artifact
from ninfer.artifact.presets import TINY_LLAMA_CONFIG, instantiate
from ninfer.forward import ForwardBatch, ModelCache
from ninfer.models import build_model, prepare_for_inference_
from ninfer.models.qwen3_5 import QWEN3_6_SHAPES
from ninfer.quant.nvfp4 import NVFP4Linear, NVFP4Weight, quantizable, quantize_model_, replace_with_nvfp4_

ROOT = Path(__file__).resolve().parent.parent


def _tiny(seed: int = 0, lm_head: bool = False) -> tuple[nn.Module, list[str]]:
    model = instantiate("tiny-qwen3.6", "cpu", torch.float32, seed=seed, fuse=False)
    names = quantize_model_(model, lm_head=lm_head)
    return prepare_for_inference_(model), names


def _hidden(model: nn.Module, tokens=TOKENS) -> torch.Tensor:
    cache = ModelCache(model.cache_spec(), num_pages=8, page_size=8, num_state_slots=1, dtype=torch.float32)
    batch = ForwardBatch.build([tokens], [0], [list(range(8))], 8)
    with torch.no_grad():
        return model(batch, cache)


def test_quantizable_admits_lm_head_only_when_asked():
    assert not quantizable("lm_head", 248320, 64)
    assert quantizable("lm_head", 248320, 64, lm_head=True)
    assert not quantizable("lm_head", 248320, 40, lm_head=True)  # K not a multiple of 16
    assert not quantizable("embed_tokens", 248320, 64, lm_head=True)
    assert not quantizable("mtp.lm_head", 248320, 64, lm_head=True)  # only the text model's own head


def test_lm_head_logits_stay_close_to_the_unquantized_head():
    plain, names = _tiny()
    model, names_head = _tiny(lm_head=True)
    assert type(plain.lm_head) is not NVFP4Linear and isinstance(model.lm_head, NVFP4Linear)
    assert names_head == names + ["lm_head"]  # the decoder is quantized the same way either way
    assert type(model.embed_tokens) is nn.Embedding and model.embed_tokens.weight.dtype == torch.float32
    hidden = _hidden(model)
    torch.testing.assert_close(hidden, _hidden(plain), rtol=0, atol=0)  # same decoder: only the head differs
    with torch.no_grad():
        ours, ref = model.compute_logits(hidden), plain.compute_logits(hidden)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape == (len(TOKENS), 248320)
    torch.testing.assert_close(ours, F.linear(hidden, model.lm_head.dequantize()), rtol=1e-6, atol=1e-6)
    err = ours - ref
    rel_rms = (err.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
    assert rel_rms < 0.11, rel_rms  # measured 0.095
    assert err.abs().max().item() < 0.2 * ref.abs().max().item()  # measured 0.103
    head = model.lm_head
    unit = (head.weight_scale.float() * head.weight_row_scale[:, None]).repeat_interleave(16, dim=1)
    assert (err.abs() <= hidden.abs() @ unit.T * (1 + 1e-5) + 1e-6).all()


def test_head_logits_go_through_the_head_in_gemv_sized_calls():
    """nvfp4_head_logits: at most 16 rows per call, else one call would dequantize the whole head."""
    model, _ = _tiny(lm_head=True)
    calls = []
    model.lm_head.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[0]))
    hidden = torch.randn(37, model.lm_head.in_features)
    with torch.no_grad():
        got = model.compute_logits(hidden)
        assert calls == [16, 16, 5]
    torch.testing.assert_close(got, F.linear(hidden, model.lm_head.dequantize()), rtol=1e-6, atol=1e-6)


def test_tied_embeddings_are_never_quantized():
    config = dict(QWEN3_6_SHAPES["tiny-qwen3.6"], tie_word_embeddings=True)
    model = build_model("qwen3_5", config)
    model.init_random_(0)
    names = quantize_model_(model, lm_head=True)
    assert model.lm_head is None and "lm_head" not in names and names  # the decoder still is
    assert type(model.embed_tokens) is nn.Embedding
    with pytest.raises(ValueError, match="'lm_head' is not in the model"):  # an artifact listing it
        replace_with_nvfp4_(model, ["lm_head"])
    llama = instantiate("tiny-llama", "cpu", torch.float32, fuse=False)  # tied: no lm_head attribute
    assert "lm_head" not in quantize_model_(llama, lm_head=True)
    assert type(llama.embed_tokens) is nn.Embedding


def test_untied_llama_head():
    model = build_model("llama", dict(TINY_LLAMA_CONFIG, tie_word_embeddings=False))
    model.init_random_(0)
    assert "lm_head" in quantize_model_(model, lm_head=True)
    prepare_for_inference_(model)
    hidden = torch.randn(3, TINY_LLAMA_CONFIG["hidden_size"], generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model.compute_logits(hidden), F.linear(hidden, model.lm_head.dequantize()),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match="NVFP4"):
        _ = model.output_weight


@pytest.fixture(scope="module")
def head_artifact(tmp_path_factory):
    from ninfer.cli import main

    path = tmp_path_factory.mktemp("nvfp4_head") / "tiny-head.ninfer"
    assert main(["convert", "synthetic", "--preset", "tiny-qwen3.6", "--weights", "nvfp4", "--nvfp4-lm-head",
                 "-o", str(path)]) == 0
    return path


def test_artifact_lists_and_loads_the_nvfp4_head(head_artifact):
    art = Artifact(head_artifact)
    assert "lm_head" in art.manifest.quantization["modules"]
    t = art.load()["text"]
    assert t["lm_head.weight_packed"].shape == (248320, 32) and "lm_head.weight" not in t
    assert t["embed_tokens.weight"].dtype == torch.float32
    logits, loaded = _logits(head_artifact)
    assert isinstance(loaded.lm_head, NVFP4Linear)
    model, _ = _tiny(lm_head=True)  # the same seed, quantized in memory
    with torch.no_grad():
        torch.testing.assert_close(logits, model.compute_logits(_hidden(model)), rtol=0, atol=1e-5)


def test_nvfp4_head_artifact_engine_generates(head_artifact):
    assert_engine_generates(head_artifact)


def test_convert_hf_flag_quantizes_a_bf16_head(tmp_path, tiny_qwen_path, head_artifact):
    """--weights nvfp4 --nvfp4-lm-head on a bf16 checkpoint: the same tensors as the synthetic path
    (the same random weights, the same quantizer)."""
    from ninfer.artifact.convert_hf import convert_hf

    src = Artifact(tiny_qwen_path).load()["text"]
    tensors = {(f"model.language_model.{k}" if k != "lm_head.weight" else k): v.contiguous() for k, v in src.items()}
    folder = _hf_folder(tmp_path / "dense", tensors, {})
    out = convert_hf(folder, tmp_path / "q.ninfer", dtype=torch.float32, progress=False, weights="nvfp4",
                     nvfp4_lm_head=True)
    expected = Artifact(head_artifact)
    assert Artifact(out).manifest.quantization["modules"] == expected.manifest.quantization["modules"]
    got, want = Artifact(out).load()["text"], expected.load()["text"]
    for leaf in ("weight_packed", "weight_scale", "weight_row_scale"):
        assert torch.equal(got[f"lm_head.{leaf}"].view(torch.uint8), want[f"lm_head.{leaf}"].view(torch.uint8))
    with pytest.raises(ValueError, match="needs weights='nvfp4'"):
        convert_hf(folder, tmp_path / "x.ninfer", progress=False, nvfp4_lm_head=True)  # weights="auto"


def test_convert_hf_keeps_a_checkpoint_nvfp4_head_only_with_the_flag(tmp_path, head_artifact):
    """A ModelOpt checkpoint whose lm_head is NVFP4: with the flag its codes and scales are kept as
    they are; without it (the default) the head is dequantized, as before."""
    from ninfer.artifact.convert_hf import convert_hf

    ours = Artifact(head_artifact).load()["text"]
    # only the head matters here: no decoder layers, so the conversions stay quick
    tensors = {f"model.language_model.{k}": v.contiguous() for k, v in ours.items()
               if not k.startswith(("layers.", "lm_head."))}
    tensors["lm_head.weight"] = ours["lm_head.weight_packed"]
    tensors["lm_head.weight_scale"] = ours["lm_head.weight_scale"]
    tensors["lm_head.weight_scale_2"] = ours["lm_head.weight_row_scale"][:1].reshape(())
    folder = _hf_folder(tmp_path / "modelopt", tensors, {"quant_method": "modelopt", "quant_algo": "NVFP4"})
    kept = convert_hf(folder, tmp_path / "kept.ninfer", dtype=torch.float32, progress=False, weights="nvfp4",
                      nvfp4_lm_head=True)
    assert Artifact(kept).manifest.quantization["modules"] == ["lm_head"]
    got = Artifact(kept).load()["text"]
    assert torch.equal(got["lm_head.weight_packed"], ours["lm_head.weight_packed"])
    assert torch.equal(got["lm_head.weight_scale"].view(torch.uint8), ours["lm_head.weight_scale"].view(torch.uint8))
    plain = convert_hf(folder, tmp_path / "plain.ninfer", dtype=torch.float32, progress=False)  # weights="auto"
    assert "weights" not in Artifact(plain).manifest.quantization
    head = NVFP4Linear.from_weights(NVFP4Weight(ours["lm_head.weight_packed"], ours["lm_head.weight_scale"],
                                                ours["lm_head.weight_row_scale"]))
    assert torch.equal(Artifact(plain).load()["text"]["lm_head.weight"], head.dequantize())


def test_cli_flag_needs_nvfp4_weights(tmp_path, capsys):
    from ninfer.artifact.presets import write_preset
    from ninfer.cli import main

    for argv in (["synthetic", "--preset", "tiny-qwen3.6"], ["hf", str(tmp_path), "--weights", "bf16"]):
        with pytest.raises(SystemExit) as exc:
            main(["convert", *argv, "--nvfp4-lm-head", "-o", str(tmp_path / "x.ninfer")])
        assert exc.value.code == 2
        assert "--nvfp4-lm-head needs --weights nvfp4" in capsys.readouterr().err
    assert not (tmp_path / "x.ninfer").exists()
    with pytest.raises(ValueError, match="needs weights='nvfp4'"):
        write_preset("tiny-qwen3.6", tmp_path / "x.ninfer", nvfp4_lm_head=True)


def _gpu_decode():
    spec = importlib.util.spec_from_file_location("gpu_decode", ROOT / "bench" / "gpu_decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_weight_stats_count_the_nvfp4_head():
    """bench/gpu_decode.py's weight_stats: the NVFP4 head's bytes (packed codes, block and row
    scales) replace the fp32 head's; the head stays out of the per-token matmul count either way."""
    weight_stats = _gpu_decode().weight_stats
    cfg = QWEN3_6_SHAPES["tiny-qwen3.6"]
    plain, head = (weight_stats(_tiny(lm_head=flag)[0], cfg) for flag in (False, True))
    n, k = cfg["vocab_size"], cfg["hidden_size"]
    nvfp4_bytes = n * k // 2 + n * k // 16 + 4 * n  # codes, E4M3 block scales, fp32 row scales
    assert plain["weight_bytes"] - head["weight_bytes"] == 4 * n * k - nvfp4_bytes
    assert plain["decode_bytes_b1"] - head["decode_bytes_b1"] == 4 * n * k - nvfp4_bytes
    assert head["matmul_params_per_token"] == plain["matmul_params_per_token"]
