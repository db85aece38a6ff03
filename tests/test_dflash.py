"""The DFlash / DFlash2 drafters (ninfer.models.dflash) and their import (ninfer.artifact.convert_drafter).

The oracle is written here from qwen35-architecture.md section 5 and the z-lab model's description,
one sequence at a time: the context as a dense tensor, keys/values concatenated in full, the mask
from positions, the dynamic convolution and the candidate selection as plain loops. Covered, in
float32, for both variants with bidirectional full attention and with a sliding layer (causal by
z-lab's default, or not when is_causal is false): three sequences of different context lengths on
shuffled pages, a context write then a block, then a second round that extends each context by its
accepted tokens (over the first block's stale K/V) and drafts again.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import save_file

from ninfer.artifact.container import Artifact, Manifest, write_artifact
from ninfer.artifact.convert_drafter import import_drafter
from ninfer.forward import ForwardBatch, ModelCache
from ninfer.kernels.attention import paged_attention
from ninfer.models import prepare_for_inference_
from ninfer.models.dflash import (
    CandidateSelector,
    DFlashDrafter,
    DraftBlock,
    block_attention_ref,
    check_dflash_weights,
    dflash_config_from_hf,
)
from ninfer.models.qwen3_5 import QWEN3_6_SHAPES, Qwen3_5ForCausalLM

VOCAB = 300
HIDDEN = 64  # the tiny trunk's
BLOCK = 4
PAGE_SIZE = 4
NUM_PAGES = 24
LOGIT_ATOL = 1e-4  # float32 logits of O(1-10); only summation order differs


def trunk_config() -> dict:
    cfg = copy.deepcopy(QWEN3_6_SHAPES["tiny-qwen3.6"])
    cfg.update(vocab_size=VOCAB, num_hidden_layers=4, layer_types=cfg["layer_types"][:4])
    return cfg


def hf_drafter_config(variant: str, attention: str = "full", head_dim: int = 16) -> dict:
    """A z-lab style config.json: layer fields at top level, draft fields in dflash_config."""
    cfg = {
        "architectures": ["DFlash2DraftModel" if variant == "dflash2" else "DFlashDraftModel"],
        "model_type": "qwen3", "hidden_size": HIDDEN, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": head_dim, "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB, "hidden_act": "silu", "attention_bias": False,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "dflash_config": {"block_size": BLOCK, "mask_token_id": VOCAB - 1, "target_layer_ids": [1, 3],
                          "input_embedding_scale": 1.5, "output_multiplier": 0.5, "final_logit_softcapping": 8.0},
    }
    if attention == "sliding":  # window 3 < block 4: the window cuts into the block and the context
        cfg.update(layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    if variant == "dflash2":
        cfg["is_causal"] = False  # as DFlash2 configs say
        cfg["dflash_config"].update(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=5)
    return cfg


@torch.no_grad()
def randomize(module: torch.nn.Module, seed: int) -> None:
    """O(1) activations with every path mattering: norms off 1, unit-gain linears, strong selector terms."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
        elif name.endswith(("codebook", "embed_tokens.weight")):
            p.copy_(torch.randn(p.shape, generator=gen))
        elif name.endswith("base_kernel"):
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)


# ---------------------------------------------------------------------------------------------
# The reference


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Qwen3 RMSNorm: x / rms(x) * w."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def greedy_path(w: dict, prefix: str, hidden: torch.Tensor, logits: torch.Tensor, anchor: int,
                top_k: int) -> list[int]:
    """DFlash2's selection by brute force: at each position, every one of the top-k tokens scored
    as logit + sum_r pred[prev, r] * proj(h)[r] * succ[c, r], the best taken, then the next."""
    proj = hidden @ w[prefix + "hidden_projection.weight"].T
    pred, succ = w[prefix + "predecessor_codebook"], w[prefix + "successor_codebook"]
    prev, path = anchor, []
    for t in range(logits.shape[0]):
        candidates = sorted(range(logits.shape[1]), key=lambda c: -float(logits[t, c]))[:top_k]
        scores = {c: float(logits[t, c] + (pred[prev] * proj[t] * succ[c]).sum()) for c in candidates}
        prev = max(scores, key=scores.get)
        path.append(prev)
    return path


