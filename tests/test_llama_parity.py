"""Our paged Llama against transformers' LlamaForCausalLM with the same random weights, in float32."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ninfer.forward import ForwardBatch, ModelCache  # noqa: E402
from ninfer.models import build_model  # noqa: E402
from ninfer.models.llama import LlamaForCausalLM, hf_to_artifact_name, text_config_from_hf  # noqa: E402

ATOL = 1e-4  # on float32 logits (|logits| ~ 2); observed max abs diff: 0.0 vs HF eager attention
PAGE_SIZE = 4  # small, so every sequence spans several pages

CONFIGS = {
    # SmolLM2-like: tied embeddings, GQA, default RoPE.
    "tied": dict(
        vocab_size=101, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e5},
    ),
    # Llama-3.1-like: untied head, q/k/v/o biases, head_dim != hidden/heads, llama3 RoPE scaling.
    "llama3": dict(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, attention_bias=True, tie_word_embeddings=False,
        max_position_embeddings=128, rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
        },
    ),
}


def make_pair(name: str, seed: int = 0) -> tuple[torch.nn.Module, LlamaForCausalLM]:
    """An HF model with non-trivial random weights (norms and biases too) and ours loaded from it."""
    cfg = transformers.LlamaConfig(**CONFIGS[name], attn_implementation="eager")
    hf = transformers.LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in pname else 0.08 * noise)
    config = text_config_from_hf(hf.config.to_dict())
    ours = build_model("llama", config).eval()
    state = {hf_to_artifact_name(k): v for k, v in hf.state_dict().items()}
    state.pop(None, None)
    if config["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)
    ours.load_state_dict(state, strict=True)
    return hf, ours


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request):
    return make_pair(request.param)


@pytest.fixture(scope="module")
def tied_pair():
    return make_pair("tied", seed=1)


class Runner:
    """Our model on its own cache; pages handed out from a shuffled pool, so they are not contiguous."""

    def __init__(self, model: LlamaForCausalLM, num_pages: int = 64, seed: int = 0):
        self.model = model
        self.cache = ModelCache(model.cache_spec(), num_pages, PAGE_SIZE, num_state_slots=1, dtype=torch.float32)
        self.free = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
        self.pages: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, new_tokens: dict[int, list[int]], all_rows: bool = False) -> torch.Tensor:
        """Append tokens to sequences (one ragged batch); logits of every new row or of each last row."""
        for sid, toks in new_tokens.items():
            n = self.lens.setdefault(sid, 0) + len(toks)
            pages = self.pages.setdefault(sid, [])
            while len(pages) * PAGE_SIZE < n:
                pages.append(self.free.pop())
        sids = list(new_tokens)
        batch = ForwardBatch.build(
            [new_tokens[s] for s in sids], [self.lens[s] for s in sids], [self.pages[s] for s in sids], PAGE_SIZE,
        )
        for s in sids:
            self.lens[s] += len(new_tokens[s])
        if all_rows:
            batch.logits_indices = torch.arange(batch.input_ids.numel())
        rows = batch.logits_indices if batch.logits_indices is not None else batch.last_token_indices()
        with torch.no_grad():
            hidden = self.model(batch, self.cache)
            return self.model.compute_logits(hidden[rows])


def random_tokens(n: int, seed: int, vocab: int = 101) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    diff = (ours - ref).abs().max().item()
    assert diff <= ATOL, f"max abs logit diff {diff:.3g} > {ATOL}"


def test_prefill_logits_every_position(pair):
    hf, ours = pair
    tokens = random_tokens(23, seed=1)
    logits = Runner(ours).step({0: tokens}, all_rows=True)
    assert logits.dtype == torch.float32 and logits.shape == (23, 101)
    assert_close(logits, hf_logits(hf, tokens))


def test_chunked_prefill_matches(pair):
    hf, ours = pair
    tokens = random_tokens(21, seed=2)
    ref = hf_logits(hf, tokens)
    runner, pos = Runner(ours, seed=3), 0
    for size in (3, 5, 21 - 8):
        last = runner.step({0: tokens[pos : pos + size]})
        pos += size
        assert_close(last[0], ref[pos - 1])  # each chunk's last row, not only the final one


def test_greedy_decode_16_steps(pair):
    hf, ours = pair
    prompt = random_tokens(9, seed=4)
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        hf_steps = [out.logits[0, -1]]
        for _ in range(16):  # HF decodes on its own KV cache
            out = hf(hf_steps[-1].argmax().view(1, 1), cache=out.cache, use_cache=True)
            hf_steps.append(out.logits[0, -1])
    runner = Runner(ours, seed=5)
    our_steps = [runner.step({0: prompt})[0]]
    for _ in range(16):
        our_steps.append(runner.step({0: [int(our_steps[-1].argmax())]})[0])
    assert [int(x.argmax()) for x in our_steps] == [int(x.argmax()) for x in hf_steps]
    assert_close(torch.stack(our_steps), torch.stack(hf_steps))


def test_ragged_batch_equals_separate_runs(tied_pair):
    _, ours = tied_pair
    seqs = {0: random_tokens(14, seed=6), 1: random_tokens(7, seed=7), 2: random_tokens(12, seed=8)}
    # Sequence 0 has 4 tokens cached and prefills a chunk of 10; sequences 1 and 2 decode one token.
    cached = {0: 4, 1: 6, 2: 11}

    separate = []
    for sid, toks in seqs.items():
        runner = Runner(ours, seed=10 + sid)
        runner.step({sid: toks[: cached[sid]]})
        separate.append(runner.step({sid: toks[cached[sid]:]}, all_rows=True))
    separate = torch.cat(separate)

    runner = Runner(ours, seed=20)
    runner.step({sid: toks[: cached[sid]] for sid, toks in seqs.items()})  # a ragged prefill, too
    batch_pages = [p for pages in runner.pages.values() for p in pages]
    assert batch_pages != sorted(batch_pages), "pages should be shuffled"
    mixed = runner.step({sid: toks[cached[sid]:] for sid, toks in seqs.items()}, all_rows=True)
    assert mixed.shape == (10 + 1 + 1, 101)
    assert_close(mixed, separate)


def test_inputs_embeds_replace_lookup(tied_pair):
    _, ours = tied_pair
    tokens = random_tokens(6, seed=9)
    by_ids = Runner(ours).step({0: tokens}, all_rows=True)
    runner = Runner(ours)
    batch = ForwardBatch.build([tokens], [0], [runner.free[:2]], PAGE_SIZE)
    batch.inputs_embeds = ours.embed_tokens(batch.input_ids)
    batch.input_ids = torch.zeros_like(batch.input_ids)  # must be ignored
    with torch.no_grad():
        by_embeds = ours.compute_logits(ours(batch, runner.cache))
    torch.testing.assert_close(by_embeds, by_ids, rtol=0, atol=1e-6)


def test_init_random_is_deterministic_and_neutral_norms():
    a, b = LlamaForCausalLM(CONFIGS["llama3"]), LlamaForCausalLM(CONFIGS["llama3"])
    a.init_random_(123)
    b.init_random_(123)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert torch.all(a.norm.weight == 1) and torch.all(a.layers[0].self_attn.q_proj.bias == 0)
    assert abs(a.embed_tokens.weight.std().item() - 0.02) < 0.002


def test_cast_keeps_fp32_rope_and_spec():
    model = LlamaForCausalLM(CONFIGS["llama3"]).to(torch.bfloat16)
    assert model.rotary.inv_freq.dtype == torch.float32
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    spec = model.cache_spec()
    assert (spec.num_attn_layers, spec.num_kv_heads, spec.head_dim) == (3, 1, 32)
    assert not hasattr(LlamaForCausalLM(CONFIGS["tied"]), "lm_head")


def test_hf_names():
    assert hf_to_artifact_name("model.layers.3.self_attn.q_proj.weight") == "layers.3.self_attn.q_proj.weight"
    assert hf_to_artifact_name("model.norm.weight") == "norm.weight"
    assert hf_to_artifact_name("lm_head.weight") == "lm_head.weight"
    assert hf_to_artifact_name("model.layers.0.self_attn.rotary_emb.inv_freq") is None
