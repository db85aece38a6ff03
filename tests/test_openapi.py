"""/openapi.json and /docs: every route of the contract, the protocols' own request models as bodies,
and the same --api-key gate as the API itself."""

from __future__ import annotations

import httpx
import pytest
from server_fixtures import scripted_artifact, start_server

# the contract's endpoint table ("Endpoints"), as OpenAPI spells the paths
CONTRACT_ROUTES = [
    ("get", "/health"), ("get", "/metrics"), ("get", "/v1/models"), ("get", "/v1/models/{model_id}"),
    ("post", "/v1/chat/completions"), ("post", "/v1/responses"), ("post", "/v1/responses/input_tokens"),
    ("get", "/v1/responses/{response_id}"), ("delete", "/v1/responses/{response_id}"),
    ("get", "/v1/responses/{response_id}/input_items"), ("post", "/v1/messages"),
    ("post", "/v1/messages/count_tokens"),
]
# POST route -> (component, fields it must require, a field whose constraint must show)
BODIES = {
    "/v1/chat/completions": ("chat.ChatCompletionRequest", {"model", "messages"}, ("top_k", "maximum", 20)),
    "/v1/responses": ("responses.CreateBody", {"model"}, ("max_output_tokens", "minimum", 0)),
    "/v1/responses/input_tokens": ("responses.PromptBody", {"model"}, ("previous_response_id", "minLength", 1)),
    "/v1/messages": ("anthropic.MessagesBody", {"model", "messages"}, ("temperature", "maximum", 1.0)),
    "/v1/messages/count_tokens": ("anthropic.MessagesBody", {"model", "messages"}, ("top_k", "maximum", 20)),
}
KEY = "sk-docs-test"


@pytest.fixture(scope="module")
def server(artifacts_dir, qwen_tokenizer):
    live = start_server(scripted_artifact(artifacts_dir, qwen_tokenizer), qwen_tokenizer)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def keyed_server(artifacts_dir, qwen_tokenizer):
    live = start_server(scripted_artifact(artifacts_dir, qwen_tokenizer), qwen_tokenizer, api_key=KEY)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def doc(server) -> dict:
    r = httpx.get(server.url + "/openapi.json", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def _refs(node):
    if isinstance(node, dict):
        if "$ref" in node:
            yield node["$ref"]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def _constraint(schema: dict, key: str):
    """A field constraint, looking through pydantic's anyOf [constrained type, null]."""
    if key in schema:
        return schema[key]
    return next((s[key] for s in schema.get("anyOf", []) if key in s), None)


def test_every_contract_route_is_listed(doc):
    listed = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    assert set(CONTRACT_ROUTES) <= listed
    assert doc["openapi"].startswith("3.") and doc["info"]["title"] == "ninfer"


@pytest.mark.parametrize("path", list(BODIES))
def test_post_routes_declare_their_protocol_request_model(doc, path):
    component, required, (field, key, value) = BODIES[path]
    body = doc["paths"][path]["post"]["requestBody"]
    assert body["required"] is True
    assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{component}"}
    schema = doc["components"]["schemas"][component]
    assert required <= set(schema.get("required", [])) and required <= set(schema["properties"])
    assert _constraint(schema["properties"][field], key) == value
    assert "422" not in doc["paths"][path]["post"]["responses"]  # FastAPI's own validation never answers


def test_every_reference_resolves(doc):
    schemas = doc["components"]["schemas"]
    refs = set(_refs(doc))
    assert refs and all(ref.removeprefix("#/components/schemas/") in schemas for ref in refs), refs - {
        f"#/components/schemas/{name}" for name in schemas}


def test_nested_shapes_are_real(doc):
    schemas = doc["components"]["schemas"]
    user = schemas["chat.UserMessage"]
    assert user["properties"]["role"].get("const") == "user" or user["properties"]["role"].get("enum") == ["user"]
    # Responses validates Items one by one; the document still shows what an Item is
    items = schemas["responses.CreateBody"]["properties"]["input"]["anyOf"][1]["items"]["anyOf"]
    named = {ref.rsplit("/", 1)[1] for ref in _refs(items)}
    assert named == {"responses.MessageItem", "responses.ReasoningItem", "responses.FunctionCallItem",
                     "responses.FunctionCallOutputItem"}
    assert "anthropic.ToolUseBlock" in schemas and "chat.ToolMessage" in schemas  # both protocols' blocks


def test_docs_page_is_html(server):
    r = httpx.get(server.url + "/docs", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "swagger" in r.text.lower() and "/openapi.json" in r.text


@pytest.mark.parametrize("path", ["/openapi.json", "/docs"])
def test_docs_need_the_api_key_when_one_is_set(keyed_server, path):
    r = httpx.get(keyed_server.url + path, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    for headers in ({"authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        assert httpx.get(keyed_server.url + path, headers=headers, timeout=10).status_code == 200


def test_a_keyed_document_says_how_to_send_the_key(keyed_server, doc):
    keyed = httpx.get(keyed_server.url + "/openapi.json", headers={"x-api-key": KEY}, timeout=10).json()
    assert set(keyed["components"]["securitySchemes"]) == {"bearer", "x-api-key"}
    assert "securitySchemes" not in doc.get("components", {})
