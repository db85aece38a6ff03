"""Qwen3.5/3.6 (dense and MoE) match transformers' Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM.

Both models get the same random weights at a small shape and run in float32. Covered: prefill
logits at every position, chunked prefill that continues from the state slots, cached greedy
decode, a ragged batch with shuffled pages and slots, and stale state in a reused slot.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM as HFDense
from transformers.models.qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM as HFMoe
from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

from ninfer.forward import ForwardBatch, ModelCache
from ninfer.kernels import gdn
from ninfer.models.mrope import MediaSpan, mrope_positions
from ninfer.models.qwen3_5 import (
    QWEN3_6_SHAPES,
    Qwen3_5ForCausalLM,
    hf_to_artifact_name,
    text_config_from_hf,
)

LOGITS_ATOL = 2e-4  # float32 logits of std ~2 (max abs diff vs transformers)
SAME_RUN_ATOL = 2e-5  # our own batched vs separate runs: only reduction order differs
KERNEL_ATOL = 1e-5  # chunked vs recurrent delta rule, varlen vs step-by-step conv
VOCAB = 512
PAGE_SIZE = 16
NUM_PAGES = 64
NUM_SLOTS = 8


def small_config(kind: str) -> dict:
    cfg = copy.deepcopy(QWEN3_6_SHAPES["tiny-qwen3.6-moe" if kind == "moe" else "tiny-qwen3.6"])
    cfg["vocab_size"] = VOCAB
    return cfg


@torch.no_grad()
def randomize_for_parity(model: Qwen3_5ForCausalLM, seed: int) -> None:
    """Weights that make every path matter: O(1) activations, norms off their centre, slow GDN decays."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("linear_attn.norm.weight"):
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
        elif name.endswith("norm.weight"):
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        elif leaf == "A_log":  # decay per token exp(g) mostly in (0.7, 1): state survives chunk boundaries
            p.copy_(torch.empty(p.shape).uniform_(0.01, 0.5, generator=gen).log())
        elif leaf == "dt_bias":
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        elif "conv1d" in name:
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        else:  # [.., out, in]: unit-gain linears
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)


def load_into_hf(ours: Qwen3_5ForCausalLM, hf: torch.nn.Module) -> None:
    ours_sd = ours.state_dict()
    hf_sd = {}
    for name in hf.state_dict():
        component, ours_name = hf_to_artifact_name(name)
        assert component == "text"
        hf_sd[name] = ours_sd[ours_name]
    assert {hf_to_artifact_name(n)[1] for n in hf_sd} == set(ours_sd), "parameter sets differ"
    hf.load_state_dict(hf_sd, strict=True)


@pytest.fixture(scope="module", params=["dense", "moe"])
def models(request):
    torch.manual_seed(0)
    cfg = small_config(request.param)
    ours = Qwen3_5ForCausalLM(cfg).eval()
    randomize_for_parity(ours, seed=1)
    if request.param == "moe":
        hf = HFMoe(Qwen3_5MoeTextConfig(**cfg, attn_implementation="eager"))
    else:
        hf = HFDense(Qwen3_5TextConfig(**cfg, attn_implementation="eager"))
    hf = hf.eval()
    load_into_hf(ours, hf)
    return ours, hf


def new_cache(model: Qwen3_5ForCausalLM) -> ModelCache:
    return ModelCache(model.cache_spec(), NUM_PAGES, PAGE_SIZE, NUM_SLOTS, torch.float32)


@torch.no_grad()
def run_step(model, cache, seqs: list[dict]) -> list[torch.Tensor]:
    """One forward over a ragged batch; seqs: dicts of new tokens, cached length, pages, slot. -> per-seq logits."""
    batch = ForwardBatch.build(
        [s["new"] for s in seqs], [s["cached"] for s in seqs], [s["pages"] for s in seqs], PAGE_SIZE,
        state_slots=[s["slot"] for s in seqs],
    )
    logits = model.compute_logits(model(batch, cache))
    return list(logits.split(batch.query_lens_cpu))


@torch.no_grad()
def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ---------------------------------------------------------------------------------------------


def test_prefill_logits_match_at_every_position(models):
    ours, hf = models
    prompt = tokens(150, seed=2)  # 3 GDN chunks of 64, the last one partial
    (logits,) = run_step(ours, new_cache(ours), [dict(new=prompt, cached=0, pages=list(range(10)), slot=0)])
    assert max_diff(logits, hf_logits(hf, prompt)) < LOGITS_ATOL


