"""The proposal head (`--lm-head-draft`): the trunk's lm_head restricted to a shortlist of tokens.

A drafting step's vocabulary projection reads the whole lm_head (27B: 248,320 x 5,120 bf16, 2.5 GB),
which costs a drafter step more than its one decoder layer. Drafts only choose which tokens the
target checks, never which tokens it emits, so they may be scored on fewer rows: the head keeps the
lm_head rows of `num_tokens` tokens (most frequent first) and maps the argmax back to a vocabulary id.
A token outside the shortlist can never be drafted, which costs acceptance, not correctness.

Component `draft_head` of the artifact: `weight` [N, H] (the lm_head rows) and `token_ids` [N] int64,
config {num_tokens, hidden_size, ranking}. `ninfer convert-draft-head` adds it to an artifact.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from torch import nn

from ninfer.kernels.linear import linear


class DraftHead(nn.Module):
    def __init__(self, num_tokens: int, hidden_size: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_tokens, hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.register_buffer("token_ids", torch.zeros(num_tokens, dtype=torch.int64, device=device))

    def propose(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy drafts [B] (vocabulary ids) from hidden states [B, H]; device ops only."""
        nvfp4 = self.__dict__.get("nvfp4")
        if nvfp4 is not None:
            return self.token_ids[nvfp4(hidden.to(torch.bfloat16)).argmax(-1)]
        scores = linear(hidden.to(self.weight.dtype), self.weight)
        return self.token_ids[scores.argmax(-1)]

    def quantize_nvfp4_(self) -> "DraftHead":
        """Score drafts on an NVFP4 copy of the rows (the NVFP4 GEMV: ~0.28x the bytes a drafting step reads
        here). Drafts only choose what the target checks, so output is unchanged; acceptance may move where two
        rows' scores lie within the 4-bit error. The bf16 rows stay the state dict's (kept outside the module
        tree, the copy is not saved or moved with it)."""
        from ninfer.quant.nvfp4 import NVFP4Linear, quantize_nvfp4

        self.__dict__["nvfp4"] = NVFP4Linear.from_weights(quantize_nvfp4(self.weight.detach()))
        return self


def rank_tokens(vocab_size: int, num_tokens: int, *, corpus_ids: list[int] | None = None,
                always: list[int] = ()) -> list[int]:
    """The shortlist: `always` (control tokens a drafter must be able to propose), then the tokens most
    frequent in `corpus_ids` (a tokenized sample of the target's traffic), then the rest in id order
    (byte-level BPE gives frequent merges low ids), cut at num_tokens. Sorted by id."""
    order: list[int] = [t for t in always if 0 <= t < vocab_size]
    if corpus_ids:
        order += [t for t, _ in Counter(t for t in corpus_ids if 0 <= t < vocab_size).most_common()]
    order += range(vocab_size)
    chosen, seen = [], set()
    for t in order:
        if t not in seen:
            seen.add(t)
            chosen.append(t)
            if len(chosen) == num_tokens:
                break
    return sorted(chosen)


def build_draft_head_tensors(lm_head: torch.Tensor, token_ids: list[int]) -> dict[str, torch.Tensor]:
    """The component's tensors from the trunk's lm_head weight [V, H] (the embedding when tied)."""
    ids = torch.tensor(token_ids, dtype=torch.int64)
    return {"weight": lm_head[ids].contiguous(), "token_ids": ids}


def add_draft_head(artifact_in: str | Path, out_path: str | Path, num_tokens: int,
                   corpus: str | Path | None = None) -> Path:
    """Write a copy of `artifact_in` with a `draft_head` component of `num_tokens` rows, ranked by the
    tokenized `corpus` text when given (ranking "corpus"), else by id ("id")."""
    from safetensors import safe_open

    from ninfer.artifact.container import Artifact, Manifest, write_artifact
    from ninfer.tokenizer import Tokenizer

    art = Artifact(artifact_in)
    text = art.config("text")
    vocab, hidden = text["vocab_size"], text["hidden_size"]
    if not 0 < num_tokens <= vocab:
        raise ValueError(f"a proposal head of {num_tokens} tokens: must be 1..{vocab}")
    with safe_open(str(art.path), framework="pt", device="cpu") as f:
        tensors = {name: f.get_tensor(name) for name in art.tensor_names if not name.startswith("draft_head.")}
    head_name = "text.lm_head.weight" if "text.lm_head.weight" in tensors else "text.embed_tokens.weight"
    if head_name not in tensors:
        raise ValueError(f"{art.path}: no bf16 lm_head or embedding to shortlist (quantized heads are not supported)")
    tokenizer = Tokenizer.from_json_str(art.tokenizer_json)
    corpus_ids = tokenizer.encode(Path(corpus).read_text()) if corpus else None
    always = sorted(set(art.manifest.extra.get("eos_token_ids", [])) | set(tokenizer.special_token_ids))
    ids = rank_tokens(vocab, num_tokens, corpus_ids=corpus_ids, always=always)
    for name, t in build_draft_head_tensors(tensors[head_name], ids).items():
        tensors[f"draft_head.{name}"] = t
    m = art.manifest
    components = {**m.components, "draft_head": {"num_tokens": num_tokens, "hidden_size": hidden,
                                                 "ranking": "corpus" if corpus else "id"}}
    manifest = Manifest(m.name, m.architecture, components, m.quantization, m.sampling_presets, m.extra)
    write_artifact(out_path, tensors, manifest, art.tokenizer_json, art.chat_template)
    return Path(out_path)
