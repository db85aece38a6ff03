"""`ninfer convert hf`: Hugging Face folders (Llama, Qwen3.5 dense VLM layout with MTP, Qwen3.5 MoE)
become artifacts whose model reproduces transformers' logits."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from ninfer.artifact.container import Artifact
from ninfer.artifact.convert_hf import convert_hf
from ninfer.engine.loader import load_model, load_mtp_head, load_vision_tower
from ninfer.forward import ForwardBatch, ModelCache

TOKENIZER_STUB = json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []}})


def _save_folder(folder, hf_model, config: dict, extra_tensors: dict | None = None, rename=None):
    folder.mkdir()
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    if rename:
        state = {rename(k): v for k, v in state.items()}
    state.update(extra_tensors or {})
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text(TOKENIZER_STUB)
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))


def _our_logits(path, tokens):
    art = Artifact(path)
    model = load_model(art, torch.device("cpu"), torch.float32)
    cache = ModelCache(model.cache_spec(), num_pages=8, page_size=8, num_state_slots=1, dtype=torch.float32)
    batch = ForwardBatch.build([tokens], [0], [list(range(8))], 8)
    batch.logits_indices = torch.arange(len(tokens))
    with torch.no_grad():
        return model.compute_logits(model(batch, cache)), art


def _hf_logits(hf_model, tokens):
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def test_llama_folder(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    hf = LlamaForCausalLM(cfg).eval()
    _save_folder(tmp_path / "llama-tiny", hf, cfg.to_dict())
    out = convert_hf(tmp_path / "llama-tiny", tmp_path / "l.ninfer", dtype=torch.float32, progress=False)
    tokens = [3, 17, 42, 99, 7]
    ours, art = _our_logits(out, tokens)
    assert art.architecture == "llama" and art.name == "llama-tiny"
    assert art.manifest.extra["eos_token_ids"] == [5, 6]
    assert art.chat_template == "{{ messages }}"  # non-Qwen: the checkpoint's own template
    torch.testing.assert_close(ours, _hf_logits(hf, tokens), atol=1e-4, rtol=0)


# a tiny Qwen3.5 vision_config as config.json carries it (out_hidden_size = the text hidden size)
TINY_HF_VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
                      num_position_embeddings=64, spatial_merge_size=2, patch_size=16, temporal_patch_size=2)


def _hf_visual_weights(seed: int = 3) -> dict[str, torch.Tensor]:
    """transformers' Qwen3_5VisionModel at TINY_HF_VISION, random, named as a VLM checkpoint names it."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    torch.manual_seed(seed)
    hf = Qwen3_5VisionModel(Qwen3_5VisionConfig(**TINY_HF_VISION))
    return {f"model.visual.{k}": torch.randn_like(v) for k, v in hf.state_dict().items()}