def test_mrope_positions_match(models):
    """Distinct t/h/w positions ([3, T]) take their frequencies from the interleaved axes as in HF."""
    ours, hf = models
    prompt = tokens(40, seed=3)
    p = torch.arange(40)
    positions = torch.stack([p, p + p % 7, p + 2 * (p % 5)])
    batch = ForwardBatch.build([prompt], [0], [list(range(3))], PAGE_SIZE, state_slots=[0])
    batch.positions = positions
    with torch.no_grad():
        logits = ours.compute_logits(ours(batch, new_cache(ours)))
        expected = hf(torch.tensor([prompt]), position_ids=positions[:, None, :]).logits[0]
    assert max_diff(logits, expected) < LOGITS_ATOL


def test_image_span_positions_match_in_chunks_and_decode(models):
    """Positions of a prompt with an image and a video frame (ninfer.models.mrope), prefilled in chunks that
    split the spans and then decoded past the prompt (every axis at index + rope_delta), match HF given
    the same [3, T] ids over the whole sequence."""
    ours, hf = models
    n = 60
    mrope = mrope_positions(n, [MediaSpan(5, (1, 8, 12)), MediaSpan(40, (1, 4, 4), "video")])
    seq = tokens(n + 3, seed=6)
    positions = torch.cat([mrope.positions, (torch.arange(n, n + 3) + mrope.rope_delta).expand(3, -1)], dim=1)
    cache, pages, done, out = new_cache(ours), [3, 0, 5, 1, 7], 0, []
    for size in (13, 20, 27, 1, 1, 1):
        batch = ForwardBatch.build([seq[done:done + size]], [done], [pages], PAGE_SIZE, state_slots=[2])
        batch.positions = positions[:, done:done + size]
        with torch.no_grad():
            out.append(ours.compute_logits(ours(batch, cache)))
        done += size
    with torch.no_grad():
        expected = hf(torch.tensor([seq]), position_ids=positions[:, None, :]).logits[0]
    assert max_diff(torch.cat(out), expected) < LOGITS_ATOL
    # the axes agreeing is plain RoPE: [3, T] equal rows give the 1-D path's logits
    p = torch.arange(n)
    plain = ForwardBatch.build([seq[:n]], [0], [pages], PAGE_SIZE, state_slots=[0])
    with torch.no_grad():
        one_d = ours.compute_logits(ours(plain, new_cache(ours)))
        plain.positions = p.expand(3, -1)
        three = ours.compute_logits(ours(plain, new_cache(ours)))
    assert max_diff(one_d, three) == 0


def test_chunked_prefill_continues_from_the_slots(models):
    ours, hf = models
    prompt = tokens(150, seed=4)
    cache, pages, done, out = new_cache(ours), [9, 3, 7, 1, 5, 0, 2, 8, 4, 6], 0, []
    for size in (5, 64, 70, 11):  # GDN chunks of 64 straddle the prefill chunks
        out += run_step(ours, cache, [dict(new=prompt[done:done + size], cached=done, pages=pages, slot=5)])
        done += size
    assert max_diff(torch.cat(out), hf_logits(hf, prompt)) < LOGITS_ATOL


def test_greedy_decode_matches_hf_cache(models):
    ours, hf = models
    prompt = tokens(40, seed=5)
    cache, pages = new_cache(ours), [4, 2, 6, 0]
    (ours_logits,) = run_step(ours, cache, [dict(new=prompt, cached=0, pages=pages, slot=2)])
    with torch.no_grad():
        hf_out = hf(torch.tensor([prompt]), use_cache=True)
    for step in range(16):
        token = int(hf_out.logits[0, -1].argmax())
        assert int(ours_logits[-1].argmax()) == token, f"greedy token differs before step {step}"
        (ours_logits,) = run_step(ours, cache, [dict(new=[token], cached=len(prompt) + step, pages=pages, slot=2)])
        with torch.no_grad():
            hf_out = hf(torch.tensor([[token]]), cache=hf_out.cache, use_cache=True)
        assert max_diff(ours_logits[-1], hf_out.logits[0, -1].float()) < LOGITS_ATOL, f"step {step}"