class Reference:
    def __init__(self, drafter: DFlashDrafter, trunk: Qwen3_5ForCausalLM):
        self.w = {k: v.detach().clone() for k, v in drafter.state_dict().items()}
        self.cfg = cfg = drafter.config
        self.hq, self.hkv, self.d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        self.embed = trunk.embed_tokens.weight.detach().clone()
        self.lm_head = trunk.lm_head.weight.detach().clone()
        self.inv_freq = 1.0 / cfg["rope_parameters"]["rope_theta"] ** (torch.arange(0, self.d, 2).float() / self.d)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # x [n, heads, D]
        ang = positions.float()[:, None] * self.inv_freq
        cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
        half = self.d // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def conv(self, x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """out[t, c] = sum_o (base[o, c] + dynamic[t, o, group of c]) * x[t - o, c], zeros before the block."""
        group = self.cfg["conv_group_size"]
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for o in range(base.shape[0]):
                if t - o >= 0:
                    out[t] += (base[o] + dynamic[t, o].repeat_interleave(group)) * x[t - o]
        return out

    def conv_kernels(self, name: str, h: torch.Tensor):
        dyn = (h @ self.w[name + ".kernel_projection.weight"].T).view(h.shape[0], 2, self.cfg["conv_kernel_size"], -1)
        return dyn, self.w[name + ".base_kernel"]

    def attention(self, p: str, layer_type: str, h: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        w, n, size = self.w, ctx.shape[0], h.shape[0]
        both = torch.cat([ctx, h])  # keys and values: the context, then the block
        q = rms((h @ w[p + "q_proj.weight"].T).view(size, self.hq, self.d), w[p + "q_norm.weight"])
        k = rms((both @ w[p + "k_proj.weight"].T).view(n + size, self.hkv, self.d), w[p + "k_norm.weight"])
        v = (both @ w[p + "v_proj.weight"].T).view(n + size, self.hkv, self.d)
        q, k = self.rope(q, torch.arange(n, n + size)), self.rope(k, torch.arange(n + size))
        sliding = layer_type == "sliding_attention"
        causal = sliding if self.cfg.get("is_causal") is None else self.cfg["is_causal"]
        window = self.cfg.get("sliding_window") if sliding else None
        mask = torch.zeros(size, n + size)
        for a in range(size):
            for b in range(n + size):
                qp, kp = n + a, b
                seen = (not causal or kp <= qp) and (window is None or (qp - kp < window and (causal or kp - qp < window)))
                mask[a, b] = 0.0 if seen else float("-inf")
        heads = []
        for head in range(self.hq):
            g = head // (self.hq // self.hkv)
            scores = q[:, head] @ k[:, g].T * self.d**-0.5 + mask
            heads.append(torch.softmax(scores, -1) @ v[:, g])
        return torch.cat(heads, -1) @ w[p + "o_proj.weight"].T

    def mlp(self, p: str, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        gate, up = x @ w[p + "gate_proj.weight"].T, x @ w[p + "up_proj.weight"].T
        return (torch.nn.functional.silu(gate) * up) @ w[p + "down_proj.weight"].T

    def block(self, features: torch.Tensor, first: int):
        """One sequence: features [n, 2H] of its context, the block's first token -> (hidden after
        norm, logits) of block positions 1..BLOCK-1."""
        w, cfg = self.w, self.cfg
        dflash2 = cfg["variant"] == "dflash2"
        ctx = rms(features @ w["fc.weight"].T, w["hidden_norm.weight"])
        x = self.embed[[first] + [cfg["mask_token_id"]] * (BLOCK - 1)] * cfg["input_embedding_scale"]
        for i, layer_type in enumerate(cfg.get("layer_types") or ["full_attention"] * 2):
            p = f"layers.{i}."
            h = rms(x, w[p + "input_layernorm.weight"])
            if dflash2:
                dyn, base = self.conv_kernels(p + "attention_conv", h)
                a = self.conv(self.attention(p + "self_attn.", layer_type, self.conv(h, dyn[:, 0], base[0]), ctx),
                              dyn[:, 1], base[1])
            else:
                a = self.attention(p + "self_attn.", layer_type, h, ctx)
            x = x + a
            h = rms(x, w[p + "post_attention_layernorm.weight"])
            if dflash2:
                dyn, base = self.conv_kernels(p + "mlp_conv", h)
                m = self.conv(self.mlp(p + "mlp.", self.conv(h, dyn[:, 0], base[0])), dyn[:, 1], base[1])
            else:
                m = self.mlp(p + "mlp.", h)
            x = x + m
        out = rms(x, w["norm.weight"])[1:]
        cap = cfg["final_logit_softcapping"]
        logits = torch.tanh(out @ self.lm_head.T * cfg["output_multiplier"] / cap) * cap
        return out, logits

    def drafts(self, hidden: torch.Tensor, logits: torch.Tensor, first: int) -> list[int]:
        if self.cfg["variant"] == "dflash":
            return logits.argmax(-1).tolist()
        return greedy_path(self.w, "candidate_selector.", hidden, logits, first, self.cfg["selector_top_k"])


# ---------------------------------------------------------------------------------------------


def build(variant: str, attention: str, kv_layer_base: int = 0, head_dim: int = 16):
    torch.manual_seed(0)
    trunk = Qwen3_5ForCausalLM(trunk_config()).eval()
    randomize(trunk, seed=1)
    drafter = DFlashDrafter(dflash_config_from_hf(hf_drafter_config(variant, attention, head_dim)), kv_layer_base)
    drafter.eval()
    randomize(drafter, seed=2)
    ref = Reference(drafter, trunk)  # from the checkpoint-named weights, before fusion
    prepare_for_inference_(trunk)
    prepare_for_inference_(drafter.attach_(trunk))  # the run-time form: merged projections
    return trunk, drafter, ref


def batch_of(lengths: list[int], cached: list[int], pages: list[list[int]]) -> ForwardBatch:
    """Token ids are never read by the drafter: positions, slots and lengths are what count."""
    return ForwardBatch.build([[0] * n for n in lengths], cached, pages, PAGE_SIZE)


def shuffled_pages(num_seqs: int, per_seq: int, seed: int) -> list[list[int]]:
    order = torch.randperm(NUM_PAGES, generator=torch.Generator().manual_seed(seed)).tolist()
    return [order[i * per_seq : (i + 1) * per_seq] for i in range(num_seqs)]


@pytest.mark.parametrize("attention", ["full", "sliding"])
@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
@torch.no_grad()
def test_context_then_block_matches_the_dense_reference_over_two_rounds(variant, attention):
    trunk, drafter, ref = build(variant, attention)
    cache = ModelCache(drafter.cache_spec(), NUM_PAGES, PAGE_SIZE, 1, torch.float32)
    gen = torch.Generator().manual_seed(3)
    ctx_lens = [9, 2, 5]
    pages = shuffled_pages(3, 6, seed=4)  # 24 positions each: room for both rounds' blocks
    feats = [torch.randn(n, 2 * HIDDEN, generator=gen) for n in ctx_lens]
    firsts = torch.randint(0, VOCAB - 1, (3,), generator=gen)

    def check(lens, features, first_tokens):
        block = batch_of([BLOCK] * 3, lens, pages)
        hidden, logits = drafter.block_logits(block, cache, first_tokens)
        drafts = drafter.draft(block, cache, first_tokens)
        assert drafts.shape == (3, BLOCK - 1) and drafts.dtype == torch.long
        for i in range(3):
            want_hidden, want_logits = ref.block(features[i], int(first_tokens[i]))
            torch.testing.assert_close(logits[i], want_logits, atol=LOGIT_ATOL, rtol=0)
            assert drafts[i].tolist() == ref.drafts(want_hidden, want_logits, int(first_tokens[i]))

    drafter.context_kv(batch_of(ctx_lens, [0, 0, 0], pages), cache, torch.cat(feats))  # ragged, one call
    check(ctx_lens, feats, firsts)

    # round 2: sequences accept 3, 0 and 1 drafts: their contexts grow by the bonus token plus those,
    # over K/V the first block left there; the next blocks start right after
    grown = [torch.randn(a + 1, 2 * HIDDEN, generator=gen) for a in (3, 0, 1)]
    drafter.context_kv(batch_of([len(g) for g in grown], ctx_lens, pages), cache, torch.cat(grown))
    lens2 = [n + len(g) for n, g in zip(ctx_lens, grown)]
    check(lens2, [torch.cat([f, g]) for f, g in zip(feats, grown)], torch.randint(0, VOCAB - 1, (3,), generator=gen))


@torch.no_grad()
def test_drafter_riding_in_the_trunks_cache_drafts_the_same():
    trunk, own, _ = build("dflash2", "full", head_dim=64)  # the trunk's KV shape: 2 heads of 64
    _, riding, _ = build("dflash2", "full", kv_layer_base=trunk.num_attn_layers, head_dim=64)
    riding.attach_(trunk)
    caches = [ModelCache(own.cache_spec(), NUM_PAGES, PAGE_SIZE, 1, torch.float32),
              ModelCache(riding.cache_spec(trunk.cache_spec()), NUM_PAGES, PAGE_SIZE, 2, torch.float32)]
    assert caches[1].k.shape[0] == trunk.num_attn_layers + 2
    pages = shuffled_pages(2, 4, seed=5)
    feats = torch.randn(10, 2 * HIDDEN, generator=torch.Generator().manual_seed(6))
    firsts = torch.tensor([7, 11])
    out = []
    for drafter, cache in zip((own, riding), caches):
        drafter.context_kv(batch_of([6, 4], [0, 0], pages), cache, feats)
        out.append(drafter.block_logits(batch_of([BLOCK] * 2, [6, 4], pages), cache, firsts)[1])
    torch.testing.assert_close(out[0], out[1], atol=0, rtol=0)
    assert not caches[1].k[: trunk.num_attn_layers].any()  # the trunk's layers untouched


def test_draft_batch_must_be_whole_blocks():
    _, drafter, _ = build("dflash", "full")
    cache = ModelCache(drafter.cache_spec(), NUM_PAGES, PAGE_SIZE, 1, torch.float32)
    with pytest.raises(ValueError, match="block_size=4"):
        drafter.draft(batch_of([3], [2], [[0, 1]]), cache, torch.tensor([1]))
    with pytest.raises(RuntimeError, match="no trunk"):
        DFlashDrafter(dflash_config_from_hf(hf_drafter_config("dflash"))).compute_logits(torch.zeros(1, HIDDEN))


# ---------------------------------------------------------------------------------------------
# DFlash2's candidate selector


@torch.no_grad()
def test_selector_path_is_the_brute_force_greedy_path():
    gen = torch.Generator().manual_seed(7)
    selector = CandidateSelector(vocab=40, hidden=12, rank=6, top_k=5)
    randomize(selector, seed=8)
    hidden = torch.randn(3, 6, 12, generator=gen)
    logits = 2 * torch.randn(3, 6, 40, generator=gen)
    anchors = torch.randint(0, 40, (3,), generator=gen)
    got = selector.select(hidden, logits, anchors)
    w = selector.state_dict()
    for b in range(3):
        assert got[b].tolist() == greedy_path(w, "", hidden[b], logits[b], int(anchors[b]), 5)
    assert not torch.equal(got, logits.argmax(-1))  # the pairwise term changes choices here
    selector.successor_codebook.zero_()
    assert torch.equal(selector.select(hidden, logits, anchors), logits.argmax(-1))  # without it: argmax


# ---------------------------------------------------------------------------------------------
# Checkpoint names: z-lab's tests/fixtures (dflash2-config.json, dflash2-safetensors-header.json)

ZLAB_DFLASH2_CONFIG = {
    "architectures": ["DFlash2DraftModel"], "attention_bias": False, "is_causal": False,
    "dflash_config": {
        "block_size": 16, "conv_group_size": 16, "conv_kernel_size": 2, "final_logit_softcapping": 20.0,
        "mask_token_id": 201818, "output_multiplier": 0.19611613513818404, "selector_rank": 256,
        "selector_top_k": 16, "target_layer_ids": [1, 13, 25, 37, 49],
    },
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 6656, "intermediate_size": 19968,
    "layer_types": ["sliding_attention"] * 5, "max_position_embeddings": 131072, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 5, "num_key_value_heads": 8, "num_target_layers": 52,
    "rms_norm_eps": 1e-05, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    "sliding_window": 2048, "use_sliding_window": True, "vocab_size": 202048,
}
ZLAB_DFLASH2_TENSORS = {  # every tensor but layers 1-4's (the same as layer 0's)
    "candidate_selector.hidden_projection.weight": (256, 6656),
    "candidate_selector.predecessor_codebook": (202048, 256),
    "candidate_selector.successor_codebook": (202048, 256),
    "fc.weight": (6656, 33280),
    "hidden_norm.weight": (6656,),
    "norm.weight": (6656,),
}
ZLAB_LAYER_TENSORS = {
    "attention_conv.base_kernel": (2, 2, 6656),
    "attention_conv.kernel_projection.weight": (1664, 6656),
    "input_layernorm.weight": (6656,),
    "mlp.down_proj.weight": (6656, 19968),
    "mlp.gate_proj.weight": (19968, 6656),
    "mlp.up_proj.weight": (19968, 6656),
    "mlp_conv.base_kernel": (2, 2, 6656),
    "mlp_conv.kernel_projection.weight": (1664, 6656),
    "post_attention_layernorm.weight": (6656,),
    "self_attn.k_norm.weight": (128,),
    "self_attn.k_proj.weight": (1024, 6656),
    "self_attn.o_proj.weight": (6656, 4096),
    "self_attn.q_norm.weight": (128,),
    "self_attn.q_proj.weight": (4096, 6656),
    "self_attn.v_proj.weight": (1024, 6656),
}


def zlab_tensors(variant: str) -> dict[str, tuple]:
    names = {**ZLAB_DFLASH2_TENSORS,
             **{f"layers.{i}.{k}": s for i in range(5) for k, s in ZLAB_LAYER_TENSORS.items()}}
    if variant == "dflash":  # DFlash: the same model without the convolutions and the selector
        names = {k: s for k, s in names.items() if "_conv." not in k and not k.startswith("candidate_selector.")}
    return names


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_state_dict_is_the_zlab_checkpoint(variant):
    hf = dict(ZLAB_DFLASH2_CONFIG, architectures=["DFlash2DraftModel" if variant == "dflash2" else "DFlashDraftModel"])
    cfg = dflash_config_from_hf(hf)
    assert cfg["variant"] == variant and cfg["block_size"] == 16 and cfg["mask_token_id"] == 201818
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg)
    assert {k: tuple(v.shape) for k, v in drafter.state_dict().items()} == zlab_tensors(variant)
    assert drafter.target_layer_ids == [1, 13, 25, 37, 49] and drafter.block_size == 16
    attn = drafter.layers[0].self_attn
    assert (attn.window, attn.causal) == (2048, False)  # is_causal false overrides the sliding default
    tensors = {k: torch.empty(s, device="meta") for k, s in zlab_tensors(variant).items()}
    check_dflash_weights(cfg, tensors)
    with pytest.raises(ValueError, match="missing"):
        check_dflash_weights(cfg, {k: t for k, t in tensors.items() if k != "norm.weight"})


def test_fusion_keeps_the_checkpoint_names():
    _, drafter, _ = build("dflash2", "full")  # fused in build
    fresh = DFlashDrafter(drafter.config)
    assert set(drafter.state_dict()) == set(fresh.state_dict())
    fresh.load_state_dict(drafter.state_dict())  # and loads back into the unfused form


def test_config_from_hf_reads_both_layouts_and_refuses_mismatches():
    nested = hf_drafter_config("dflash")
    flat = {**{k: v for k, v in nested.items() if k != "dflash_config"}, **nested["dflash_config"]}
    assert dflash_config_from_hf(flat) == dflash_config_from_hf(nested)
    with pytest.raises(ValueError, match="DFlashDraftModel"):
        dflash_config_from_hf(nested, "dflash2")
    without = copy.deepcopy(nested)
    del without["dflash_config"]["mask_token_id"]
    with pytest.raises(ValueError, match="mask_token_id"):
        dflash_config_from_hf(without)


# ---------------------------------------------------------------------------------------------
# Import into an artifact


def tiny_artifact(path) -> dict[str, torch.Tensor]:
    trunk = Qwen3_5ForCausalLM(trunk_config())
    randomize(trunk, seed=9)
    tensors = {f"text.{k}": v.clone() for k, v in trunk.state_dict().items()}
    manifest = Manifest(name="tiny", architecture="qwen3_5", components={"text": trunk_config()},
                        quantization={"text": "float32"}, extra={"eos_token_ids": [1]})
    write_artifact(path, tensors, manifest, '{"model": {}}', "{{ messages }}")
    return tensors


def drafter_folder(folder, variant: str) -> dict[str, torch.Tensor]:
    folder.mkdir()
    hf = hf_drafter_config(variant)
    drafter = DFlashDrafter(dflash_config_from_hf(hf))
    randomize(drafter, seed=10)
    tensors = {k: v.clone() for k, v in drafter.state_dict().items()}
    (folder / "config.json").write_text(json.dumps(hf))
    save_file(tensors, str(folder / "model.safetensors"))
    return tensors


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_import_round_trip(tmp_path, variant):
    text = tiny_artifact(tmp_path / "in.ninfer")
    weights = drafter_folder(tmp_path / "drafter", variant)
    out = import_drafter(tmp_path / "in.ninfer", tmp_path / "drafter", tmp_path / "out.ninfer", variant)
    art = Artifact(out)
    assert art.config(variant) == dflash_config_from_hf(hf_drafter_config(variant))
    assert art.manifest.quantization[variant] == "float32" and art.manifest.extra == {"eos_token_ids": [1]}
    assert art.tokenizer_json == '{"model": {}}' and art.chat_template == "{{ messages }}"
    loaded = art.load([variant])
    assert loaded[variant].keys() == weights.keys()
    assert all(torch.equal(loaded[variant][k], v) for k, v in weights.items())
    assert all(torch.equal(loaded["text"][k.removeprefix("text.")], v) for k, v in text.items())
    drafter = DFlashDrafter(art.config(variant))
    drafter.load_state_dict(loaded[variant])  # loads as it is


def test_import_refuses_what_does_not_fit(tmp_path):
    tiny_artifact(tmp_path / "in.ninfer")
    weights = drafter_folder(tmp_path / "drafter", "dflash2")
    args = (tmp_path / "in.ninfer", tmp_path / "drafter", tmp_path / "out.ninfer")
    with pytest.raises(ValueError, match="DFlash2DraftModel"):
        import_drafter(*args, "dflash")
    del weights["norm.weight"]
    save_file(weights, str(tmp_path / "drafter" / "model.safetensors"))
    with pytest.raises(ValueError, match="norm.weight"):
        import_drafter(*args, "dflash2")
    hf = hf_drafter_config("dflash2")
    hf["dflash_config"]["target_layer_ids"] = [1, 4]  # the tiny trunk has layers 0..3
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="target_layer_ids"):
        import_drafter(*args, None)
    assert not (tmp_path / "out.ninfer").exists()


