"""Typed protocol errors, raised where a problem is found and rendered once at the HTTP edge.

Every error carries the contract's code and the offending parameter, so a client learns which
field to fix. Engine and prompt errors are translated here, keeping their dedicated codes.
"""

from __future__ import annotations

from typing import Any

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          413: "invalid_request_error", 429: "server_error", 503: "server_error"}

# Engine error code -> HTTP status (contract: "Execution behavior", "Multimodal request").
_ENGINE_STATUS = {
    "server_overloaded": 429,
    "request_queue_timeout": 503,
    "context_length_exceeded": 400,
    "thinking_budget_capacity_insufficient": 400,
    "invalid_request": 400,
    "vision_disabled": 400,
    "engine_unavailable": 503,
}


class ProtocolError(Exception):
    """A request the server answers with an error body instead of a generation."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int = 400, type: str | None = None, extra: dict[str, Any] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.extra = extra or {}

    def openai_body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code,
                          **self.extra}}

    def anthropic_body(self, request_id: str | None) -> dict[str, Any]:
        kind = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large",
                429: "overloaded_error"}.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}, "request_id": request_id}


def invalid(message: str, param: str | None, code: str = "invalid_value") -> ProtocolError:
    return ProtocolError(message, param=param, code=code)


def unsupported(param: str, code: str, why: str) -> ProtocolError:
    """A capability rejection: names the field and the guarantee the server cannot give."""
    return ProtocolError(f"{param}: {why}", param=param, code=code)


def model_not_found(model: str) -> ProtocolError:
    return ProtocolError(f"model {model!r} not found", param="model", code="model_not_found", status=404)


def from_engine_error(exc: Exception) -> ProtocolError:
    """Map an engine refusal (ninfer.engine.types.EngineError) to its HTTP status and code."""
    code = getattr(exc, "code", "engine_error")
    extra: dict[str, Any] = {}
    if code == "context_length_exceeded":
        extra = {"prompt_tokens": getattr(exc, "prompt_tokens", None), "max_context": getattr(exc, "max_context", None)}
    status = _ENGINE_STATUS.get(code, 500)
    return ProtocolError(str(exc), code=code, status=status, param=None, extra=extra)


def from_media_error(exc: Exception, params: list[str | None] | None = None) -> ProtocolError:
    """Map a media/ error (ninfer.media.errors: code, status, item index) to its status and code,
    naming the request field of the item when `params` (one per prepared item) knows it."""
    item = getattr(exc, "item", None)
    param = params[item] if params is not None and isinstance(item, int) and 0 <= item < len(params) else None
    message = getattr(exc, "message", None) or str(exc)
    return ProtocolError(f"{param}: {message}" if param else message, param=param,
                         code=getattr(exc, "code", "media_error"), status=getattr(exc, "status", 500))


def from_prompt_error(exc: Exception) -> ProtocolError:
    """Map a chat-frontend PromptError (code + param) to a 400 with the same code."""
    return ProtocolError(str(exc), param=getattr(exc, "param", None), code=getattr(exc, "code", "invalid_prompt"),
                         status=getattr(exc, "status", 400))


# ---- pydantic validation errors -> one field-specific error ---------------------------------

_MISSING = {"missing"}
_TYPE_ERRORS = {"model_type", "model_attributes_type", "dict_type", "list_type",
                "is_instance_of", "none_required"}


def field_path(loc: tuple, body: Any, missing: bool = False) -> str:
    """Rebuild a client-facing path (messages[0].content[1].text) from a pydantic error location.

    Union validators add labels of their own (a discriminator tag, a member type name); walking the
    location alongside the received JSON keeps only the steps that exist in the request. For a
    missing field the last step names it although the body does not hold it.
    """
    parts: list[str] = []
    node = body
    for i, step in enumerate(loc):
        if isinstance(step, int) and isinstance(node, list) and 0 <= step < len(node):
            parts.append(f"[{step}]")
            node = node[step]
        elif isinstance(step, str) and isinstance(node, dict) and (step in node or (missing and i == len(loc) - 1)):
            parts.append(("." if parts else "") + step)
            node = node.get(step)
    return "".join(parts)


def from_validation_error(errors: list[dict[str, Any]], body: Any,
                          tag_codes: dict[str, str] | None = None) -> ProtocolError:
    """The most specific error of a pydantic ValidationError, as a 400 naming its field.

    A value failing every member of a union yields one error per member; the deepest location is
    the one that says what is wrong with the value the client actually sent.
    """
    def path(err: dict[str, Any]) -> str:
        return field_path(err["loc"], body, missing=err["type"] in _MISSING)

    def depth(err: dict[str, Any]) -> int:
        return path(err).count(".") + path(err).count("[")

    err = max(errors, key=depth)  # max keeps the first of equals: field order of the model
    param = path(err) or None
    same_place = [e for e in errors if path(e) == (param or "")]
    # a value failing a union fails each member; a non-type error names what the value got wrong
    value_errors = [e for e in same_place if not _is_type_error(e)]
    node = err.get("input")
    if isinstance(node, dict):  # an object failing an object-or-literal union: report the object's problem
        value_errors = [e for e in value_errors if e["type"] != "literal_error"] or value_errors
    elif not isinstance(node, str):
        value_errors = [e for e in value_errors if e["type"] != "literal_error"]
    if value_errors:
        err = value_errors[0]
    else:
        err = next((e for e in same_place if _is_type_error(e)), err)
    kind = err["type"]
    ctx = err.get("ctx") or {}
    if kind in _MISSING:
        code, message = "missing_required_parameter", f"missing required parameter {param}"
    elif kind == "union_tag_not_found":
        tag = str(ctx.get("discriminator", "type")).strip("'")
        param = f"{param}.{tag}" if param else tag
        code, message = "missing_required_parameter", f"missing required parameter {param}"
    elif kind == "union_tag_invalid":
        code = (tag_codes or {}).get(str(ctx.get("discriminator", "")).strip("'"), "invalid_value")
        message = f"{param}: {ctx.get('tag')!r} is not one of {ctx.get('expected_tags')}"
    elif _is_type_error(err):
        code = "invalid_type"
        wanted = " or ".join(w for w in dict.fromkeys(_type_word(e) for e in same_place) if w)
        message = f"{param} must be {wanted}" if wanted else f"{param}: {err['msg']}"
    else:
        code, message = "invalid_value", f"{param}: {err['msg'].removeprefix('Value error, ')}"
    return ProtocolError(message, param=param, code=code)


def _is_type_error(err: dict[str, Any]) -> bool:
    return err["type"].endswith("_type") or err["type"] in _TYPE_ERRORS


def _type_word(err: dict[str, Any]) -> str:
    return {"string_type": "a string", "list_type": "an array", "dict_type": "an object", "model_type": "an object", "model_attributes_type": "an object",
            "int_type": "an integer", "float_type": "a number", "bool_type": "a boolean",
            "none_required": "null"}.get(err["type"], "")
