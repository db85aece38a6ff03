"""Malformed and unsupported Anthropic Messages requests: each gets an exact Anthropic error body.

Taken from the contract's "Anthropic Messages" section: capabilities the server cannot provide are
refused with the field and the missing capability named, malformed values are field-specific 400s,
advisory fields and headers pass, and no client mistake is ever answered with a 500.
"""

from __future__ import annotations

import httpx
import pytest
from anthropic_fixtures import MODEL, start_anthropic_server

U = {"role": "user", "content": "ALPHA"}
PNG = "iVBORw0KGgo="
CC = {"cache_control": {"type": "ephemeral"}}


def m(*msgs):
    return {"messages": list(msgs)}


def ublock(block):
    return m({"role": "user", "content": [block, {"type": "text", "text": "ALPHA"}]})


def ablock(block):
    return m({"role": "user", "content": "x"}, {"role": "assistant", "content": [block]}, U)


def tool(**extra):
    return {"tools": [{"name": "t", "input_schema": {"type": "object"}, **extra}]}


def call(call_id):
    return {"type": "tool_use", "id": call_id, "name": "get_weather", "input": {}}


def result(call_id):
    return {"type": "tool_result", "tool_use_id": call_id, "content": "ok"}


def marked(n):
    return m({"role": "user", "content": [{"type": "text", "text": f"b{i}", **CC} for i in range(n)]
              + [{"type": "text", "text": "ALPHA"}]})


def after_calls(calls, *later):
    """A user question, an assistant turn with these calls, then `later` messages (content lists for users)."""
    return m(U, {"role": "assistant", "content": calls},
             *[msg if isinstance(msg, dict) else {"role": "user", "content": msg} for msg in later])


def image(source):
    return {"type": "image", "source": source}


def text_with(**extra):
    return m({"role": "user", "content": [{"type": "text", "text": "ALPHA", **extra}]})


THINKING = {"type": "thinking", "thinking": "hm", "signature": "s"}
PNG_SOURCE = {"type": "base64", "media_type": "image/png", "data": PNG}
NOT_PROVIDED = "which this server does not provide"
NOT_RUN = "which this server does not run"