def test_cli_convert_drafter(tmp_path):
    from ninfer.cli import main

    tiny_artifact(tmp_path / "in.ninfer")
    drafter_folder(tmp_path / "drafter", "dflash")
    out = tmp_path / "sub" / "out.ninfer"
    assert main(["convert-drafter", str(tmp_path / "in.ninfer"), str(tmp_path / "drafter"), str(out)]) == 0
    assert Artifact(out).has_component("dflash")  # the variant the checkpoint declares
    assert main(["convert-drafter", str(tmp_path / "in.ninfer"), str(tmp_path / "drafter"), str(out),
                 "--variant", "dflash2"]) == 1


# ---------------------------------------------------------------------------------------------
# The CUDA path: the block as decode rows of the paged kernel, fused K/V writes, graph capture


@pytest.mark.parametrize("causal", [False, True])
@torch.no_grad()
def test_decode_rows_see_what_the_block_mask_shows(causal):
    """The CUDA path's view of a block (one single-query row per block token, DraftBlock.decode_rows),
    run here through the reference paged attention, equals the block reference without a window."""
    gen = torch.Generator().manual_seed(11)
    k, v = (torch.randn(NUM_PAGES * PAGE_SIZE, 2, 16, generator=gen) for _ in range(2))
    block = DraftBlock(batch_of([BLOCK] * 3, [9, 2, 5], shuffled_pages(3, 6, seed=12)), BLOCK, PAGE_SIZE)
    q = torch.randn(3 * BLOCK, 4, 16, generator=gen)
    want = block_attention_ref(q, k, v, block, 0.25, causal, None)
    rows = block.decode_rows(causal)
    assert rows.seq_lens.tolist() == rows.seq_lens_cpu  # the kernel reads the device copy
    torch.testing.assert_close(paged_attention(q, k, v, rows, PAGE_SIZE, 0.25), want)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _to_cuda_bf16(trunk, drafter, kv_dtype: str = "bf16") -> ModelCache:
    trunk.to("cuda", torch.bfloat16)  # in place: the drafter keeps pointing at the same trunk
    drafter.to("cuda", torch.bfloat16)
    return ModelCache(drafter.cache_spec(), NUM_PAGES, PAGE_SIZE, 1, torch.bfloat16, "cuda", kv_dtype=kv_dtype)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
