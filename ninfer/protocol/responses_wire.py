"""The pydantic base of Responses wire objects, and validation that names the failing field by its
full request path (an Item or tool entry is validated on its own, at its place in the body)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from ninfer.protocol.errors import from_validation_error

TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # function and namespace names alike


class WireModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, protected_namespaces=())


def validated(model: type[WireModel], value: Any, body: Any, loc: tuple) -> Any:
    """`model` validated at `loc` of the request body; an unknown content type is modality_not_supported."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        errors = [{**e, "loc": (*loc, *e["loc"])} for e in exc.errors()]
        raise from_validation_error(errors, body, {"type": "modality_not_supported"}) from None
