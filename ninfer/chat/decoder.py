"""The streaming output decoder: engine text per channel -> reasoning, content and tool-call deltas.

The engine already splits reasoning from the answer at the close marker. This decoder drops the
line breaks the template puts between the two, and, when tools may be called, holds back only what
could still become Qwen's tool region: trailing whitespace and a partial `<tool_call>` while it is
ambiguous, then everything from a complete marker to the end of the output, which is parsed at
finish. What every step emits depends only on the text received so far, never on how it was split,
and a region that does not parse returns to the content byte for byte.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

from ninfer.chat.ir import DecodedOutput, OutputDelta, ToolCall, ToolDef, ToolParseStats
from ninfer.chat.lowering import prompt_tool_name
from ninfer.chat.qwen_tool_parser import TOOL_OPEN, FallbackReason, parse_tool_region
from ninfer.chat.tool_schema import FORMAT_WHITESPACE, Disposition, ToolContract, normalize

REASONING = "reasoning"  # ninfer.engine.types.Channel.REASONING (a str enum): everything else is the answer


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class QwenToolCalls:
    """The effective tool set, by the name the model writes, and the typing of each call's arguments."""

    def __init__(self, tools: list[ToolDef], new_id: Callable[[], str] = new_call_id):
        self.contracts: dict[str, ToolContract] = {}
        for tool in tools:
            self.contracts.setdefault(prompt_tool_name(tool.namespace, tool.name), ToolContract.of(tool))
        self.new_id = new_id

    def parse(self, region: str, stats: ToolParseStats) -> tuple[str, list[ToolCall], FallbackReason]:
        """(content before the calls, calls, fallback reason); on fallback the whole region is content."""
        parsed = parse_tool_region(region, self.contracts)
        if parsed.accepted_at is None:
            return region, [], parsed.fallback
        calls = []
        for raw in parsed.calls:
            contract = self.contracts[raw.name]
            arguments = {}
            for key, text in raw.parameters:
                disposition, value = normalize(text, contract, key)
                if disposition is Disposition.OMITTED:
                    stats.empty_arguments_omitted += 1
                    continue
                if disposition is Disposition.MISMATCH:
                    stats.schema_mismatch_arguments += 1
                arguments[key] = value
            tool = contract.tool
            calls.append(ToolCall(call_id=self.new_id(), name=tool.name, arguments=arguments,
                                  namespace=tool.namespace))
        return region[: parsed.accepted_at].rstrip(FORMAT_WHITESPACE), calls, FallbackReason.NONE


class OutputDecoder:
    """feed(text, channel) -> deltas while tokens commit; finish() -> (last deltas, the decoded output)."""

    def __init__(self, *, starts_in_reasoning: bool, tool_calls: QwenToolCalls | None = None):
        self._tool_calls = tool_calls
        self._strip_answer_start = starts_in_reasoning  # the template's break after </think> is not content
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._held = ""  # trailing whitespace and a partial marker, released when ambiguity ends
        self._region: list[str] | None = None  # from a complete marker on, parsed at finish
        self._finished = False

    def feed(self, text: str, channel: str) -> list[OutputDelta]:
        if self._finished:
            raise RuntimeError("the output decoder is already finished")
        if not text:
            return []
        if channel == REASONING:
            self._reasoning.append(text)
            return [OutputDelta(reasoning=text)]
        if self._strip_answer_start:
            text = text.lstrip(FORMAT_WHITESPACE + "\f\v")
            if not text:
                return []
            self._strip_answer_start = False
        visible = text if self._tool_calls is None else self._hold_tool_region(text)
        return self._content_delta(visible)

    def finish(self) -> tuple[list[OutputDelta], DecodedOutput]:
        if self._finished:
            raise RuntimeError("the output decoder is already finished")
        self._finished = True
        stats = ToolParseStats(marker_seen=self._region is not None)
        calls: list[ToolCall] = []
        fallback = FallbackReason.NONE
        tail = self._held
        if self._region is not None:
            assert self._tool_calls is not None
            tail, calls, fallback = self._tool_calls.parse("".join(self._region), stats)
        deltas = self._content_delta(tail)
        for index, call in enumerate(calls):
            deltas.append(OutputDelta(tool_call_start=call))
            deltas.append(OutputDelta(tool_call_arguments=(index, call.arguments_json())))
        result = DecodedOutput(reasoning="".join(self._reasoning), content="".join(self._content),
                               tool_calls=calls, fallback_reason=fallback.value, tool_parse=stats)
        return deltas, result

    def _content_delta(self, text: str) -> list[OutputDelta]:
        if not text:
            return []
        self._content.append(text)
        return [OutputDelta(content=text)]

    def _hold_tool_region(self, text: str) -> str:
        """The part of `text` that can no longer belong to a tool region."""
        if self._region is not None:
            self._region.append(text)
            return ""
        buffer = self._held + text
        marker = buffer.find(TOOL_OPEN)
        if marker >= 0:
            start = _whitespace_run_start(buffer, marker)
            self._region, self._held = [buffer[start:]], ""
            return buffer[:start]
        start = _whitespace_run_start(buffer, len(buffer) - _partial_marker(buffer))
        self._held = buffer[start:]
        return buffer[:start]


def _partial_marker(text: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of the marker."""
    for size in range(min(len(text), len(TOOL_OPEN) - 1), 0, -1):
        if text.endswith(TOOL_OPEN[:size]):
            return size
    return 0


def _whitespace_run_start(text: str, end: int) -> int:
    """Start of the whitespace run that ends at `end` (whitespace right before calls is not content)."""
    while end > 0 and text[end - 1] in FORMAT_WHITESPACE:
        end -= 1
    return end