@torch.no_grad()
def test_cuda_bf16_block_matches_the_reference(variant, kv_dtype):
    """Full-attention layers (the CUDA path has no window) through the Triton kernels, in bf16: the
    fp32 oracle's logits within bf16 (and int8 KV) rounding."""
    trunk, drafter, ref = build(variant, "full")
    cache = _to_cuda_bf16(trunk, drafter, kv_dtype)
    gen = torch.Generator().manual_seed(3)
    ctx_lens = [9, 2, 5]
    pages = shuffled_pages(3, 6, seed=4)
    feats = [torch.randn(n, 2 * HIDDEN, generator=gen) for n in ctx_lens]
    firsts = torch.randint(0, VOCAB - 1, (3,), generator=gen)
    ctx = ForwardBatch.build([[0] * n for n in ctx_lens], [0, 0, 0], pages, PAGE_SIZE, device="cuda")
    drafter.context_kv(ctx, cache, torch.cat(feats).to("cuda", torch.bfloat16))
    block = ForwardBatch.build([[0] * BLOCK] * 3, ctx_lens, pages, PAGE_SIZE, device="cuda")
    _, logits = drafter.block_logits(block, cache, firsts.cuda())
    want = torch.stack([ref.block(f, int(t))[1] for f, t in zip(feats, firsts)])
    err = (logits.float().cpu() - want).abs().max() / want.abs().max()
    assert err < (0.03 if kv_dtype == "bf16" else 0.06), err


