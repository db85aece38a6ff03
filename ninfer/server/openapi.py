"""/openapi.json and /docs: the request bodies are the protocols' own pydantic models.

The endpoints read the raw body (server.request_body) so that strict parsing and field-specific
errors stay the protocols' business; FastAPI therefore cannot infer a body schema from their
signatures. Each POST route instead declares its model's JSON schema through `openapi_extra`, and
the models' nested definitions join components.schemas, prefixed by protocol because the protocols
share class names (UserMessage, StreamOptions). Responses validates Items and tools one by one, so
its body models hold them as `list[Any]`; here they get the schemas of the Item and tool models
those validators use.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel

from ninfer.protocol.anthropic import MessagesBody
from ninfer.protocol.openai_chat import ChatCompletionRequest
from ninfer.protocol.openai_responses import CreateBody, PromptBody
from ninfer.protocol.responses_items import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningItem,
)
from ninfer.protocol.responses_tools import FunctionTool, NamespaceTool

# (method, path) -> (protocol prefix, request model)
REQUEST_BODIES: dict[tuple[str, str], tuple[str, type[BaseModel]]] = {
    ("POST", "/v1/chat/completions"): ("chat", ChatCompletionRequest),
    ("POST", "/v1/responses"): ("responses", CreateBody),
    ("POST", "/v1/responses/input_tokens"): ("responses", PromptBody),
    ("POST", "/v1/messages"): ("anthropic", MessagesBody),
    ("POST", "/v1/messages/count_tokens"): ("anthropic", MessagesBody),
}

# the Item kinds of a Responses input array: the model each is validated with, and its `type` tag
_ITEMS = {"message": MessageItem, "reasoning": ReasoningItem, "function_call": FunctionCallItem,
          "function_call_output": FunctionCallOutputItem}


def install(app: FastAPI, *, api_key: bool) -> None:
    """Declare the request bodies on the routes registered so far and build the document from them.

    `api_key`: the server checks a key (server.middleware); the document says how to send it."""
    schemas: dict[str, Any] = {}
    for route in app.routes:
        if not isinstance(route, APIRoute):
            continue
        for method in route.methods:
            if (method, route.path) in REQUEST_BODIES:
                prefix, model = REQUEST_BODIES[method, route.path]
                route.openapi_extra = {"requestBody": {"required": True, "content": {
                    "application/json": {"schema": {"$ref": _ref(_add_model(schemas, prefix, model))}}}}}

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            for operations in doc["paths"].values():  # no route answers FastAPI's own 422: errors are the protocol's
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            components = doc.setdefault("components", {})
            components["schemas"] = {name: schema for name, schema in components.get("schemas", {}).items()
                                     if name not in ("HTTPValidationError", "ValidationError")} | schemas
            if api_key:
                components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"},
                                                 "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
                doc["security"] = [{"bearer": []}, {"x-api-key": []}]
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _ref(name: str) -> str:
    return f"#/components/schemas/{name}"


def _add_model(schemas: dict[str, Any], prefix: str, model: type[BaseModel]) -> str:
    name = f"{prefix}.{model.__name__}"
    if name not in schemas:
        schema = _with_defs(schemas, prefix, model.model_json_schema(ref_template=_ref(prefix + ".{model}")))
        if model in (CreateBody, PromptBody):
            _type_responses_lists(schemas, schema)
        schemas[name] = schema
    return name


def _with_defs(schemas: dict[str, Any], prefix: str, schema: dict[str, Any]) -> dict[str, Any]:
    for def_name, definition in schema.pop("$defs", {}).items():
        schemas.setdefault(f"{prefix}.{def_name}", definition)
    return schema


def _type_responses_lists(schemas: dict[str, Any], body: dict[str, Any]) -> None:
    """`input` and `tools` of a Responses body: the Item and tool models, each with its `type` tag."""
    items = []
    for kind, model in _ITEMS.items():
        name = _add_model(schemas, "responses", model)
        tag = {"type": "string", "enum": [kind]}
        items.append({"allOf": [{"$ref": _ref(name)}, {"type": "object", "properties": {"type": tag},
                                                       **({} if kind == "message" else {"required": ["type"]})}]})
    tools = [{"$ref": _ref(_add_model(schemas, "responses", model))} for model in (FunctionTool, NamespaceTool)]
    props = body["properties"]
    props["input"] = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": items}}, {"type": "null"}],
                      "title": "Input", "description": "a user message as a string, or the ordered input Items "
                                                       "(a message Item may omit its type)"}
    props["tools"] = {"anyOf": [{"type": "array", "items": {"anyOf": tools}}, {"type": "null"}], "title": "Tools"}

