"""The JSON body of a POST, strictly parsed: what every protocol's request models validate.

Strictly means valid Unicode too. Python's json accepts an escaped lone surrogate ("\\udcff") and
decodes bytes with surrogatepass, so a body can parse into a str that holds a code point no UTF-8
encoder takes: the tokenizer (Rust: "TextInputSequence must be str"), the request log and the error
renderer all fail on it deep inside, as a 500. Rejecting such strings here, once, keeps every
endpoint of every protocol from ever seeing them; the error names the field that holds one.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import Request

from ninfer.protocol.errors import ProtocolError

_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # the escapes that can spell one (a valid pair too)


async def read_json(request: Request) -> Any:
    raw = await request.body()
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"the request body is not valid JSON ({exc})", code="invalid_json") from None
    if _may_hold_surrogates(raw):
        check_unicode(body)
    return body


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")  # NaN and Infinity are not JSON


def _may_hold_surrogates(raw: bytes) -> bool:
    """Cheap precheck on the bytes: only a \\uD800-\\uDFFF escape, or bytes that are not strict UTF-8
    (an encoded surrogate, or another encoding json detected), can leave a lone surrogate in a str."""
    if raw.isascii():
        return _SURROGATE_ESCAPE.search(raw) is not None
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return _SURROGATE_ESCAPE.search(raw) is not None


def check_unicode(body: Any) -> None:
    """A 400 naming a string (member name or value) that holds a lone surrogate; values in document order.

    Also for bodies that did not come as JSON (a Python caller's dict through a deployment handle)."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                raise _invalid_unicode(path, "a string")
        elif isinstance(node, dict):
            children = []
            for key, value in node.items():
                child = f"{path}.{_printable(key)}" if path else _printable(key)
                if _SURROGATE.search(key):
                    raise _invalid_unicode(child, "a member name")
                children.append((value, child))
            stack.extend(reversed(children))
        elif isinstance(node, list):
            stack.extend((node[i], f"{path}[{i}]") for i in reversed(range(len(node))))


def _printable(key: str) -> str:
    return key.encode("utf-8", "backslashreplace").decode("utf-8")  # the error body must stay encodable


def _invalid_unicode(path: str, what: str) -> ProtocolError:
    where = path or "the request body"
    return ProtocolError(f"{where}: {what} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
                         "which is not valid Unicode text", param=path or None, code="invalid_unicode")
