"""Responses function tools: direct and namespaced definitions, and tool_choice.

A namespace member keeps its (namespace, name) identity in the IR; the chat frontend flattens it
to `namespace__name` for the model and the decoder restores both fields on generated calls. Tools
that need an executor or decoding guarantee this server lacks are refused with the entry named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from ninfer.chat import ir
from ninfer.chat.lowering import prompt_tool_name
from ninfer.protocol.errors import invalid, unsupported
from ninfer.protocol.responses_wire import TOOL_NAME, WireModel, validated


class FunctionTool(WireModel):
    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None
    allowed_callers: list[str] | None = None
    output_schema: Any = None


class NamespaceTool(WireModel):
    type: Literal["namespace"]
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    tools: list[Any]


class AllowedFunction(WireModel):
    type: str
    name: str | None = None
    namespace: str | None = None


class AllowedToolsChoice(WireModel):
    type: Literal["allowed_tools"]
    mode: str
    tools: list[AllowedFunction]


@dataclass
class ToolConfig:
    """The request's tools as the IR sees them, and as the Response echoes them."""

    tools: list[ir.ToolDef]
    wire_tools: list[dict[str, Any]]
    choice: Literal["auto", "none"] = "auto"
    allowed: list[tuple[str | None, str]] | None = None
    wire_choice: Any = "auto"

    def callable(self) -> bool:
        """Whether any tool may become a structured call in this request."""
        if self.choice == "none":
            return False
        return bool(self.tools if self.allowed is None else self.allowed)


def parse_tools(raw: list[Any] | None, choice: Any, body: Any) -> ToolConfig:
    config = ToolConfig(tools=[], wire_tools=[])
    flattened: dict[str, str] = {}  # prompt name -> where declared
    for i, entry in enumerate(raw or []):
        where = f"tools[{i}]"
        kind = entry.get("type") if isinstance(entry, dict) else None
        if not isinstance(kind, str):
            raise invalid(f"{where} must be an object with a string type", f"{where}.type", "invalid_type")
        if kind == "function":
            tool, wire = _function(entry, body, ("tools", i), None, None)
            _declare(tool, where, flattened)
            config.tools.append(tool)
            config.wire_tools.append(wire)
        elif kind == "namespace":
            config.wire_tools.append(_namespace(entry, body, i, config, flattened))
        else:
            raise unsupported(f"{where}.type", "tool_type_not_supported",
                              f"tools[{i}] is a {kind!r} tool, which needs an executor or output format this server "
                              "lacks; only function tools (direct or in a namespace) are available")
    _choice(choice, body, config)
    return config


def _namespace(entry: dict, body: Any, i: int, config: ToolConfig, flattened: dict[str, str]) -> dict[str, Any]:
    group: NamespaceTool = validated(NamespaceTool, entry, body, ("tools", i))
    members = []
    for j, member in enumerate(group.tools):
        where = f"tools[{i}].tools[{j}]"
        kind = member.get("type") if isinstance(member, dict) else None
        if kind != "function":
            raise unsupported(f"{where}.type", "tool_type_not_supported",
                              f"{where} is a {kind!r} tool; a namespace may only hold function tools")
        tool, wire = _function(member, body, ("tools", i, "tools", j), group.name, group.description)
        _declare(tool, where, flattened)
        config.tools.append(tool)
        members.append(wire)
    wire_group = {"type": "namespace", "name": group.name, "tools": members}
    if group.description is not None:
        wire_group["description"] = group.description
    return wire_group


def _function(entry: dict, body: Any, loc: tuple, namespace: str | None,
              namespace_description: str | None) -> tuple[ir.ToolDef, dict[str, Any]]:
    fn: FunctionTool = validated(FunctionTool, entry, body, loc)
    where = "".join(f"[{step}]" if isinstance(step, int) else f".{step}" for step in loc).lstrip(".")
    if fn.strict:
        raise unsupported(f"{where}.strict", "strict_tools_not_supported",
                          "strict:true needs arguments that satisfy the schema, which needs constrained decoding")
    if fn.defer_loading:
        raise unsupported(f"{where}.defer_loading", "deferred_tools_not_supported",
                          "deferred loading needs tool search, which this server lacks")
    if fn.allowed_callers is not None and "direct" not in fn.allowed_callers:
        raise unsupported(f"{where}.allowed_callers", "tool_caller_not_supported",
                          "the model can only call tools directly, and this tool excludes direct calls")
    if fn.output_schema is not None:
        raise unsupported(f"{where}.output_schema", "tool_output_schema_not_supported",
                          "an output schema cannot be enforced on client-executed results")
    # The model sees no namespace description of its own, so it leads each member's description.
    description = "\n\n".join(d for d in (namespace_description, fn.description) if d) or None
    tool = ir.ToolDef(name=fn.name, description=description, parameters=fn.parameters, namespace=namespace)
    wire: dict[str, Any] = {"type": "function", "name": fn.name, "description": fn.description,
                            "parameters": fn.parameters, "strict": False}
    return tool, wire


def _declare(tool: ir.ToolDef, where: str, flattened: dict[str, str]) -> None:
    name = prompt_tool_name(tool.namespace, tool.name)
    if name in flattened:
        raise invalid(f"{where}: this function's identity {name!r} repeats {flattened[name]}", where,
                      "duplicate_tool_name")
    flattened[name] = where


def _choice(choice: Any, body: Any, config: ToolConfig) -> None:
    if choice is None or choice == "auto":
        return
    config.wire_choice = choice
    if choice == "none":
        config.choice = "none"
        return
    if choice == "required":
        raise unsupported("tool_choice", "tool_choice_not_supported",
                          "forcing a tool call cannot be guaranteed; use 'auto', 'none' or allowed_tools in auto mode")
    if isinstance(choice, str):
        raise invalid(f"tool_choice: {choice!r} is not one of auto, none, required", "tool_choice")
    if not isinstance(choice, dict) or not isinstance(choice.get("type"), str):
        raise invalid("tool_choice must be a string or an object with a string type", "tool_choice", "invalid_type")
    if choice["type"] != "allowed_tools":
        raise unsupported("tool_choice", "tool_choice_not_supported",
                          f"a {choice['type']!r} tool_choice forces one tool, which cannot be guaranteed")
    allowed: AllowedToolsChoice = validated(AllowedToolsChoice, choice, body, ("tool_choice",))
    if allowed.mode != "auto":
        raise unsupported("tool_choice.mode", "tool_choice_not_supported",
                          f"mode {allowed.mode!r} forces a tool call, which cannot be guaranteed; use 'auto'")
    declared = {tool.identity for tool in config.tools}
    config.allowed = []
    for k, entry in enumerate(allowed.tools):
        where = f"tool_choice.tools[{k}]"
        if entry.type != "function":
            raise unsupported(f"{where}.type", "tool_choice_not_supported", "only function tools can be allowed")
        if entry.name is None:
            raise invalid(f"missing required parameter {where}.name", f"{where}.name", "missing_required_parameter")
        identity = (entry.namespace, entry.name)
        if identity not in declared:
            shown = f"{entry.namespace}.{entry.name}" if entry.namespace else entry.name
            raise invalid(f"{where}: allowed function {shown!r} is not declared in tools", where, "invalid_tool_choice")
        config.allowed.append(identity)