def _small_qwen_config(moe: bool) -> dict:
    cfg = dict(vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=False,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    if moe:
        cfg.update(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
                   num_experts_per_tok=2)
    else:
        cfg.update(intermediate_size=96)
    return cfg


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_qwen_vlm_layout_with_mtp(tmp_path, moe):
    if moe:
        from transformers import Qwen3_5MoeForCausalLM as HFModel
        from transformers import Qwen3_5MoeTextConfig as HFConfig
    else:
        from transformers import Qwen3_5ForCausalLM as HFModel
        from transformers import Qwen3_5TextConfig as HFConfig

    torch.manual_seed(1)
    text_cfg = _small_qwen_config(moe)
    hf = HFModel(HFConfig(**text_cfg)).eval()
    head_weights = _mtp_weights(text_cfg)
    mtp = _checkpoint_mtp(head_weights)
    if moe:  # a marked expert: checks the per-expert -> fused order below
        for j in range(4):
            mtp[f"mtp.layers.0.mlp.experts.{j}.gate_proj.weight"].fill_(float(j))
            mtp[f"mtp.layers.0.mlp.experts.{j}.up_proj.weight"].fill_(float(j))
    model_type = "qwen3_5_moe" if moe else "qwen3_5"
    config = {"model_type": model_type, "architectures": ["Qwen3_5ForConditionalGeneration"],
              "text_config": {**text_cfg, "model_type": f"{model_type}_text", "mtp_num_hidden_layers": 1},
              "vision_config": {**TINY_HF_VISION, "model_type": f"{model_type}_vision"}}
    visual = _hf_visual_weights()

    def vlm_name(k: str) -> str:
        return k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k

    _save_folder(tmp_path / "qwen-tiny", hf, config, {**mtp, **visual}, rename=vlm_name)
    out = convert_hf(tmp_path / "qwen-tiny", tmp_path / "q.ninfer", dtype=torch.float32, progress=False)
    tokens = [1, 200, 33, 4, 150, 9, 77]
    ours, art = _our_logits(out, tokens)
    torch.testing.assert_close(ours, _hf_logits(hf, tokens), atol=2e-4, rtol=0)
    assert art.has_component("mtp") and art.has_component("vision")
    assert "maintained Qwen3.6 chat template" in art.chat_template
    assert art.manifest.extra["skipped_components"] == []
    tower = load_vision_tower(art, torch.device("cpu"), torch.float32)
    assert tower.config.out_hidden_size == 64 and tower.config.depth == 2
    stored = {k.removeprefix("model.visual."): v for k, v in visual.items()}
    assert tower.state_dict().keys() == stored.keys()
    for k, v in tower.state_dict().items():
        assert torch.equal(v, stored[k]), k
    assert art.manifest.sampling_presets["thinking"]["top_k"] == 20
    mtp_weights = art.load(["mtp"])["mtp"]
    assert "fc.weight" in mtp_weights
    if moe:
        fused = mtp_weights["layers.0.mlp.experts.gate_up_proj"]
        assert fused.shape == (4, 64, 64) and fused[2, 0, 0] == 2.0 and fused[3, 40, 0] == 3.0
        assert mtp_weights["layers.0.mlp.experts.down_proj"].shape == (4, 64, 32)
        head_weights["layers.0.mlp.experts.gate_up_proj"] = fused  # the marked values
    assert art.config("mtp")["hidden_size"] == 64 and art.config("mtp")["num_hidden_layers"] == 1
    assert bool(art.config("mtp").get("num_experts")) == moe
    trunk = load_model(art, torch.device("cpu"), torch.float32)
    head = load_mtp_head(art, trunk, torch.device("cpu"), torch.float32)
    loaded = head.state_dict()
    assert loaded.keys() == head_weights.keys()
    for k, v in loaded.items():
        assert torch.equal(v, head_weights[k]), k
    assert head.trunk is trunk and head.fc.weight.dtype == torch.float32
    _drafts_run(trunk, head)


def _mtp_weights(text_cfg: dict) -> dict[str, torch.Tensor]:
    """A random MTP head at the text config's shape, in our (fused-expert) names."""
    from ninfer.models.mtp import MTPHead, mtp_config_from_text
    from ninfer.models.qwen3_5 import text_config_from_hf

    head = MTPHead(mtp_config_from_text(text_config_from_hf(text_cfg)))
    return {k: torch.randn_like(v) * 0.1 for k, v in head.state_dict().items()}


def _checkpoint_mtp(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Named as real checkpoints store the MTP head: `mtp.*`, routed experts per expert (BF16 exports)."""
    out = {}
    for name, tensor in weights.items():
        if name.endswith("experts.gate_up_proj"):
            prefix, inter = name[: -len(".gate_up_proj")], tensor.shape[1] // 2
            for j in range(tensor.shape[0]):
                out[f"mtp.{prefix}.{j}.gate_proj.weight"] = tensor[j, :inter].clone()
                out[f"mtp.{prefix}.{j}.up_proj.weight"] = tensor[j, inter:].clone()
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for j in range(tensor.shape[0]):
                out[f"mtp.{prefix}.{j}.down_proj.weight"] = tensor[j].clone()
        else:
            out[f"mtp.{name}"] = tensor
    return out


@torch.no_grad()
def _drafts_run(trunk, head, k: int = 2):
    """The loaded head drafts from the loaded trunk's hidden states (shapes and finiteness only:
    tests/test_mtp.py checks the numbers)."""
    cache = ModelCache(trunk.cache_spec(), num_pages=8, page_size=8, num_state_slots=1, dtype=torch.float32)
    head_cache = ModelCache(head.cache_spec(), num_pages=8, page_size=8, num_state_slots=1, dtype=torch.float32)
    tokens = [1, 200, 33, 4]
    batch = ForwardBatch.build([tokens], [0], [list(range(8))], 8)
    hidden = trunk(batch, cache)
    step0 = ForwardBatch.build([tokens[1:] + [5]], [0], [list(range(8))], 8)
    drafts = head.propose(step0, head_cache, step0.input_ids, hidden, k)
    assert drafts.shape == (1, k) and ((0 <= drafts) & (drafts < trunk.config["vocab_size"])).all()


def test_a_partial_mtp_head_fails_conversion(tmp_path):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(1)
    text_cfg = _small_qwen_config(False)
    hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text_cfg)).eval()
    mtp = _checkpoint_mtp(_mtp_weights(text_cfg))
    del mtp["mtp.pre_fc_norm_hidden.weight"]
    config = {"model_type": "qwen3_5", "text_config": {**text_cfg, "model_type": "qwen3_5_text"}}
    _save_folder(tmp_path / "q", hf, config, mtp,
                 rename=lambda k: k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k)
    with pytest.raises(ValueError, match="MTP weights .* missing \\['pre_fc_norm_hidden.weight'\\]"):
        convert_hf(tmp_path / "q", tmp_path / "q.ninfer", dtype=torch.float32, progress=False)


@pytest.mark.parametrize("preset", ["tiny-qwen3.6", "tiny-qwen3.6-moe"])
def test_tiny_preset_with_an_mtp_head(tmp_path, preset):
    from ninfer.artifact.presets import write_preset

    art = Artifact(write_preset(preset, tmp_path / "t.ninfer", mtp=True, seed=3))
    assert art.manifest.quantization["mtp"] == "float32"
    trunk = load_model(art, torch.device("cpu"), torch.float32)
    assert not any(n.startswith("mtp") for n in trunk.state_dict())  # the text model loads as before
    head = load_mtp_head(art, trunk, torch.device("cpu"), torch.float32)
    assert head.fc.weight.std() > 0.01 and torch.equal(head.norm.weight, torch.zeros(64))
    _drafts_run(trunk, head)
    with pytest.raises(ValueError, match="no MTP head"):
        write_preset("tiny-llama", tmp_path / "l.ninfer", mtp=True)


def _tiny_qwen_folder(folder, visual: dict, vision_config: dict | None):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(1)
    text_cfg = _small_qwen_config(False)
    hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text_cfg)).eval()
    config = {"model_type": "qwen3_5", "text_config": {**text_cfg, "model_type": "qwen3_5_text"}}
    if vision_config is not None:
        config["vision_config"] = vision_config
    _save_folder(folder, hf, config, visual,
                 rename=lambda k: k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k)


def test_vision_tower_converts_at_the_target_dtype_and_runs(tmp_path):
    visual = _hf_visual_weights()
    _tiny_qwen_folder(tmp_path / "vlm", visual, TINY_HF_VISION)
    out = convert_hf(tmp_path / "vlm", tmp_path / "v.ninfer", dtype=torch.bfloat16, progress=False)
    art = Artifact(out)
    assert art.config("vision")["rope_parameters"] == {"rope_type": "axial", "rope_theta": 10000.0}
    assert art.manifest.quantization["vision"] == "bfloat16"
    tower = load_vision_tower(art, torch.device("cpu"), torch.float32)
    want = visual["model.visual.blocks.1.attn.qkv.weight"].to(torch.bfloat16).float()
    assert torch.equal(tower.blocks[1].attn.qkv.weight, want)
    with torch.no_grad():
        merged = tower(torch.randn(2 * 4 * 4, 1536), [(2, 4, 4)])
    assert merged.shape == (8, 64) and torch.isfinite(merged).all()


def test_a_partial_vision_tower_fails_conversion(tmp_path):
    visual = _hf_visual_weights()
    del visual["model.visual.blocks.1.mlp.linear_fc2.bias"]
    _tiny_qwen_folder(tmp_path / "vlm", visual, TINY_HF_VISION)
    with pytest.raises(ValueError, match="missing \\['blocks.1.mlp.linear_fc2.bias'\\]"):
        convert_hf(tmp_path / "vlm", tmp_path / "v.ninfer", dtype=torch.float32, progress=False)


def test_visual_weights_without_a_vision_config_are_skipped(tmp_path):
    _tiny_qwen_folder(tmp_path / "vlm", _hf_visual_weights(), None)
    art = Artifact(convert_hf(tmp_path / "vlm", tmp_path / "v.ninfer", dtype=torch.float32, progress=False))
    assert not art.has_component("vision") and art.manifest.extra["skipped_components"] == ["vision"]
    with pytest.raises(ValueError, match="component 'vision' was requested"):
        load_vision_tower(art, torch.device("cpu"), torch.float32)


def test_tiny_preset_with_a_vision_tower(tmp_path):
    from ninfer.artifact.presets import write_preset

    art = Artifact(write_preset("tiny-qwen3.6", tmp_path / "t.ninfer", vision=True))
    tower = load_vision_tower(art, torch.device("cpu"), torch.float32)
    assert tower.config.out_hidden_size == art.config("text")["hidden_size"]
    assert torch.equal(tower.merger.norm.weight, torch.ones(32)) and tower.pos_embed.weight.std() > 0.01
    with torch.no_grad():
        assert tower(torch.randn(16, 1536), [(1, 4, 4)]).shape == (4, 64)
    model = load_model(art, torch.device("cpu"), torch.float32)  # the text model loads as before
    assert not any(n.startswith("vision") for n in model.state_dict())


def test_cli_lists_converters():
    out = subprocess.run([sys.executable, "-m", "ninfer.cli", "convert", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for name in ("gguf", "hf", "synthetic", "default"):
        assert name in out


def test_cli_synthetic_and_info(tmp_path):
    path = tmp_path / "t.ninfer"
    subprocess.run([sys.executable, "-m", "ninfer.cli", "convert", "synthetic", "--preset", "tiny-llama",
                    "-o", str(path)], check=True, capture_output=True)
    info = json.loads(subprocess.run([sys.executable, "-m", "ninfer.cli", "info", str(path)], check=True,
                                     capture_output=True, text=True).stdout)
    assert info["architecture"] == "llama" and info["name"] == "tiny-llama"


def test_cli_reports_a_bad_file_clearly(tmp_path):
    bad = tmp_path / "bad.ninfer"
    bad.write_bytes(b"nope")
    proc = subprocess.run([sys.executable, "-m", "ninfer.cli", "info", str(bad)], capture_output=True, text=True)
    assert proc.returncode != 0
    assert "bad.ninfer: not a .ninfer artifact" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_checkpoint_quantized_mtp_layer_stays_nvfp4(tmp_path):
    """An NVFP4 checkpoint whose MTP decoder layer is quantized too (ModelOpt names): the artifact keeps that
    layer's linears NVFP4 (manifest quantization.mtp_modules), so drafting reads a quarter of the bytes, and the
    head drafts exactly as the same checkpoint dequantized (`--weights bf16`) does: the values are the checkpoint's."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from ninfer.quant.nvfp4 import NVFP4Linear, quantize_nvfp4

    torch.manual_seed(2)
    text_cfg = _small_qwen_config(moe=False)
    hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text_cfg)).eval()
    head_weights = _mtp_weights(text_cfg)
    mtp = {}
    for name, tensor in _checkpoint_mtp(head_weights).items():
        module = name.removesuffix(".weight")
        if name.startswith("mtp.layers.0.") and name.endswith("_proj.weight"):  # attention and MLP linears
            q = quantize_nvfp4(tensor, global_scale=tensor.abs().max() / (6.0 * 448.0))
            mtp[f"{module}.weight"], mtp[f"{module}.weight_scale"] = q.packed, q.scale
            mtp[f"{module}.weight_scale_2"], mtp[f"{module}.input_scale"] = q.row_scale[0].reshape(()), torch.tensor(1.0)
        else:
            mtp[name] = tensor
    config = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForCausalLM"],
              "text_config": {**text_cfg, "model_type": "qwen3_5_text", "mtp_num_hidden_layers": 1},
              "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}}
    _save_folder(tmp_path / "qwen-tiny", hf, config, mtp)
    kept = convert_hf(tmp_path / "qwen-tiny", tmp_path / "kept.ninfer", dtype=torch.float32, progress=False)
    plain = convert_hf(tmp_path / "qwen-tiny", tmp_path / "plain.ninfer", dtype=torch.float32, progress=False,
                       weights="bf16")
    quant = Artifact(kept).manifest.quantization
    linears = [f"layers.0.self_attn.{p}_proj" for p in "qkvo"] + [f"layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")]
    assert quant["weights"] == "nvfp4" and quant["modules"] == [] and sorted(quant["mtp_modules"]) == sorted(linears)
    stored = Artifact(kept).load(["mtp"])["mtp"]
    assert stored["layers.0.mlp.down_proj.weight_packed"].dtype == torch.uint8 and "fc.weight" in stored
    assert "mtp_modules" not in Artifact(plain).manifest.quantization
    heads = []
    for path in (kept, plain):
        art = Artifact(path)
        trunk = load_model(art, torch.device("cpu"), torch.float32)
        heads.append((trunk, load_mtp_head(art, trunk, torch.device("cpu"), torch.float32)))
    (trunk, nvfp4_head), (_, plain_head) = heads
    assert isinstance(nvfp4_head.layers[0].mlp.down_proj, NVFP4Linear)
    assert not isinstance(plain_head.layers[0].mlp.down_proj, NVFP4Linear)
    with torch.no_grad():
        cache = ModelCache(trunk.cache_spec(), num_pages=8, page_size=8, num_state_slots=1, dtype=torch.float32)
        tokens = [1, 200, 33, 4, 150, 9]
        hidden = trunk(ForwardBatch.build([tokens], [0], [list(range(8))], 8), cache)
        drafts = []
        for head in (nvfp4_head, plain_head):
            head_cache = ModelCache(head.cache_spec(), num_pages=8, page_size=8, num_state_slots=1,
                                    dtype=torch.float32)
            step0 = ForwardBatch.build([tokens[1:] + [5]], [0], [list(range(8))], 8)
            drafts.append(head.propose(step0, head_cache, step0.input_ids, hidden, 3))
    assert torch.equal(drafts[0], drafts[1])


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_nvfp4_mtp_quantizes_the_mtp_layer_of_a_bf16_checkpoint(tmp_path, moe):
    """`convert hf --weights nvfp4 --nvfp4-mtp`: the MTP decoder layer's linears (and routed experts) are
    quantized as the trunk's are (the same quantizer on the checkpoint's values); without --nvfp4-mtp the head
    stays unquantized, and the flag without --weights nvfp4 is refused."""
    from ninfer.cli import main
    from ninfer.engine.engine import EngineSettings
    from ninfer.quant.nvfp4 import NVFP4Experts, NVFP4Linear, quantize_nvfp4

    if moe:
        from transformers import Qwen3_5MoeForCausalLM as HFModel
        from transformers import Qwen3_5MoeTextConfig as HFConfig
    else:
        from transformers import Qwen3_5ForCausalLM as HFModel
        from transformers import Qwen3_5TextConfig as HFConfig
    torch.manual_seed(3)
    text_cfg = _small_qwen_config(moe)
    hf = HFModel(HFConfig(**text_cfg)).eval()
    mtp = _checkpoint_mtp(_mtp_weights(text_cfg))
    model_type = "qwen3_5_moe" if moe else "qwen3_5"
    config = {"model_type": model_type, "architectures": ["Qwen3_5ForCausalLM"],
              "text_config": {**text_cfg, "model_type": f"{model_type}_text", "mtp_num_hidden_layers": 1}}
    _save_folder(tmp_path / "qwen-tiny", hf, config, mtp)
    folder = str(tmp_path / "qwen-tiny")
    with pytest.raises(SystemExit):
        main(["convert", "hf", folder, "-o", str(tmp_path / "x.ninfer"), "--nvfp4-mtp"])
    paths = {}
    for flag in ([], ["--nvfp4-mtp"]):
        paths[bool(flag)] = tmp_path / f"q{len(flag)}.ninfer"
        assert main(["convert", "hf", folder, "-o", str(paths[bool(flag)]), "--dtype", "fp32", "--weights", "nvfp4",
                     "--quiet", *flag]) == 0
    assert "mtp_modules" not in Artifact(paths[False]).manifest.quantization
    quant = Artifact(paths[True]).manifest.quantization
    linear = "layers.0.self_attn.o_proj"
    assert linear in quant["mtp_modules"] and "fc" not in quant["mtp_modules"]
    assert ("layers.0.mlp.experts" in quant["mtp_modules"]) == moe
    assert quant["modules"] == Artifact(paths[False]).manifest.quantization["modules"]
    stored = Artifact(paths[True]).load(["mtp"])["mtp"]
    expected = quantize_nvfp4(mtp[f"mtp.{linear}.weight"].float())
    assert torch.equal(stored[f"{linear}.weight_packed"], expected.packed)
    art = Artifact(paths[True])
    trunk = load_model(art, torch.device("cpu"), torch.float32)
    head = load_mtp_head(art, trunk, torch.device("cpu"), torch.float32)
    assert isinstance(head.layers[0].self_attn.o_proj, NVFP4Linear)
    assert isinstance(getattr(head.layers[0].mlp, "experts", None), NVFP4Experts) == moe
    _drafts_run(trunk, head)
    if not moe:  # --lm-head-draft's proposal head (serving.md, startup): NVFP4 with an NVFP4 MTP layer, else bf16
        from ninfer.engine.loader import load_proposer

        for quantized, path in paths.items():
            with_head = tmp_path / f"head{int(quantized)}.ninfer"
            assert main(["convert-draft-head", str(path), str(with_head), "--tokens", "40"]) == 0
            settings = EngineSettings(spec="mtp", lm_head_draft=True, draft_tokens=2)
            art = Artifact(with_head)
            proposer = load_proposer(art, load_model(art, torch.device("cpu"), torch.float32), settings,
                                     torch.device("cpu"), torch.float32)
            short = proposer.draft_head
            assert ("nvfp4" in short.__dict__) == quantized
            drafts = short.propose(torch.randn(3, text_cfg["hidden_size"]))
            assert set(drafts.tolist()) <= set(short.token_ids.tolist())
