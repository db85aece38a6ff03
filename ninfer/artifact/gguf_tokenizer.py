"""A GGUF file's tokenizer as a HF tokenizer.json, built the way transformers builds it for
`AutoTokenizer.from_pretrained(folder, gguf_file=...)` (convert time only: transformers is imported lazily).
"""

from __future__ import annotations

import os
from typing import Any


def tokenizer_from_gguf(path: str | os.PathLike) -> tuple[str, str | None, dict[str, Any]]:
    """(tokenizer.json text, chat template or None, info) for the GGUF at `path`.

    info: bos/eos/pad/unk token ids (None when the file names none) and add_bos/add_eos, which
    say whether the model expects BOS/EOS around every sequence (our Tokenizer never adds them).
    """
    from tokenizers import AddedToken
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(os.fspath(path))
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)

    # transformers' tokenizer init also adds the named special tokens (bos/eos/unk/pad) that are not
    # added tokens yet, so they are matched whole; do the same to encode identically.
    added = {str(tok) for tok in backend.get_added_tokens_decoder().values()}
    named = [tokenizer_config.get(name) for name in ("bos_token", "eos_token", "unk_token", "pad_token")]
    missing = list(dict.fromkeys(tok for tok in named if tok and tok not in added))
    if missing:
        backend.add_tokens([AddedToken(tok, special=True) for tok in missing])

    info = {
        "architecture": architecture,
        "bos_token_id": tokenizer_dict.get("bos_token_id"),
        "eos_token_id": tokenizer_dict.get("eos_token_id"),
        "pad_token_id": tokenizer_dict.get("pad_token_id"),
        "unk_token_id": tokenizer_dict.get("unk_token_id"),
        # get_gguf_tokenizer already applies llama.cpp's defaults for files without the flag.
        "add_bos": bool(tokenizer_config.get("add_bos_token", False)),
        "add_eos": bool(tokenizer_config.get("add_eos_token", False)),
    }
    return backend.to_str(), tokenizer_config.get("chat_template"), info
