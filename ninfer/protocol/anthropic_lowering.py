"""Anthropic Messages -> one MessagesRequest: a protocol-free Conversation plus generation parameters.

Shared by POST /v1/messages and POST /v1/messages/count_tokens, so a count is taken over exactly the
prompt a generation would see (system, billing-block rule, history, tools, thinking mode, prefill,
cache markers); only output-side fields are skipped when counting.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ninfer.chat import ir
from ninfer.engine.types import SamplingParams
from ninfer.protocol.anthropic import (
    CustomTool,
    ImageBlock,
    MessagesBody,
    OtherTool,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingAdaptive,
    ThinkingBlock,
    ThinkingDisabled,
    ThinkingEnabled,
    ToolResultBlock,
    ToolUseBlock,
    parse_body,
)
from ninfer.protocol.anthropic_blocks import BlockContext, assistant_part, system_part, user_part
from ninfer.protocol.anthropic_cache import plan_cache_marks
from ninfer.protocol.anthropic_turns import (
    Turn,
    check_assistant_order,
    check_prefill,
    join,
    order_tool_results,
)
from ninfer.protocol.errors import ProtocolError, invalid, unsupported

BILLING_PREFIX = "x-anthropic-billing-header:"
MIN_THINKING_BUDGET = 1024
MAX_STOP_SEQUENCES = 4
_CACHEABLE = (TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock)


@dataclass(frozen=True)
class AnthropicDefaults:
    """Server settings that shape request lowering (startup flags)."""

    vision: bool = False
    default_max_tokens: int = 8192


@dataclass(frozen=True)
class ThinkingPlan:
    enable: bool | None = None  # the template's enable_thinking; None: the server's / template's default
    budget: int | None = None  # budget_tokens of thinking type "enabled", for the engine
    sealed: bool = False  # display "omitted": the reasoning travels only inside the signature


@dataclass
class MessagesRequest:
    model: str  # the client's label, echoed back; it does not select the artifact
    conversation: ir.Conversation
    thinking: ThinkingPlan
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None  # None: --default-max-tokens
    stop: list[str] = field(default_factory=list)
    stream: bool = False


def parse_messages_request(body: Any, defaults: AnthropicDefaults, *, counting: bool = False) -> MessagesRequest:
    """Validate and lower a decoded body; raises ProtocolError naming the offending field."""
    return _Lowering(parse_body(body), defaults, counting).run()


@dataclass
class _WireMessage:
    role: str
    param: str
    blocks: list[Any]  # string content arrives as one text block, so every block has an identity


class _Lowering:
    def __init__(self, req: MessagesBody, defaults: AnthropicDefaults, counting: bool):
        self.req = req
        self.defaults = defaults
        self.counting = counting

    def run(self) -> MessagesRequest:
        req = self.req
        _check_capabilities(req)
        if req.max_tokens == 0 and not self.counting:
            raise invalid("max_tokens must be at least 1: a zero-output cache prewarm is not available", "max_tokens")
        thinking = self._thinking()
        system = _system_blocks(req.system)
        wire = [_WireMessage(m.role, f"messages[{i}]", _blocks(m.content)) for i, m in enumerate(req.messages)]
        ctx = BlockContext(marks=self._cache_marks(system, wire), vision=self.defaults.vision)
        turns = join([self._turn(m, ctx) for m in wire])
        for turn in turns:
            if turn.role == "assistant":
                check_assistant_order(turn)
        order_tool_results(turns)
        prefill = turns[-1].role == "assistant"
        if prefill:
            check_prefill(turns[-1], thinking_enabled=thinking.budget is not None)
        messages = [ir.Message(t.role, t.parts) for t in turns]  # type: ignore[arg-type]
        if system:
            messages.insert(0, ir.Message("system", [system_part(b, p, ctx) for b, p in system]))
        tools = [self._tool(t, f"tools[{i}]", ctx) for i, t in enumerate(req.tools or [])]
        options = ir.PromptOptions(enable_thinking=thinking.enable, preserve_thinking=req.preserve_thinking,
                                   reasoning_effort=_effort(req, thinking),
                                   template_kwargs=dict(req.chat_template_kwargs or {}),
                                   implicit_cache=False,  # Anthropic writes only where cache_control asks
                                   continue_final_message=prefill,
                                   option_params={"reasoning_effort": "output_config.effort"})
        conversation = ir.Conversation(messages=messages, tools=tools, tool_choice=_tool_choice(req, tools),
                                       options=options)
        if self.counting:
            return MessagesRequest(model=req.model, conversation=conversation, thinking=thinking)
        return MessagesRequest(model=req.model, conversation=conversation, thinking=thinking,
                               sampling=SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k),
                               max_tokens=req.max_tokens, stop=_stop_sequences(req.stop_sequences),
                               stream=bool(req.stream))

    # ---- thinking ------------------------------------------------------------------------------

    def _thinking(self) -> ThinkingPlan:
        config = self.req.thinking
        if config is None:
            return ThinkingPlan()
        if isinstance(config, ThinkingDisabled):
            return ThinkingPlan(enable=False)
        sealed = getattr(config, "display", None) == "omitted"
        if isinstance(config, ThinkingAdaptive):
            return ThinkingPlan(sealed=sealed)  # the model decides how much; the server's default mode applies
        if not isinstance(config, ThinkingEnabled):
            raise unsupported("thinking.type", "thinking_mode_not_supported",
                              f"{config.type!r} is not available; use 'enabled', 'adaptive' or 'disabled'")
        budget = config.budget_tokens
        if budget < MIN_THINKING_BUDGET:
            raise invalid(f"thinking.budget_tokens must be at least {MIN_THINKING_BUDGET}", "thinking.budget_tokens")
        if not self.counting:
            max_tokens = self.req.max_tokens or self.defaults.default_max_tokens
            if budget >= max_tokens:
                raise invalid(f"thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens})",
                              "thinking.budget_tokens")
        return ThinkingPlan(enable=True, budget=budget, sealed=sealed)

    # ---- cache markers -------------------------------------------------------------------------

    def _cache_marks(self, system: list[tuple[TextBlock, str]], wire: list[_WireMessage]) -> dict[int, ir.CacheMark]:
        """Every block that may carry cache_control, in prompt order; the request-level one takes the last
        top-level block (text, image, tool_use or tool_result) of the request."""
        blocks: list[tuple[object, str]] = [(t, f"tools[{i}]") for i, t in enumerate(self.req.tools or [])
                                            if isinstance(t, CustomTool)]
        blocks += system
        last = blocks[-1] if blocks else None
        for message in wire:
            for j, block in enumerate(message.blocks):
                if not isinstance(block, _CACHEABLE):
                    continue
                last = (block, f"{message.param}.content[{j}]")
                blocks.append(last)
                if isinstance(block, ToolResultBlock) and isinstance(block.content, list):
                    blocks += [(inner, f"{last[1]}.content[{k}]") for k, inner in enumerate(block.content)]
        return plan_cache_marks(blocks, last, self.req.cache_control)

    # ---- messages and tools --------------------------------------------------------------------

    def _turn(self, message: _WireMessage, ctx: BlockContext) -> Turn:
        turn = Turn(message.role, message_params=[message.param])
        for j, block in enumerate(message.blocks):
            param = f"{message.param}.content[{j}]"
            if message.role == "user":
                turn.add(user_part(block, param, ctx), param)
            elif message.role == "system":
                turn.add(system_part(block, param, ctx), param)
            else:
                if isinstance(block, (ThinkingBlock, RedactedThinkingBlock)):
                    turn.thinking_params.append(param)
                part = assistant_part(block, param, ctx)
                if part is not None:
                    turn.add(part, param)
        return turn

    def _tool(self, tool: CustomTool | OtherTool, param: str, ctx: BlockContext) -> ir.ToolDef:
        if isinstance(tool, OtherTool):
            raise _refuse_tool(tool, param)
        if tool.strict:
            raise unsupported(f"{param}.strict", "strict_tools_not_supported",
                              "strict:true needs input that satisfies the schema, which needs constrained decoding")
        if tool.defer_loading:
            raise unsupported(f"{param}.defer_loading", "deferred_tools_not_supported",
                              "deferred tools need server-side tool search, which this server does not provide")
        if tool.allowed_callers is not None and "direct" not in tool.allowed_callers:
            raise unsupported(f"{param}.allowed_callers", "tool_caller_not_supported",
                              "a tool the model may not call directly needs a code-execution container")
        if tool.input_schema.get("type") != "object":
            raise invalid(f"{param}.input_schema must be a JSON Schema with type 'object'", f"{param}.input_schema")
        return ir.ToolDef(name=tool.name, description=_with_examples(tool.description, tool.input_examples),
                          parameters=tool.input_schema, cache=ctx.mark(tool))


def _blocks(content: Any) -> list[Any]:
    return [TextBlock(type="text", text=content)] if isinstance(content, str) else list(content)


def _system_blocks(system: str | list[TextBlock] | None) -> list[tuple[TextBlock, str]]:
    """Top-level system blocks with their paths, after the positional billing rule.

    Claude Code puts attribution metadata first in a system array, with a value that changes every
    request; consumed whole (with any cache_control), it cannot break prefix reuse. A string system
    value or a later block with the same text is ordinary prompt content.
    """
    if system is None:
        return []
    if isinstance(system, str):
        return [(TextBlock(type="text", text=system), "system")]
    blocks = [(b, f"system[{i}]") for i, b in enumerate(system)]
    if blocks and blocks[0][0].text.startswith(BILLING_PREFIX):
        blocks = blocks[1:]
    return blocks


def _with_examples(description: str | None, examples: list[dict[str, Any]] | None) -> str | None:
    """input_examples have no slot in a function definition; the model reads them after the description."""
    if not examples:
        return description
    lines = "\n".join(json.dumps(e, ensure_ascii=False) for e in examples)
    return f"{description}\n\nExample inputs:\n{lines}" if description else f"Example inputs:\n{lines}"


def _refuse_tool(tool: OtherTool, param: str) -> ProtocolError:
    if tool.type.startswith("mcp"):
        return unsupported(f"{param}.type", "mcp_not_supported",
                           f"{tool.type!r} needs a remote MCP connector, which this server does not run")
    if "toolset" in tool.type:
        return unsupported(f"{param}.type", "toolsets_not_supported",
                           f"{tool.type!r} is a toolset whose tools this server cannot execute")
    return unsupported(f"{param}.type", "server_tools_not_supported",
                       f"{tool.type!r} is an Anthropic-defined tool; only user-defined (custom) tools are available")


def _tool_choice(req: MessagesBody, tools: list[ir.ToolDef]) -> str:
    choice = req.tool_choice
    if choice is None:
        return "auto"
    if choice.type in ("any", "tool"):
        raise unsupported("tool_choice.type", "tool_choice_not_supported",
                          f"{choice.type!r} forces a tool call, which cannot be guaranteed; use 'auto' or 'none'")
    if choice.type == "auto" and choice.disable_parallel_tool_use and tools:
        raise unsupported("tool_choice.disable_parallel_tool_use", "parallel_tool_calls_not_supported",
                          "at most one tool call per turn cannot be guaranteed while tools are enabled")
    return choice.type


def _effort(req: MessagesBody, thinking: ThinkingPlan) -> str | None:
    """output_config.effort for the template. With thinking disabled it has nothing to steer in a Qwen
    template (whose effort levels shape reasoning), so it is not passed on rather than reported as a conflict."""
    effort = req.output_config.effort if req.output_config else None
    return None if thinking.enable is False else effort


def _stop_sequences(values: list[str] | None) -> list[str]:
    values = list(values or [])
    if len(values) > MAX_STOP_SEQUENCES:
        raise invalid(f"stop_sequences takes at most {MAX_STOP_SEQUENCES} strings", "stop_sequences")
    for i, value in enumerate(values):
        if not value:
            raise invalid("stop sequences must not be empty", f"stop_sequences[{i}]")
    return values


def _check_capabilities(req: MessagesBody) -> None:
    if req.output_config is not None and req.output_config.format is not None:
        raise unsupported("output_config.format", "structured_outputs_not_supported",
                          "structured outputs need constrained decoding, which this server does not provide")
    if req.container is not None:
        raise unsupported("container", "containers_not_supported",
                          "containers need a code-execution sandbox, which this server does not run")
    if req.mcp_servers:
        raise unsupported("mcp_servers", "mcp_not_supported",
                          "MCP servers need a remote MCP connector, which this server does not run")