@pytest.mark.cuda
@needs_cuda
@torch.no_grad()
def test_context_and_draft_capture_as_one_cuda_graph():
    """context_kv then draft (DFlash2: convolutions, decode rows, selector walk) need no host sync:
    captured once, a replay equals the eager run, and new inputs in the static buffers are picked up."""
    from ninfer.engine.graphs import capture

    trunk, drafter, _ = build("dflash2", "full")
    cache = _to_cuda_bf16(trunk, drafter)
    pages = shuffled_pages(2, 4, seed=13)
    ctx = ForwardBatch.build([[0] * 6, [0] * 3], [0, 0], pages, PAGE_SIZE, device="cuda")
    block = ForwardBatch.build([[0] * BLOCK] * 2, [6, 3], pages, PAGE_SIZE, device="cuda")
    feats = torch.randn(9, 2 * HIDDEN, generator=torch.Generator().manual_seed(14)).to("cuda", torch.bfloat16)
    firsts = torch.tensor([5, 9], device="cuda")

    def step():
        drafter.context_kv(ctx, cache, feats)
        return drafter.draft(block, cache, firsts)

    eager = step()
    graph, out = capture(step, torch.device("cuda"), warmups=2)
    graph.replay()
    assert torch.equal(out, eager)
    feats.normal_()
    firsts.copy_(torch.tensor([8, 2]))
    want = step()
    graph.replay()
    assert torch.equal(out, want)
