"""Typing Qwen's untyped parameter text by the tool's declared JSON Schema (contract: the schema-typing
paragraph shared by Chat Completions, Responses and Anthropic Messages).

Only a direct top-level `type` (a name or a list of names), or an anyOf/oneOf made entirely of such
types, counts as a declaration. The declaration converts text; it never decides whether a call is a
call, and no default, required-property or nested check is applied.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass
from typing import Any

from ninfer.chat.ir import ToolDef

FORMAT_WHITESPACE = " \t\r\n"


class SchemaType(enum.IntFlag):
    NULL = 1
    BOOLEAN = 2
    INTEGER = 4
    NUMBER = 8
    STRING = 16
    OBJECT = 32
    ARRAY = 64


_TYPE_NAMES = {t.name.lower(): t for t in SchemaType}


def declared_types(schema: Any) -> SchemaType | None:
    """The JSON types a property schema admits, or None when it declares none we can use."""
    if not isinstance(schema, dict):
        return None
    if "type" in schema:
        return _type_names(schema["type"])
    alternatives = [schema[k] for k in ("anyOf", "oneOf") if k in schema]
    if len(alternatives) != 1 or not isinstance(alternatives[0], list) or not alternatives[0]:
        return None
    combined = SchemaType(0)
    for branch in alternatives[0]:
        types = declared_types(branch)
        if types is None:
            return None
        combined |= types
    return combined or None


def _type_names(value: Any) -> SchemaType | None:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n in _TYPE_NAMES for n in names):
        return None
    combined = SchemaType(0)
    for name in names:
        combined |= _TYPE_NAMES[name]
    return combined


@dataclass(frozen=True)
class ToolContract:
    """A declared tool and the types of its declared parameters (None: untyped)."""

    tool: ToolDef
    parameters: dict[str, SchemaType | None]

    @staticmethod
    def of(tool: ToolDef) -> "ToolContract":
        properties = (tool.parameters or {}).get("properties") if isinstance(tool.parameters, dict) else None
        if not isinstance(properties, dict):
            return ToolContract(tool, {})
        return ToolContract(tool, {name: declared_types(schema) for name, schema in properties.items()})


class Disposition(enum.Enum):
    EMITTED = "emitted"
    OMITTED = "omitted"  # an empty block of a declared non-string parameter
    MISMATCH = "mismatch"  # kept, so the tool consumer can report the validation error


def normalize(text: str, contract: ToolContract, name: str) -> tuple[Disposition, Any]:
    """The argument value of one parameter block's text."""
    if name not in contract.parameters:
        return Disposition.MISMATCH, _untyped(text)
    types = contract.parameters[name]
    if types is None:
        return Disposition.EMITTED, _untyped(text)
    framed = _strip_framing(text)
    if types & SchemaType.STRING:
        return Disposition.EMITTED, framed
    value = framed.strip(FORMAT_WHITESPACE)
    if not value:
        return Disposition.OMITTED, None
    parsed = parse_json(value)
    if parsed is not _INVALID:
        return (Disposition.EMITTED if types & _kind(parsed) else Disposition.MISMATCH), parsed
    if types & SchemaType.BOOLEAN and value.lower() in ("true", "false"):
        return Disposition.EMITTED, value.lower() == "true"
    return Disposition.MISMATCH, framed


def _untyped(text: str) -> Any:
    """No usable declaration: JSON text keeps its type, anything else is a string."""
    value = text.strip(FORMAT_WHITESPACE)
    parsed = parse_json(value)
    return value if parsed is _INVALID else parsed


def _strip_framing(text: str) -> str:
    """Drop the one line break the call format puts after the opening and before the closing tag."""
    for lead in ("\r\n", "\n"):
        if text.startswith(lead):
            text = text[len(lead):]
            break
    for tail in ("\r\n", "\n"):
        if text.endswith(tail):
            return text[: -len(tail)]
    return text


def _kind(value: Any) -> SchemaType:
    """The schema types a parsed JSON value satisfies (an integral number is also a number)."""
    if value is None:
        return SchemaType.NULL
    if isinstance(value, bool):
        return SchemaType.BOOLEAN
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return SchemaType.INTEGER | SchemaType.NUMBER
    if isinstance(value, float):
        return SchemaType.NUMBER
    if isinstance(value, str):
        return SchemaType.STRING
    return SchemaType.OBJECT if isinstance(value, dict) else SchemaType.ARRAY


_INVALID = object()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError("number out of range")
    return value


def parse_json(text: str) -> Any:
    """The value of standard JSON text (no NaN/Infinity, no overflowing numbers), or _INVALID."""
    if not text:
        return _INVALID
    try:
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError):
        return _INVALID
