"""The real SmolLM2-135M-Instruct GGUF: convert it, then greedy-decode like transformers does.

The artifact stores bf16, so transformers runs the same GGUF rounded to bf16 and back; both then
compute in float32, where exact greedy parity is a fair demand (in bf16 near-ties split).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from ninfer.artifact.container import Artifact  # noqa: E402
from ninfer.artifact.convert_gguf import default_smollm2_gguf, unpermute_rotary  # noqa: E402
from ninfer.forward import ForwardBatch, ModelCache  # noqa: E402
from ninfer.models import build_model  # noqa: E402

NEW_TOKENS = 24
PAGE_SIZE = 16
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]


@pytest.fixture(scope="session")
def gguf_path():
    try:
        return default_smollm2_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def artifact(gguf_path, smollm2_path):
    return Artifact(smollm2_path)  # converted once per run (tests/conftest.py)


def prompt_ids(artifact: Artifact, messages: list[dict]) -> list[int]:
    # Rendered the way transformers' apply_chat_template does (sandboxed, trim/lstrip blocks).
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(artifact.chat_template).render(messages=messages, add_generation_prompt=True)
    return Tokenizer.from_str(artifact.tokenizer_json).encode(text, add_special_tokens=False).ids


def our_greedy(artifact: Artifact, prompts: list[list[int]], eos: set[int]) -> list[list[int]]:
    """All prompts in one ragged batch: one prefill step, then batched decode steps."""
    model = build_model(artifact.architecture, artifact.config()).eval()
    model.load_state_dict(artifact.load(dtype=torch.float32)["text"], strict=True)
    pages_each = -(-(max(map(len, prompts)) + NEW_TOKENS) // PAGE_SIZE)
    cache = ModelCache(model.cache_spec(), pages_each * len(prompts), PAGE_SIZE, 1, torch.float32)
    tables = [list(range(i * pages_each, (i + 1) * pages_each)) for i in range(len(prompts))]
    outs: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    step = {i: prompts[i] for i in live}
    cached = [0] * len(prompts)
    with torch.no_grad():
        while live:
            batch = ForwardBatch.build([step[i] for i in live], [cached[i] for i in live],
                                       [tables[i] for i in live], PAGE_SIZE)
            logits = model.compute_logits(model(batch, cache)[batch.last_token_indices()])
            for i, tok in zip(live, logits.argmax(-1).tolist(), strict=True):
                cached[i] += len(step[i])
                outs[i].append(tok)
                step[i] = [tok]
            live = [i for i in live if outs[i][-1] not in eos and len(outs[i]) < NEW_TOKENS]
    return outs


def hf_greedy(gguf_path, prompts: list[list[int]]) -> list[list[int]]:
    model = transformers.LlamaForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="eager",
    ).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # the weights the artifact holds
        outs = []
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=NEW_TOKENS, do_sample=False, top_p=None, top_k=None,
                                 temperature=None)
            outs.append(out[0, len(ids):].tolist())
    return outs


@pytest.mark.parametrize("shape,heads", [((9 * 64, 576), 9), ((3 * 64, 576), 3), ((3 * 64,), 3)])
def test_unpermute_matches_transformers(shape, heads):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = torch.randn(shape)
    ref = LlamaTensorProcessor()._reverse_permute_weights(w.numpy(), heads, heads)
    assert torch.equal(unpermute_rotary(w, heads), torch.from_numpy(ref))


def test_artifact_manifest(artifact):
    m = artifact.manifest
    assert (m.name, m.architecture) == ("smollm2-135m-instruct", "llama")
    assert m.extra["eos_token_ids"] == [2] and m.extra["add_bos"] is False
    cfg = artifact.config()
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)
    assert cfg["tie_word_embeddings"] and "text.lm_head.weight" not in artifact.tensor_names
    assert "<|im_start|>" in artifact.chat_template


@pytest.mark.slow
def test_greedy_matches_transformers(artifact, gguf_path):
    prompts = [prompt_ids(artifact, conv) for conv in CONVERSATIONS]
    ours = our_greedy(artifact, prompts, set(artifact.manifest.extra["eos_token_ids"]))
    ref = hf_greedy(gguf_path, prompts)
    assert ours == ref
    assert all(len(out) >= 8 for out in ours)  # real continuations, not an immediate EOS


def test_embedded_default_carries_the_model_cards_sampling(artifact):
    """SmolLM2-Instruct's card recommends temperature 0.2 / top-p 0.9 (contract: presets by architecture
    and mode; the engine falls back to the artifact's presets before its generic defaults)."""
    assert artifact.manifest.sampling_presets["non_thinking"] == {"temperature": 0.2, "top_p": 0.9}
