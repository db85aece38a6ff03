"""The JSON body of a POST, strictly parsed: what every protocol's request models validate."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from ninfer.protocol.errors import ProtocolError


async def read_json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"the request body is not valid JSON ({exc})", code="invalid_json") from None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")  # NaN and Infinity are not JSON
