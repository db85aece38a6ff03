"""Parsing Qwen's XML tool-call format out of a finished answer.

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

A tool region is accepted only when it is made of complete calls to declared tools up to the end of
the answer; otherwise it stays ordinary text and the first failure is reported as the fallback reason.
Parameter values are raw text: the format has no escape, so a value may contain call markers and
balanced nested <parameter=...>...</parameter> blocks, but an unmatched nested opener or a stray
closer makes the region ambiguous, hence malformed.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from ninfer.chat.tool_schema import FORMAT_WHITESPACE

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"

MAX_TOOL_NAME_CHARS = 256  # namespaced names (namespace__name) run longer than OpenAI's 64
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]+")


class FallbackReason(str, enum.Enum):
    NONE = "none"
    MALFORMED_STRUCTURE = "malformed_structure"
    DUPLICATE_PARAMETER = "duplicate_parameter"
    INVALID_TOOL_NAME = "invalid_tool_name"
    UNDECLARED_TOOL = "undeclared_tool"
    TRAILING_CONTENT = "trailing_content"


@dataclass
class RawCall:
    name: str  # the name the model wrote (a prompt tool name)
    parameters: list[tuple[str, str]] = field(default_factory=list)  # (key, raw value text) in written order


@dataclass
class RegionParse:
    accepted_at: int | None  # offset of the marker that opens the accepted calls, None: plain text
    calls: list[RawCall]
    fallback: FallbackReason


def parse_tool_region(text: str, declared: Mapping[str, object]) -> RegionParse:
    """Try each <tool_call> of `text` in order; the first that opens calls running to the end wins.

    Prose may quote a marker before the real calls, so a failed earlier marker stays ordinary text.
    """
    first_failure: FallbackReason | None = None
    at = text.find(TOOL_OPEN)
    while at >= 0:
        reason, calls = _Region(text, at, declared).parse()
        if reason is FallbackReason.NONE:
            return RegionParse(at, calls, FallbackReason.NONE)
        first_failure = first_failure or reason
        at = text.find(TOOL_OPEN, at + 1)
    return RegionParse(None, [], first_failure or FallbackReason.NONE)


class _Region:
    def __init__(self, text: str, start: int, declared: Mapping[str, object]):
        self.text = text
        self.pos = start
        self.declared = declared

    def parse(self) -> tuple[FallbackReason, list[RawCall]]:
        calls: list[RawCall] = []
        while True:
            self._skip_whitespace()
            if self.pos == len(self.text):
                return (FallbackReason.NONE if calls else FallbackReason.MALFORMED_STRUCTURE), calls
            if not self.text.startswith(TOOL_OPEN, self.pos):
                return (FallbackReason.TRAILING_CONTENT if calls else FallbackReason.MALFORMED_STRUCTURE), calls
            call = RawCall(name="")
            reason = self._call(call)
            if reason is not FallbackReason.NONE:
                return reason, calls
            calls.append(call)

    def _skip_whitespace(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in FORMAT_WHITESPACE:
            self.pos += 1

    def _consume(self, token: str) -> bool:
        if self.text.startswith(token, self.pos):
            self.pos += len(token)
            return True
        return False

    def _call(self, call: RawCall) -> FallbackReason:
        self._consume(TOOL_OPEN)
        self._skip_whitespace()
        reason = self._function(call)
        if reason is not FallbackReason.NONE:
            return reason
        self._skip_whitespace()
        return FallbackReason.NONE if self._consume(TOOL_CLOSE) else FallbackReason.MALFORMED_STRUCTURE

    def _function(self, call: RawCall) -> FallbackReason:
        if not self._consume(FUNCTION_OPEN):
            return FallbackReason.MALFORMED_STRUCTURE
        name_end = self.text.find(">", self.pos)
        if name_end < 0:
            return FallbackReason.INVALID_TOOL_NAME
        call.name = self.text[self.pos:name_end]
        if len(call.name) > MAX_TOOL_NAME_CHARS or not _TOOL_NAME.fullmatch(call.name):
            return FallbackReason.INVALID_TOOL_NAME
        if call.name not in self.declared:
            return FallbackReason.UNDECLARED_TOOL
        self.pos = name_end + 1
        while True:
            self._skip_whitespace()
            if self._consume(FUNCTION_CLOSE):
                return FallbackReason.NONE
            reason = self._parameter(call)
            if reason is not FallbackReason.NONE:
                return reason

    def _parameter(self, call: RawCall) -> FallbackReason:
        if not self._consume(PARAMETER_OPEN):
            return FallbackReason.MALFORMED_STRUCTURE
        name_end = self.text.find(">", self.pos)
        if name_end <= self.pos:
            return FallbackReason.MALFORMED_STRUCTURE
        key = self.text[self.pos:name_end]
        if any(key == seen for seen, _ in call.parameters):
            return FallbackReason.DUPLICATE_PARAMETER
        value_end = self._value_end(name_end + 1)
        if value_end is None:
            return FallbackReason.MALFORMED_STRUCTURE
        call.parameters.append((key, self.text[name_end + 1:value_end]))
        self.pos = value_end + len(PARAMETER_CLOSE)
        return FallbackReason.NONE

    def _value_end(self, begin: int) -> int | None:
        """Offset of the </parameter> closing the value at `begin`, skipping balanced nested blocks."""
        depth, scan = 1, begin
        while True:
            close = self.text.find(PARAMETER_CLOSE, scan)
            if close < 0:
                return None
            nested = self._nested_opener_end(scan, close)
            if nested is not None:
                depth, scan = depth + 1, nested
                continue
            depth -= 1
            if depth == 0:
                return close
            scan = close + len(PARAMETER_CLOSE)

    def _nested_opener_end(self, scan: int, limit: int) -> int | None:
        """End of the first complete <parameter=NAME> between `scan` and `limit`."""
        at = self.text.find(PARAMETER_OPEN, scan, limit)
        while at >= 0:
            name_begin = at + len(PARAMETER_OPEN)
            name_end = self.text.find(">", name_begin, limit)
            if name_end > name_begin:
                return name_end + 1
            at = self.text.find(PARAMETER_OPEN, at + 1, limit)
        return None
