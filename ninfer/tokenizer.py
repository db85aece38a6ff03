"""Tokenizer: a thin wrapper over a HF `tokenizers` tokenizer.json, plus a streaming detokenizer.

Two backend instances are kept so that encoding never toggles shared state (thread-safe):
one matches control-token spellings ("<|im_start|>", "<think>") to their ids, for rendered chat
templates; the other encodes them as ordinary text, for anything a client wrote.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer as _HFTokenizer

REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    def __init__(self, tokenizer_json: str):
        self._with_special = _HFTokenizer.from_str(tokenizer_json)
        self._text_only = _HFTokenizer.from_str(
            _mark_added_tokens_special(tokenizer_json, self._with_special)
        )
        # `encode_special_tokens` only stops matching added tokens marked special; every added token
        # is special in this instance (see _mark_added_tokens_special), so none is matched.
        self._text_only.encode_special_tokens = True
        added = self._with_special.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(i for i, tok in added.items() if tok.special)
        # Every added token, special or not: the spellings a chat template may write as control tokens.
        self.added_tokens: dict[str, int] = {tok.content: i for i, tok in sorted(added.items())}

    @classmethod
    def from_json_str(cls, text: str) -> "Tokenizer":
        return _parsed(text) if cls is Tokenizer else cls(text)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Tokenizer":
        with open(path, encoding="utf-8") as f:
            return cls(f.read())

    @property
    def vocab_size(self) -> int:
        return self._with_special.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Token ids of `text`; never adds BOS/EOS. Control-token spellings map to their ids only
        with allow_special (rendered templates), otherwise they are encoded as plain text."""
        backend = self._with_special if allow_special else self._text_only
        return backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._with_special.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._with_special.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._with_special.id_to_token(token_id)

    def incremental_decoder(
        self, *, context_ids: Sequence[int] = (), skip_special_tokens: bool = False
    ) -> "IncrementalDecoder":
        return IncrementalDecoder(self, context_ids=context_ids, skip_special_tokens=skip_special_tokens)


def _mark_added_tokens_special(tokenizer_json: str, backend: _HFTokenizer) -> str:
    """The same tokenizer.json with every added token flagged special.

    `encode_special_tokens` leaves non-special added tokens (e.g. a GGUF's user-defined `<think>`)
    matched whole, so the text-only instance must see them as special too."""
    if all(tok.special for tok in backend.get_added_tokens_decoder().values()):
        return tokenizer_json  # the common case (Qwen): skip re-serializing a 12 MB JSON
    data = json.loads(tokenizer_json)
    for entry in data.get("added_tokens", []):
        entry["special"] = True
    return json.dumps(data, ensure_ascii=False)


class IncrementalDecoder:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character.

    Uses the prefix/read offset scheme of vLLM and TGI: each push decodes only a short window
    (from `prefix_offset`) and emits what it adds beyond the window's already-emitted part. Text is
    held back while the window ends in U+FFFD (an incomplete byte sequence, e.g. half an emoji).
    Decoding a window rather than single tokens keeps sentencepiece leading spaces right: the
    decoder strips a space only from the window's first token, which is never part of a delta.
    """

    def __init__(
        self, tokenizer: Tokenizer, *, context_ids: Sequence[int] = (), skip_special_tokens: bool = False
    ):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # A few already-decoded tokens (e.g. the prompt's tail) as context, so the first generated
        # token keeps its leading space; none of their text is emitted.
        self._ids: list[int] = list(context_ids)[-6:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def push(self, token_ids: Iterable[int]) -> str:
        """Append tokens; return the newly completed text (possibly "")."""
        self._ids.extend(token_ids)
        text = self._decode(self._ids[self._prefix_offset :])
        if text.endswith(REPLACEMENT_CHAR) or len(text) <= len(self._prefix_text):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """Whatever is still held back, even if it ends in a replacement character."""
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= len(self._prefix_text):
            return ""
        return self._advance(text)

    def _advance(self, text: str) -> str:
        delta = text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        # Drop ids before the window so a long stream does not grow memory.
        if self._prefix_offset > 64:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta


@functools.lru_cache(maxsize=4)
def _parsed(tokenizer_json: str) -> Tokenizer:
    """One Tokenizer per distinct tokenizer.json in a process: parsing Qwen's 151k-token vocabulary twice takes
    ~2.5 s on a laptop core, and a process that loads an artifact's engine, router and proposal head (or a test
    run's many engines) would pay it each time. Safe to share: a Tokenizer never changes after construction."""
    return Tokenizer(tokenizer_json)
