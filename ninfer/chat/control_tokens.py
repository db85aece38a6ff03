"""Control tokens in rendered prompts: only the template may write them.

Client text (message content, tool data, template kwargs) is made inert before rendering: every
character that begins a control-token spelling is swapped for a private-use stand-in, one for one,
so no spelling can start inside client text and the template's string logic sees no markers there.
After rendering, the control-token spellings left in the text are the template's own; the stand-ins
are swapped back and the text between two template control tokens is encoded as plain text, which
is exactly how the tokenizer would split it at those tokens anyway.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from typing import Any

from ninfer.chat.errors import ChatTemplateError, InvalidPromptError
from ninfer.tokenizer import Tokenizer

# Supplementary Private Use Area B, reserved for the server: stand-ins for control-token characters,
# then the delimiters of the probe markers that locate client text in a rendered prompt.
_STAND_IN_BASE = 0x10F000
MARK_OPEN, MARK_CLOSE = "\U0010F100", "\U0010F101"
_RESERVED = re.compile("[\U0010F000-\U0010F1FF]")
_MARKER = re.compile(f"{MARK_OPEN}(\\d+){MARK_CLOSE}")


def marker(k: int) -> str:
    """A probe marker: non-whitespace, free of control spellings, and never in client text."""
    return f"{MARK_OPEN}{k}{MARK_CLOSE}"


def find_markers(text: str) -> list[tuple[int, int, int]]:
    """(start, end, k) of every probe marker in `text`."""
    return [(m.start(), m.end(), int(m.group(1))) for m in _MARKER.finditer(text)]


class ControlTokens:
    """The tokenizer's added-token spellings, and the stand-ins that keep them out of client text."""

    def __init__(self, tokenizer: Tokenizer):
        self.ids: dict[str, int] = dict(tokenizer.added_tokens)
        # Leftmost, then longest: how the tokenizer itself matches added tokens.
        ordered = sorted(self.ids, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        # Whitespace-only added tokens (some tokenizers have "\n" tokens) stay matchable in any text,
        # as the tokenizer matches them; guarding whitespace would break the templates' trimming.
        guarded = [s for s in ordered if not s.isspace()]
        # A spelling's first character is swapped wherever it occurs when it is punctuation (the usual
        # "<"), so a spelling cannot begin in client text and be completed by the template; a spelling
        # that starts with a letter or space is only swapped where it occurs whole.
        self._swap_everywhere = sorted({s[0] for s in guarded if not (s[0].isalnum() or s[0].isspace())})
        self._swap_whole = [s for s in guarded if s[0] not in self._swap_everywhere]
        firsts = sorted({s[0] for s in guarded})
        if len(firsts) > 0x100:
            raise ChatTemplateError("the tokenizer's added tokens start with too many distinct characters")
        self._stand_in = {c: chr(_STAND_IN_BASE + k) for k, c in enumerate(firsts)}
        self._restore = {ord(v): k for k, v in self._stand_in.items()}
        self._whole_pattern = (re.compile("|".join(map(re.escape, self._swap_whole))) if self._swap_whole else None)
        self._everywhere_table = {ord(c): self._stand_in[c] for c in self._swap_everywhere}

    def inert(self, text: str) -> str:
        """`text` with every control-token spelling disarmed (same length, restorable by `restore`)."""
        if _RESERVED.search(text):
            # A stand-in already in the text would come back as the character it stands for.
            raise InvalidPromptError("the private-use characters U+10F000..U+10F1FF are reserved by the server")
        text = text.translate(self._everywhere_table)
        if self._whole_pattern is not None:
            text = self._whole_pattern.sub(lambda m: self._stand_in[m.group(0)[0]] + m.group(0)[1:], text)
        return text

    def inert_value(self, value: Any) -> Any:
        """Disarm every string inside a JSON-like value, object keys included (templates print both)."""
        if isinstance(value, str):
            return self.inert(value)
        if isinstance(value, dict):
            return {self.inert(k) if isinstance(k, str) else k: self.inert_value(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.inert_value(v) for v in value]
        return value

    def restore(self, text: str) -> str:
        return text.translate(self._restore)

    def find(self, text: str) -> list[tuple[int, int, str]]:
        """(start, end, spelling) of every control token in `text`, left to right."""
        if self._pattern is None:
            return []
        return [(m.start(), m.end(), m.group(0)) for m in self._pattern.finditer(text)]


@dataclass
class _Chunk:
    start: int  # character offsets into the prompt text
    end: int
    first_token: int  # index of the chunk's first token in the prompt's token ids
    ids: list[int]
    control: bool  # one control token, or plain text


@dataclass
class TokenizedText:
    """Token ids of a rendered prompt and the map from character offsets to token offsets."""

    text: str
    ids: list[int] = field(default_factory=list)
    chunks: list[_Chunk] = field(default_factory=list)
    controls: list[tuple[int, int, str]] = field(default_factory=list)  # the template's control tokens
    _starts: list[int] = field(default_factory=list, repr=False)

    def token_offset(self, char_offset: int, tokenizer: Tokenizer) -> int | None:
        """Number of tokens before `char_offset`, or None when no token boundary falls there."""
        if char_offset == len(self.text):
            return len(self.ids)
        if len(self._starts) != len(self.chunks):
            self._starts = [c.start for c in self.chunks]
        k = bisect.bisect_right(self._starts, char_offset) - 1
        if k < 0:
            return 0 if char_offset == 0 else None
        chunk = self.chunks[k]
        if char_offset == chunk.start:
            return chunk.first_token
        if chunk.control:
            return None
        # Inside plain text: a boundary exists when the text before it encodes to a prefix of the chunk.
        head = tokenizer.encode(self.text[chunk.start:char_offset])
        if chunk.ids[: len(head)] == head:
            return chunk.first_token + len(head)
        return None


def tokenize_rendered(inert_text: str, controls: ControlTokens, tokenizer: Tokenizer) -> TokenizedText:
    """Encode a prompt rendered from inert client text: template control tokens by id, the rest as text."""
    found = controls.find(inert_text)
    text = controls.restore(inert_text)
    out = TokenizedText(text=text, controls=found)
    pos = 0
    for start, end, spelling in found:
        if start > pos:
            _append(out, pos, start, tokenizer.encode(text[pos:start]), control=False)
        _append(out, start, end, [controls.ids[spelling]], control=True)
        pos = end
    if pos < len(text):
        _append(out, pos, len(text), tokenizer.encode(text[pos:]), control=False)
    return out


def _append(out: TokenizedText, start: int, end: int, ids: list[int], control: bool) -> None:
    out.chunks.append(_Chunk(start, end, len(out.ids), ids, control))
    out.ids.extend(ids)
