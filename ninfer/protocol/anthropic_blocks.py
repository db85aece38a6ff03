"""Anthropic content blocks -> conversation IR parts, role by role.

Each block either becomes a part or is refused here, where its wire path is known: block types the
server cannot execute are named with the missing capability, misplaced blocks with the role rule
they break.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

from ninfer.chat import ir
from ninfer.protocol.anthropic import (
    ImageBlock,
    OtherBlock,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from ninfer.protocol.errors import ProtocolError, invalid, unsupported
from ninfer.protocol.reasoning_seal import PREFIX as SEALED_PREFIX
from ninfer.protocol.reasoning_seal import SealError, unseal

_SERVER_TOOL_BLOCKS = ("server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
                       "code_execution_tool_result", "bash_code_execution_tool_result",
                       "text_editor_code_execution_tool_result", "tool_search_tool_result", "tool_reference")
_MISSING_CAPABILITY = {
    "document": ("documents_not_supported",
                 "document blocks need document ingestion and citations, which this server does not provide"),
    "search_result": ("search_results_not_supported",
                      "search_result blocks need search-result citations, which this server does not provide"),
    "container_upload": ("containers_not_supported",
                         "container uploads need a code-execution container, which this server does not run"),
    "mcp_tool_use": ("mcp_not_supported", "MCP blocks need a remote MCP connector, which this server does not run"),
    "mcp_tool_result": ("mcp_not_supported", "MCP blocks need a remote MCP connector, which this server does not run"),
    **{kind: ("server_tools_not_supported",
              f"{kind} blocks belong to server-executed tools; this server executes no tools") for kind in
       _SERVER_TOOL_BLOCKS},
}


def refuse_block(block: OtherBlock, param: str) -> ProtocolError:
    if block.type in _MISSING_CAPABILITY:
        code, why = _MISSING_CAPABILITY[block.type]
        return unsupported(f"{param}.type", code, why)
    return invalid(f"{param}.type: unknown content block type {block.type!r}", f"{param}.type")


@dataclass
class BlockContext:
    """What block lowering needs from the request: cache marks by block identity, and the --vision flag."""

    marks: dict[int, ir.CacheMark]
    vision: bool

    def mark(self, block: object) -> ir.CacheMark | None:
        return self.marks.get(id(block))


def image_part(block: ImageBlock, param: str, ctx: BlockContext) -> ir.ImagePart:
    """Validated like any media input, then refused while Vision is off (as Chat Completions does)."""
    source = block.source
    if source.type == "file":
        raise unsupported(f"{param}.source", "files_not_supported",
                          "file_id sources need the Files API, which this server does not provide")
    if source.type == "url":
        if not source.url.startswith(("http://", "https://")):
            raise ProtocolError(f"{param}.source.url: images must be http(s) URLs", param=f"{param}.source.url",
                                code="invalid_media")
        uri = source.url
    else:
        try:
            base64.b64decode(source.data, validate=True)
        except (binascii.Error, ValueError):
            raise ProtocolError(f"{param}.source.data: the image data is not valid base64",
                                param=f"{param}.source.data", code="invalid_media") from None
        uri = f"data:{source.media_type};base64,{source.data}"
    if not ctx.vision:
        raise ProtocolError(f"{param}: media input needs the server started with --vision", param=param,
                            code="vision_disabled")
    return ir.ImagePart(source=uri, cache=ctx.mark(block), param=f"{param}.source")


def user_part(block: object, param: str, ctx: BlockContext) -> ir.Part:
    if isinstance(block, TextBlock):
        return ir.TextPart(block.text, cache=ctx.mark(block))
    if isinstance(block, ImageBlock):
        return image_part(block, param, ctx)
    if isinstance(block, ToolResultBlock):
        return tool_result_part(block, param, ctx)
    if isinstance(block, OtherBlock):
        raise refuse_block(block, param)
    kind = getattr(block, "type", None)
    raise invalid(f"{param}.type: {kind!r} blocks are only valid in assistant messages", f"{param}.type")


def system_part(block: object, param: str, ctx: BlockContext) -> ir.Part:
    if isinstance(block, TextBlock):
        return ir.TextPart(block.text, cache=ctx.mark(block))
    if isinstance(block, OtherBlock):
        raise refuse_block(block, param)
    raise invalid(f"{param}.type: system messages hold text blocks only", f"{param}.type")


def assistant_part(block: object, param: str, ctx: BlockContext) -> ir.Part | None:
    """The part, or None for a block that carries nothing the prompt can show (redacted or empty thinking)."""
    if isinstance(block, TextBlock):
        return ir.TextPart(block.text, cache=ctx.mark(block))
    if isinstance(block, ThinkingBlock):
        reasoning = block.thinking or _sealed_reasoning(block.signature, param)
        return ir.ReasoningPart(reasoning) if reasoning else None
    if isinstance(block, RedactedThinkingBlock):
        return None  # another provider's encrypted reasoning: nothing this model can read
    if isinstance(block, ToolUseBlock):
        if block.caller is not None and block.caller.get("type") != "direct":
            raise unsupported(f"{param}.caller", "tool_caller_not_supported",
                              "only direct model calls are available; programmatic callers need a code-execution "
                              "container")
        return ir.ToolCallPart(call_id=block.id, name=block.name, arguments=block.input, cache=ctx.mark(block))
    if isinstance(block, OtherBlock):
        raise refuse_block(block, param)
    where = "user messages and tool results" if isinstance(block, ImageBlock) else "user messages"
    kind = getattr(block, "type", None)
    raise invalid(f"{param}.type: {kind!r} blocks are only valid in {where}", f"{param}.type")


def _sealed_reasoning(signature: str | None, param: str) -> str:
    """Hidden reasoning (display "omitted") restored from this server's signature, so the replayed prompt
    is the one the model saw; other providers' signatures carry nothing this model can read."""
    if not signature or not signature.startswith(SEALED_PREFIX):
        return ""
    try:
        return unseal(signature)
    except SealError as exc:
        raise invalid(f"{param}.signature: the thinking signature cannot be read: {exc}; pass thinking blocks "
                      "back unchanged", f"{param}.signature", "invalid_signature") from None


def tool_result_part(block: ToolResultBlock, param: str, ctx: BlockContext) -> ir.ToolResultPart:
    """Text and images keep their order; is_error is marked for the model by the prompt lowering."""
    content: list[ir.TextPart | ir.ImagePart] = []
    if isinstance(block.content, str):
        content.append(ir.TextPart(block.content))
    for j, inner in enumerate(block.content if isinstance(block.content, list) else []):
        where = f"{param}.content[{j}]"
        if isinstance(inner, TextBlock):
            content.append(ir.TextPart(inner.text, cache=ctx.mark(inner)))
        elif isinstance(inner, ImageBlock):
            content.append(image_part(inner, where, ctx))
        else:
            raise refuse_block(inner, where)
    return ir.ToolResultPart(call_id=block.tool_use_id, content=content, is_error=bool(block.is_error),
                             cache=ctx.mark(block))