# (name, fields replacing the base request's (None removes one), exact error message); all are 400
# invalid_request_error
CASES = [
    ("model missing", {"model": None}, "missing required parameter model"),
    ("empty model", {"model": ""}, "model: String should have at least 1 character"),
    ("messages missing", {"messages": None}, "missing required parameter messages"),
    ("empty messages", {"messages": []}, "messages: List should have at least 1 item after validation, not 0"),
    ("unknown role", m({"role": "tool", "content": "x"}),
     "messages[0]: 'tool' is not one of 'user', 'assistant', 'system'"),
    ("content number", m({"role": "user", "content": 5}), "messages[0].content must be a string or an array"),
    ("max_tokens 0", {"max_tokens": 0},
     "max_tokens must be at least 1: a zero-output cache prewarm is not available"),
    ("max_tokens negative", {"max_tokens": -1}, "max_tokens: Input should be greater than or equal to 0"),
    ("max_tokens string", {"max_tokens": "10"}, "max_tokens must be an integer"),
    ("temperature 1.5", {"temperature": 1.5}, "temperature: Input should be less than or equal to 1"),
    ("top_k 50", {"top_k": 50}, "top_k: Input should be less than or equal to 20"),
    ("5 stop sequences", {"stop_sequences": list("abcde")}, "stop_sequences takes at most 4 strings"),
    ("empty stop", {"stop_sequences": [""]}, "stop sequences must not be empty"),
    ("budget 1000", {"thinking": {"type": "enabled", "budget_tokens": 1000}},
     "thinking.budget_tokens must be at least 1024"),
    ("budget >= max", {"max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 2000}},
     "thinking.budget_tokens (2000) must be less than max_tokens (2000)"),
    ("budget missing", {"thinking": {"type": "enabled"}}, "missing required parameter thinking.budget_tokens"),
    ("between_tools", {"thinking": {"type": "between_tools"}},
     "thinking.type: 'between_tools' is not available; use 'enabled', 'adaptive' or 'disabled'"),
    ("display hidden", {"thinking": {"type": "adaptive", "display": "hidden"}},
     "thinking.display: Input should be 'summarized' or 'omitted'"),
    ("tool_choice any", {"tool_choice": {"type": "any"}, **tool()},
     "tool_choice.type: 'any' forces a tool call, which cannot be guaranteed; use 'auto' or 'none'"),
    ("tool_choice tool", {"tool_choice": {"type": "tool", "name": "t"}, **tool()},
     "tool_choice.type: 'tool' forces a tool call, which cannot be guaranteed; use 'auto' or 'none'"),
    ("no parallel", {"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}, **tool()},
     "tool_choice.disable_parallel_tool_use: at most one tool call per turn cannot be guaranteed while tools "
     "are enabled"),
    ("strict tool", tool(strict=True),
     "tools[0].strict: strict:true needs input that satisfies the schema, which needs constrained decoding"),
    ("defer tool", tool(defer_loading=True),
     f"tools[0].defer_loading: deferred tools need server-side tool search, {NOT_PROVIDED}"),
    ("callers", tool(allowed_callers=["code_execution_20250825"]),
     "tools[0].allowed_callers: a tool the model may not call directly needs a code-execution container"),
    ("schema array", {"tools": [{"name": "t", "input_schema": {"type": "array"}}]},
     "tools[0].input_schema must be a JSON Schema with type 'object'"),
    ("bad tool name", {"tools": [{"name": "bad name", "input_schema": {"type": "object"}}]},
     "tools[0].name: String should match pattern '^[A-Za-z0-9_-]{1,128}$'"),
    ("web search", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools[0].type: 'web_search_20250305' is an Anthropic-defined tool; only user-defined (custom) tools are "
     "available"),
    ("mcp toolset", {"tools": [{"type": "mcp_toolset", "mcp_server_name": "x"}]},
     f"tools[0].type: 'mcp_toolset' needs a remote MCP connector, {NOT_RUN}"),
    ("browser toolset", {"tools": [{"type": "browser_toolset_20260801"}]},
     "tools[0].type: 'browser_toolset_20260801' is a toolset whose tools this server cannot execute"),
    ("document", ublock({"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}),
     f"messages[0].content[0].type: document blocks need document ingestion and citations, {NOT_PROVIDED}"),
    ("search result", ublock({"type": "search_result", "source": "s", "title": "t", "content": []}),
     f"messages[0].content[0].type: search_result blocks need search-result citations, {NOT_PROVIDED}"),
    ("file image", ublock(image({"type": "file", "file_id": "f"})),
     f"messages[0].content[0].source: file_id sources need the Files API, {NOT_PROVIDED}"),
    ("bad base64", ublock(image({**PNG_SOURCE, "data": "%%%"})),
     "messages[0].content[0].source.data: the image data is not valid base64"),
    ("ftp image", ublock(image({"type": "url", "url": "ftp://x/a.png"})),
     "messages[0].content[0].source.url: images must be http(s) URLs"),
    ("bmp image", ublock(image({**PNG_SOURCE, "media_type": "image/bmp"})),
     "messages[0].content[0].source.media_type: Input should be 'image/jpeg', 'image/png', 'image/gif' or "
     "'image/webp'"),
    ("image no vision", ublock(image(PNG_SOURCE)),
     "messages[0].content[0]: media input needs the server started with --vision"),
    ("image in assistant", ablock(image({"type": "url", "url": "https://x/a.png"})),
     "messages[1].content[0].type: 'image' blocks are only valid in user messages and tool results"),
    ("result in assistant", ablock(result("a")),
     "messages[1].content[0].type: 'tool_result' blocks are only valid in user messages"),
    ("thinking in user", ublock(THINKING),
     "messages[0].content[0].type: 'thinking' blocks are only valid in assistant messages"),
    ("server tool use", ablock({"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}}),
     "messages[1].content[0].type: server_tool_use blocks belong to server-executed tools; this server executes "
     "no tools"),
    ("container upload", ublock({"type": "container_upload", "file_id": "f"}),
     f"messages[0].content[0].type: container uploads need a code-execution container, {NOT_RUN}"),
    ("mcp tool use", ablock({"type": "mcp_tool_use", "id": "m", "name": "x", "server_name": "s", "input": {}}),
     f"messages[1].content[0].type: MCP blocks need a remote MCP connector, {NOT_RUN}"),
    ("unknown block", ublock({"type": "hologram"}),
     "messages[0].content[0].type: unknown content block type 'hologram'"),
    ("block without type", ublock({"text": "x"}), "missing required parameter messages[0].content[0].type"),
    ("structured output", {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     f"output_config.format: structured outputs need constrained decoding, {NOT_PROVIDED}"),
    ("bad effort", {"output_config": {"effort": "extreme"}},
     "output_config.effort: Input should be 'low', 'medium', 'high', 'xhigh' or 'max'"),
    ("container", {"container": "cnt_1"}, f"container: containers need a code-execution sandbox, {NOT_RUN}"),
    ("mcp servers", {"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]},
     f"mcp_servers: MCP servers need a remote MCP connector, {NOT_RUN}"),
    ("orphan result", m(U, {"role": "assistant", "content": "hi"}, {"role": "user", "content": [result("a")]}),
     "messages[2].content[0]: a tool_result must answer a tool_use of the assistant turn right before it"),
    ("missing result", after_calls([call("a")], U),
     "messages[2]: every tool_use needs a tool_result at the start of the next user message; missing: a"),
    ("duplicate result", after_calls([call("a")], [result("a"), result("a")]),
     "messages[2].content[1].tool_use_id: tool_use 'a' has more than one tool_result"),
    ("unknown result id", after_calls([call("a")], [result("b")]),
     "messages[2].content[0].tool_use_id: 'b' answers no tool_use of the preceding assistant turn (its ids: a)"),
    ("result after text", after_calls([call("a")], [{"type": "text", "text": "x"}, result("a")]),
     "messages[2].content[1]: tool_result blocks must come before any other content of the user turn"),
    ("duplicate call id", after_calls([call("a"), call("a")], [result("a")]),
     "messages[1].content[1].id: tool_use id 'a' is used twice in one turn"),
    ("call then system", after_calls([call("a")], {"role": "system", "content": "s"}, [result("a")]),
     "messages[1]: the tool_use blocks of this turn need their tool_result blocks in the next user message"),
    ("prefill thinking enabled", {"max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 1024},
                                  **m(U, {"role": "assistant", "content": "The"})},
     "messages[1]: an assistant prefill cannot be continued with thinking enabled; the prefill would have to "
     "follow a reasoning block the model never wrote"),
    ("prefill tool_use", after_calls([call("a")]),
     "messages[1].content[0]: an assistant prefill cannot contain tool_use blocks"),
    ("prefill thinking block", after_calls([THINKING, {"type": "text", "text": "The"}]),
     "messages[1].content[0]: an assistant prefill cannot contain thinking"),
    ("five cache marks", marked(5),
     "at most 4 blocks may carry cache_control; messages[0].content[4] would be the fifth"),
    ("request ttl conflict", {"cache_control": {"type": "ephemeral", "ttl": "1h"}, **text_with(**CC)},
     "the request-level cache_control (ttl 1h) targets messages[0].content[0], which already carries "
     "cache_control with ttl 5m"),
    ("request no slot", {"cache_control": {"type": "ephemeral"}, **marked(4)},
     "the request-level cache_control needs a breakpoint slot for messages[0].content[4], but 4 blocks already "
     "carry cache_control (messages[0].content[0], messages[0].content[1], messages[0].content[2], "
     "messages[0].content[3])"),
    ("bad ttl", text_with(cache_control={"type": "ephemeral", "ttl": "10m"}),
     "messages[0].content[0].cache_control.ttl: Input should be '5m' or '1h'"),
    ("bad cache type", text_with(cache_control={"type": "persistent"}),
     "messages[0].content[0].cache_control.type: Input should be 'ephemeral'"),
    ("corrupt signature", ablock({"type": "thinking", "thinking": "", "signature": "ninfer.r1.AAAA"}),
     "messages[1].content[0].signature: the thinking signature cannot be read: it is truncated or too large; "
     "pass thinking blocks back unchanged"),
    ("assistant order", after_calls([call("a"), {"type": "text", "text": "x"}], [result("a")]),
     "messages[1].content[1]: an assistant turn must read thinking, then text, then tool_use; this text block "
     "comes too late to be rendered"),
    ("kwargs messages", {"chat_template_kwargs": {"messages": []}},
     "chat_template_kwargs cannot set 'messages': the server decides it"),
    ("kwargs conflict", {"thinking": {"type": "disabled"}, "chat_template_kwargs": {"enable_thinking": True}},
     "enable_thinking=False disagrees with chat_template_kwargs.enable_thinking=True"),
    ("metadata user_id number", {"metadata": {"user_id": 5}}, "metadata.user_id must be a string"),
    ("system image", {"system": [image({"type": "url", "url": "https://x/a.png"})]},
     "system[0].type: Input should be 'text'"),
    ("system message tool_use", m({"role": "system", "content": [call("a")]}, U),
     "messages[0].content[0].type: system messages hold text blocks only"),
    ("tool_use input string", ablock({"type": "tool_use", "id": "a", "name": "n", "input": "{}"}),
     "messages[1].content[0].input must be an object"),
    ("stream not bool", {"stream": "yes"}, "stream must be a boolean"),
]


@pytest.fixture(scope="module")
def http(artifacts_dir, qwen_tokenizer):
    """One kept-alive connection to the server for the whole table."""
    live = start_anthropic_server(artifacts_dir, qwen_tokenizer)
    with httpx.Client(base_url=live.url, timeout=30) as client:
        yield client
    live.stop()


def request(fields: dict) -> dict:
    body = {"model": MODEL, "max_tokens": 100, "messages": [U], **fields}
    return {k: v for k, v in body.items() if v is not None}


@pytest.mark.parametrize("fields,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rejected_with_an_exact_anthropic_error(http, fields, message):
    r = http.post("/v1/messages", json=request(fields))
    request_id = r.headers["request-id"]
    assert r.status_code == 400, r.text
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": message},
                        "request_id": request_id}


def test_body_level_errors(http):
    r = http.post("/v1/messages", json=[1])
    assert r.status_code == 400 and r.json()["error"]["message"] == "the request body must be a JSON object"
    r = http.post("/v1/messages/count_tokens", content=b"{nope")
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("the request body is not valid JSON")
    assert r.json()["request_id"] == r.headers["request-id"]


def test_count_tokens_applies_the_same_rules(http):
    output_rules = ("max_tokens 0", "budget >= max", "5 stop sequences", "empty stop")  # a count reads no output
    for name, fields, message in CASES:
        r = http.post("/v1/messages/count_tokens", json=request(fields))
        if name in output_rules:
            assert r.status_code == 200 and r.json()["input_tokens"] > 0, name
        else:
            assert (r.status_code, r.json()["error"]["message"]) == (400, message), name


ADVISORY = [
    ("max_tokens omitted: the server default", {"max_tokens": None}),
    ("metadata user_id as a JSON string", {"metadata": {"user_id": '{"device_id":"d","session_id":"s"}'}}),
    ("context management", {"context_management": {"edits": [{"type": "clear_thinking_20251015"}]}}),
    ("service tier, geography and speed", {"service_tier": "auto", "inference_geo": "us", "speed": "fast"}),
    ("unknown top-level field", {"frobnicate": {"x": 1}}),
    ("adaptive thinking with effort", {"thinking": {"type": "adaptive"}, "output_config": {"effort": "high"}}),
    ("effort with thinking disabled", {"thinking": {"type": "disabled"}, "output_config": {"effort": "low"}}),
    ("empty MCP server list and null container", {"mcp_servers": [], "container": None}),
    ("1h cache marks and a merging request-level mark",
     {"cache_control": {"type": "ephemeral", "ttl": "1h"},
      **m({"role": "user", "content": [{"type": "text", "text": "ALPHA",
                                        "cache_control": {"type": "ephemeral", "ttl": "1h"}}]})}),
    ("four marks plus the request-level one on a marked block",
     {"cache_control": {"type": "ephemeral"},
      **m({"role": "user", "content": [{"type": "text", "text": f"b{i}", **CC} for i in range(3)]
           + [{"type": "text", "text": "ALPHA", **CC}]})}),
    ("redacted thinking and citations in history",
     m({"role": "user", "content": "x"},
       {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "opaque"},
                                         {"type": "text", "text": "y", "citations": None}]}, U)),
    ("foreign thinking signature", ablock({"type": "thinking", "thinking": "hm", "signature": "EqQBCkYIBxgC"})),
    ("tool with input_examples, eager streaming, direct caller and a rich schema",
     tool(input_examples=[{"n": 1}], eager_input_streaming=True, allowed_callers=["direct"], type="custom",
          input_schema={"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
                        "properties": {"-n": {"type": "integer", "minimum": 1, "default": 3}},
                        "additionalProperties": False})),
    ("tool_choice none and auto with parallel calls", {"tool_choice": {"type": "none"}, **tool()}),
    ("a billing block with a cache mark", {"system": [{"type": "text", "text": "x-anthropic-billing-header: cc=1",
                                                       **CC}]}),
    ("a truncated history that opens with results", m({"role": "user", "content": [result("gone")]}, U)),
]


@pytest.mark.parametrize("fields", [c[1] for c in ADVISORY], ids=[c[0] for c in ADVISORY])
def test_advisory_fields_and_headers_pass(http, fields):
    headers = {"anthropic-beta": "interleaved-thinking-2025-05-14,context-management-2025-06-27",
               "anthropic-version": "2023-06-01", "x-claude-code-session-id": "abc", "x-app": "cli"}
    r = http.post("/v1/messages?beta=true", json=request(fields), headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "message"