def test_ragged_batch_equals_separate_runs(models):
    """A continuing prefill, two decodes and a fresh prefill in one step; pages and slots shuffled."""
    ours, hf = models
    rng = random.Random(6)
    page_ids = list(range(NUM_PAGES))
    rng.shuffle(page_ids)
    specs = [  # (prefix length, new tokens, slot)
        (30, 37, 6), (50, 1, 1), (9, 1, 4), (0, 20, 3),
    ]
    seqs = []
    for i, (prefix, new, slot) in enumerate(specs):
        toks = tokens(prefix + new + 1, seed=10 + i)
        pages = [page_ids.pop() for _ in range((prefix + new + 1 + PAGE_SIZE - 1) // PAGE_SIZE)]
        seqs.append(dict(toks=toks, prefix=prefix, new=new, pages=pages, slot=slot))

    def prefix_step(s):
        return dict(new=s["toks"][: s["prefix"]], cached=0, pages=s["pages"], slot=s["slot"])

    def mixed_step(s):
        return dict(new=s["toks"][s["prefix"]: s["prefix"] + s["new"]], cached=s["prefix"], pages=s["pages"],
                    slot=s["slot"])

    def decode_step(s):
        n = s["prefix"] + s["new"]
        return dict(new=s["toks"][n: n + 1], cached=n, pages=s["pages"], slot=s["slot"])

    cache = new_cache(ours)
    run_step(ours, cache, [prefix_step(s) for s in seqs if s["prefix"]])
    mixed = run_step(ours, cache, [mixed_step(s) for s in seqs])
    decoded = run_step(ours, cache, [decode_step(s) for s in seqs])  # all-decode path, slots out of order

    for s, got, got_next in zip(seqs, mixed, decoded):
        alone = new_cache(ours)
        if s["prefix"]:
            run_step(ours, alone, [prefix_step(s)])
        (want,) = run_step(ours, alone, [mixed_step(s)])
        (want_next,) = run_step(ours, alone, [decode_step(s)])
        assert max_diff(got, want) < SAME_RUN_ATOL
        assert max_diff(got_next, want_next) < SAME_RUN_ATOL
        reference = hf_logits(hf, s["toks"])
        n = s["prefix"] + s["new"]
        assert max_diff(torch.cat([got, got_next]), reference[s["prefix"]: n + 1]) < LOGITS_ATOL


def test_stale_slot_does_not_leak_into_a_fresh_sequence(models):
    ours, hf = models
    cache, pages = new_cache(ours), [3, 8, 1, 6, 2]
    old = tokens(70, seed=20)
    run_step(ours, cache, [dict(new=old, cached=0, pages=pages, slot=2)])
    run_step(ours, cache, [dict(new=[7], cached=70, pages=pages, slot=2)])

    # Chunked-prefill path: a new prompt reuses the slot and the pages.
    fresh = tokens(25, seed=21)
    (got,) = run_step(ours, cache, [dict(new=fresh, cached=0, pages=pages, slot=2)])
    assert max_diff(got, hf_logits(hf, fresh)) < LOGITS_ATOL

    # Decode path: a one-token prompt next to a decoding sequence, its slot poisoned with NaN.
    cache.conv[:, 5].fill_(float("nan"))
    cache.ssm[:, 5].fill_(float("nan"))
    one = tokens(1, seed=22)
    got_fresh, got_cont = run_step(ours, cache, [
        dict(new=one, cached=0, pages=[9], slot=5),
        dict(new=[11], cached=25, pages=pages, slot=2),
    ])
    assert max_diff(got_fresh, hf_logits(hf, one)) < LOGITS_ATOL
    assert max_diff(got_cont, hf_logits(hf, fresh + [11])[-1:]) < LOGITS_ATOL


# ---------------------------------------------------------------------------------------------
# Kernels: the two delta-rule forms and the two conv paths agree with each other.


def test_chunked_and_recurrent_delta_rule_agree():
    gen = torch.Generator().manual_seed(7)
    lens = [1, 63, 64, 65, 130]
    total, hk, hv, d = sum(lens), 2, 4, 16

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    q, k, v = rnd(1, total, hk, d), rnd(1, total, hk, d), rnd(1, total, hv, d)
    g = -torch.rand(1, total, hv, generator=gen) * 0.2
    beta = torch.rand(1, total, hv, generator=gen)
    init = rnd(len(lens), hv, d, d)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    out, final = gdn.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
    )
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        sl = slice(a, b)
        want, want_final = gdn.fused_recurrent_gated_delta_rule(
            q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta=beta[:, sl], initial_state=init[n: n + 1],
            output_final_state=True, use_qk_l2norm_in_kernel=True,
        )
        assert max_diff(out[:, sl], want) < KERNEL_ATOL
        assert max_diff(final[n], want_final[0]) < KERNEL_ATOL


def test_varlen_conv_equals_step_by_step_updates():
    gen = torch.Generator().manual_seed(8)
    lens, channels, kernel = [1, 2, 7], 6, 4
    x = torch.randn(sum(lens), channels, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    init = torch.randn(len(lens), channels, kernel - 1, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_idx = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    pos = torch.cat([torch.arange(n) for n in lens])
    out, final = gdn.causal_conv1d_fn(x, weight, init, cu, seq_idx, pos)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        state = init[n: n + 1]
        for t in range(a, b):
            y, state = gdn.causal_conv1d_update(x[t: t + 1], weight, state)
            assert max_diff(out[t: t + 1], y) < KERNEL_ATOL
        assert max_diff(final[n], state[0]) < KERNEL_ATOL


# ---------------------------------------------------------------------------------------------
# Shapes, names, configs, init


@pytest.mark.parametrize("shape,hf_cls,hf_cfg_cls,billions", [
    ("qwen3.6-27b", HFDense, Qwen3_5TextConfig, (26.0, 28.0)),
    ("qwen3.6-35b-a3b", HFMoe, Qwen3_5MoeTextConfig, (33.0, 36.0)),
])
def test_full_shapes_have_hf_names_and_shapes(shape, hf_cls, hf_cfg_cls, billions):
    cfg = QWEN3_6_SHAPES[shape]
    with torch.device("meta"):
        ours = Qwen3_5ForCausalLM(cfg)
        hf = hf_cls(hf_cfg_cls(**cfg))
    hf_shapes = {hf_to_artifact_name(n)[1]: tuple(p.shape) for n, p in hf.named_parameters()}
    ours_shapes = {n: tuple(p.shape) for n, p in ours.named_parameters()}
    assert ours_shapes == hf_shapes
    count = sum(p.numel() for p in ours.parameters()) / 1e9
    assert billions[0] < count < billions[1]
    spec = ours.cache_spec()
    assert (spec.num_attn_layers, spec.num_state_layers) == (cfg["num_hidden_layers"] // 4, cfg["num_hidden_layers"] * 3 // 4)


def test_checkpoint_names_and_vlm_config_map():
    assert hf_to_artifact_name("model.language_model.layers.3.self_attn.q_proj.weight") == (
        "text", "layers.3.self_attn.q_proj.weight")
    assert hf_to_artifact_name("model.layers.0.linear_attn.A_log") == ("text", "layers.0.linear_attn.A_log")
    assert hf_to_artifact_name("lm_head.weight") == ("text", "lm_head.weight")
    assert hf_to_artifact_name("mtp.fc.weight") == ("mtp", "fc.weight")
    assert hf_to_artifact_name("model.visual.blocks.0.attn.qkv.bias") == ("vision", "blocks.0.attn.qkv.bias")
    assert hf_to_artifact_name("something.else") is None

    text = dict(QWEN3_6_SHAPES["qwen3.6-27b"])
    del text["layer_types"]
    vlm = {"model_type": "qwen3_5", "tie_word_embeddings": False, "text_config": text, "vision_config": {}}
    cfg = text_config_from_hf(vlm)
    assert cfg["layer_types"] == QWEN3_6_SHAPES["qwen3.6-27b"]["layer_types"]
    assert cfg["rope_parameters"]["mrope_section"] == [11, 11, 10]
    assert text_config_from_hf(text)["hidden_size"] == 5120


def test_init_random_is_deterministic_at_realistic_scales():
    cfg = QWEN3_6_SHAPES["tiny-qwen3.6-moe"]
    a, b = Qwen3_5ForCausalLM(cfg), Qwen3_5ForCausalLM(cfg)
    a.init_random_(3)
    b.init_random_(3)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert abs(a.embed_tokens.weight.std().item() - 0.02) < 1e-3
    layer = a.layers[0]
    assert torch.all(layer.input_layernorm.weight == 0) and torch.all(layer.linear_attn.norm.weight == 1)
    a_exp = layer.linear_attn.A_log.exp()
    assert torch.all((a_exp >= 1) & (a_exp <= 16))
    assert abs(layer.mlp.experts.gate_up_proj.std().item() - 0.02) < 2e-3
