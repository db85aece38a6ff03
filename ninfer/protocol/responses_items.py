"""Responses input Items: validation, the canonical wire form, and each Item's conversation content.

One Item becomes an `Item`: the canonical form (what is stored, listed by input_items and replayed
through previous_response_id, with a preserved or generated id) plus the IR parts it contributes.
Grouping Items into turns and matching tool results to calls happen in responses_history.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union

from pydantic import Field

from ninfer.chat import ir
from ninfer.chat.tool_schema import parse_json
from ninfer.protocol.errors import ProtocolError, invalid, unsupported
from ninfer.protocol.reasoning_seal import SealError, unseal
from ninfer.protocol.responses_wire import TOOL_NAME, WireModel, validated

ItemKind = Literal["message", "reasoning", "function_call", "function_call_output"]
_ID_PREFIX = {"message": "msg", "reasoning": "rs", "function_call": "fc", "function_call_output": "fco"}
_ROLES = ("user", "assistant", "system", "developer")


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


@dataclass
class Item:
    """A validated input Item. `where` is its request path, for errors found once Items are combined."""

    wire: dict[str, Any]
    kind: ItemKind
    where: str
    role: str | None = None  # messages only
    parts: list[ir.Part] = field(default_factory=list)
    asserted: tuple[str | None, str] | None = None  # a function_call_output's (namespace, name) claim

    @property
    def id(self) -> str:
        return self.wire["id"]

    @property
    def assistant_owned(self) -> bool:
        return self.kind in ("reasoning", "function_call") or (self.kind == "message" and self.role == "assistant")


# ---- wire models (structure only; the rules live in the functions below) ---------------------


class InputText(WireModel):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: Any = None


class OutputText(WireModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class Refusal(WireModel):
    type: Literal["refusal"]
    refusal: str


class InputImage(WireModel):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None
    prompt_cache_breakpoint: Any = None


class InputVideo(WireModel):
    type: Literal["input_video"]
    video_url: str
    prompt_cache_breakpoint: Any = None


class InputFile(WireModel):
    type: Literal["input_file"]


class InputAudio(WireModel):
    type: Literal["input_audio"]


MessagePart = Annotated[Union[InputText, OutputText, Refusal, InputImage, InputVideo, InputFile, InputAudio],
                        Field(discriminator="type")]
ResultPart = Annotated[Union[InputText, InputImage, InputFile], Field(discriminator="type")]


class MessageItem(WireModel):
    id: str | None = Field(None, min_length=1)
    role: str
    content: Union[str, list[MessagePart]]
    status: str | None = None  # status/phase metadata: accepted, no prompt representation
    phase: str | None = None


class SummaryText(WireModel):
    type: Literal["summary_text"]
    text: str


class ReasoningText(WireModel):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(WireModel):
    id: str | None = Field(None, min_length=1)
    summary: list[SummaryText] | None = None
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None


class FunctionCallItem(WireModel):
    id: str | None = Field(None, min_length=1)
    call_id: str = Field(min_length=1)
    name: str = Field(pattern=TOOL_NAME)
    namespace: str | None = Field(None, pattern=TOOL_NAME)
    arguments: str
    status: str | None = None
    caller: Any = None


class FunctionCallOutputItem(WireModel):
    id: str | None = Field(None, min_length=1)
    call_id: str = Field(min_length=1)
    output: Union[str, list[ResultPart]]
    name: str | None = Field(None, pattern=TOOL_NAME)
    namespace: str | None = Field(None, pattern=TOOL_NAME)
    status: str | None = None
    caller: Any = None


# ---- parsing ---------------------------------------------------------------------------------


@dataclass
class ItemRules:
    vision: bool  # the server was started with --vision


def parse_items(values: list[Any], body: Any, rules: ItemRules, loc: tuple = ("input",), *,
                unique_ids: bool = True) -> list[Item]:
    """Every Item of `values` (found at `loc` in `body`), in client order; Item ids must be unique.

    A stored history is parsed again for each continuation; ids there were checked when it was sent.
    """
    items: list[Item] = []
    seen: set[str] = set()
    path = ".".join(str(step) for step in loc)
    for i, value in enumerate(values):
        item = _parse_item(value, body, rules, (*loc, i), f"{path}[{i}]")
        if unique_ids and item.id in seen:
            raise invalid(f"{path}[{i}].id: the Item id {item.id!r} appears twice", f"{path}[{i}].id",
                          "duplicate_item_id")
        seen.add(item.id)
        items.append(item)
    return items


def _parse_item(value: Any, body: Any, rules: ItemRules, loc: tuple, where: str) -> Item:
    if not isinstance(value, dict):
        raise invalid(f"{where} must be an object", where, "invalid_type")
    kind = value.get("type")
    if kind is None and "role" in value:
        kind = "message"  # the short message form {role, content}
    if kind is None:
        raise invalid(f"missing required parameter {where}.type", f"{where}.type", "missing_required_parameter")
    if not isinstance(kind, str):
        raise invalid(f"{where}.type must be a string", f"{where}.type", "invalid_type")
    parse = _PARSERS.get(kind)
    if parse is None:
        if kind == "input_file":
            raise unsupported(f"{where}.type", "file_inputs_not_supported", "files need a Files API this server lacks")
        raise unsupported(f"{where}.type", "item_type_not_supported",
                          f"Item type {kind!r} is not available; use message, reasoning, function_call or "
                          "function_call_output")
    item = parse(value, body, rules, loc, where)
    item.wire["id"] = item.wire["id"] or new_item_id(_ID_PREFIX[item.kind])  # "id" leads every wire dict
    return item


def _message(value: dict, body: Any, rules: ItemRules, loc: tuple, where: str) -> Item:
    role = value.get("role")
    if role is None:
        raise invalid(f"missing required parameter {where}.role", f"{where}.role", "missing_required_parameter")
    if role not in _ROLES:
        raise invalid(f"{where}.role: {role!r} is not one of {', '.join(_ROLES)}", f"{where}.role", "unsupported_role")
    msg: MessageItem = validated(MessageItem, value, body, loc)
    if isinstance(msg.content, str):
        kind = "output_text" if role == "assistant" else "input_text"
        part_wire: dict[str, Any] = {"type": kind, "text": msg.content}
        if kind == "output_text":
            part_wire["annotations"] = []
        parts: list[ir.Part] = [ir.TextPart(msg.content)]
        wire_parts = [part_wire]
    else:
        parts, wire_parts = [], []
        for j, part in enumerate(msg.content):
            ir_part, wire = _message_part(part, role, rules, f"{where}.content[{j}]")
            parts.append(ir_part)
            wire_parts.append(wire)
    wire = {"id": msg.id, "type": "message", "role": role, "content": wire_parts}
    for key in ("status", "phase"):
        if getattr(msg, key) is not None:
            wire[key] = getattr(msg, key)
    return Item(wire=wire, kind="message", where=where, role=role, parts=parts)


def _message_part(part: Any, role: str, rules: ItemRules, where: str) -> tuple[ir.Part, dict[str, Any]]:
    if isinstance(part, InputText):
        mark = _breakpoint(part.prompt_cache_breakpoint, where)
        return ir.TextPart(part.text, cache=mark), _with_mark({"type": "input_text", "text": part.text}, mark)
    if isinstance(part, (OutputText, Refusal)):
        if role != "assistant":
            raise invalid(f"{where}.type: {part.type} is only valid on assistant messages", f"{where}.type")
        if isinstance(part, Refusal):
            return ir.RefusalPart(part.refusal), {"type": "refusal", "refusal": part.refusal}
        return ir.TextPart(part.text), {"type": "output_text", "text": part.text, "annotations": part.annotations or []}
    if isinstance(part, InputImage):
        if role not in ("user", "assistant"):
            raise unsupported(f"{where}.type", "modality_not_supported", "images are accepted on user and assistant "
                                                                          "messages only")
        return _image(part, rules, where)
    if isinstance(part, InputVideo):
        if role != "user":
            raise unsupported(f"{where}.type", "modality_not_supported", "video is accepted on user messages only")
        mark = _breakpoint(part.prompt_cache_breakpoint, where)
        url = _media_url(part.video_url, rules, where, "video_url")
        return ir.VideoPart(source=url, cache=mark, param=f"{where}.video_url"), _with_mark({"type": "input_video", "video_url": url}, mark)
    return _unsupported_input(part, where)


def _unsupported_input(part: Any, where: str):
    if isinstance(part, InputFile):
        raise unsupported(f"{where}.type", "file_inputs_not_supported", "files need a Files API this server lacks")
    raise unsupported(f"{where}.type", "audio_inputs_not_supported", "audio input cannot be given to the model")


def _image(part: InputImage, rules: ItemRules, where: str) -> tuple[ir.Part, dict[str, Any]]:
    if part.file_id is not None:
        raise unsupported(f"{where}.file_id", "file_inputs_not_supported", "image file ids need a Files API this "
                                                                            "server lacks; send image_url")
    if part.image_url is None:
        raise invalid(f"missing required parameter {where}.image_url", f"{where}.image_url",
                      "missing_required_parameter")
    if part.detail not in (None, "auto"):
        raise unsupported(f"{where}.detail", "image_detail_not_supported",
                          f"detail {part.detail!r} asks for a preprocessing profile that cannot be applied; use 'auto'")
    mark = _breakpoint(part.prompt_cache_breakpoint, where)
    url = _media_url(part.image_url, rules, where, "image_url")
    wire = _with_mark({"type": "input_image", "image_url": url, "detail": "auto"}, mark)
    return ir.ImagePart(source=url, detail=part.detail, cache=mark, param=f"{where}.image_url"), wire


def _media_url(url: str, rules: ItemRules, where: str, key: str) -> str:
    if not url.startswith(("http://", "https://", "data:")):
        raise ProtocolError(f"{where}.{key}: media must be an http(s) URL or a data URI", param=f"{where}.{key}",
                            code="invalid_media")
    if not rules.vision:
        raise ProtocolError("media input needs the server started with --vision", param=where, code="vision_disabled")
    return url


def _breakpoint(value: Any, where: str) -> ir.CacheMark | None:
    if value is None:
        return None
    if value != {"mode": "explicit"}:
        raise invalid('prompt_cache_breakpoint must be {"mode": "explicit"}', f"{where}.prompt_cache_breakpoint",
                      "invalid_cache_breakpoint")
    return ir.CacheMark()


def _with_mark(wire: dict[str, Any], mark: ir.CacheMark | None) -> dict[str, Any]:
    if mark is not None:
        wire["prompt_cache_breakpoint"] = {"mode": "explicit"}
    return wire


def _reasoning(value: dict, body: Any, rules: ItemRules, loc: tuple, where: str) -> Item:
    item: ReasoningItem = validated(ReasoningItem, value, body, loc)
    text = "".join(part.text for part in item.content or [])
    if not text and item.encrypted_content:
        try:
            text = unseal(item.encrypted_content)  # Codex replays only the sealed copy
        except SealError as exc:
            raise invalid(f"{where}.encrypted_content cannot be restored: {exc}", f"{where}.encrypted_content",
                          "invalid_encrypted_content") from None
    elif not text and item.summary:
        raise unsupported(f"{where}.content", "reasoning_content_not_supported",
                          "a reasoning summary cannot stand in for the raw reasoning text the model saw")
    wire = {"id": item.id, "type": "reasoning", "summary": [s.model_dump() for s in item.summary or []],
            "content": [{"type": "reasoning_text", "text": text}] if text else []}
    # An Item without any text (Codex replays `encrypted_content: null`) contributes nothing.
    return Item(wire=wire, kind="reasoning", where=where, parts=[ir.ReasoningPart(text)] if text else [])


def _function_call(value: dict, body: Any, rules: ItemRules, loc: tuple, where: str) -> Item:
    call: FunctionCallItem = validated(FunctionCallItem, value, body, loc)
    _check_completed(call.status, call.caller, where, "partial_tool_call_not_supported")
    arguments = parse_json(call.arguments)
    if not isinstance(arguments, dict):
        raise invalid(f"{where}.arguments must be a JSON object encoded as a string", f"{where}.arguments")
    wire = {"id": call.id, "type": "function_call", "status": "completed", "call_id": call.call_id,
            "name": call.name, **({"namespace": call.namespace} if call.namespace else {}),
            "arguments": call.arguments}
    part = ir.ToolCallPart(call_id=call.call_id, name=call.name, arguments=arguments, namespace=call.namespace,
                           raw_arguments=call.arguments)
    return Item(wire=wire, kind="function_call", where=where, parts=[part])


def _function_call_output(value: dict, body: Any, rules: ItemRules, loc: tuple, where: str) -> Item:
    result: FunctionCallOutputItem = validated(FunctionCallOutputItem, value, body, loc)
    _check_completed(result.status, result.caller, where, "partial_tool_result_not_supported")
    if result.namespace is not None and result.name is None:
        raise invalid(f"{where}.namespace needs {where}.name to name the function", f"{where}.namespace",
                      "invalid_tool_history")
    if isinstance(result.output, str):
        parts: list[ir.Part] = [ir.TextPart(result.output)]
        output: Any = result.output
    else:
        if not result.output:
            raise invalid(f"{where}.output must not be an empty array", f"{where}.output")
        parts, output = [], []
        for j, part in enumerate(result.output):
            spot = f"{where}.output[{j}]"
            if isinstance(part, InputText):
                mark = _breakpoint(part.prompt_cache_breakpoint, spot)
                parts.append(ir.TextPart(part.text, cache=mark))
                output.append(_with_mark({"type": "input_text", "text": part.text}, mark))
            elif isinstance(part, InputImage):
                image, wire_image = _image(part, rules, spot)
                parts.append(image)
                output.append(wire_image)
            else:
                _unsupported_input(part, spot)
    wire = {"id": result.id, "type": "function_call_output", "status": "completed", "call_id": result.call_id,
            "output": output}
    if result.name is not None:
        wire["name"] = result.name
        if result.namespace is not None:
            wire["namespace"] = result.namespace
    asserted = (result.namespace, result.name) if result.name is not None else None
    part = ir.ToolResultPart(call_id=result.call_id, content=parts)  # type: ignore[arg-type]
    return Item(wire=wire, kind="function_call_output", where=where, parts=[part], asserted=asserted)


def _check_completed(status: str | None, caller: Any, where: str, code: str) -> None:
    if caller is not None:
        raise unsupported(f"{where}.caller", "tool_relationship_not_supported",
                          "calls made by another tool or program cannot be represented in the prompt")
    if status not in (None, "completed"):
        raise unsupported(f"{where}.status", code,
                          f"an Item with status {status!r} is unfinished and cannot be replayed as model history")


_PARSERS = {"message": _message, "reasoning": _reasoning, "function_call": _function_call,
            "function_call_output": _function_call_output}
