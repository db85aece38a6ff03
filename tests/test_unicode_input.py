"""A lone UTF-16 surrogate anywhere in a request body is a field-specific 400, never a 500.

JSON can spell one ("\\udcff") and Python's json decodes it into a str that cannot become UTF-8, so
it used to fail inside the tokenizer. The bodies here are raw bytes: a JSON encoder would refuse to
write them, and the point is what arrives on the wire. Every generation and count endpoint of both
protocols is covered, in its own error shape.
"""

from __future__ import annotations

import httpx
import pytest
from anthropic_fixtures import start_anthropic_server
from server_fixtures import MODEL, scripted_artifact, start_server

LONE = r"\udcff"  # the six characters of the escape, as a client writes them
OPENAI_BODIES = {
    "/v1/chat/completions": ('{"model": "%s", "messages": [{"role": "user", "content": "ALPHA %s"}]}',
                             "messages[0].content"),
    "/v1/responses": ('{"model": "%s", "input": [{"role": "user", "content": "ALPHA %s"}]}', "input[0].content"),
    "/v1/responses/input_tokens": ('{"model": "%s", "input": [{"role": "user", "content": [{"type": "input_text", '
                                   '"text": "ALPHA %s"}]}]}', "input[0].content[0].text"),
}
ANTHROPIC_BODIES = {
    "/v1/messages": ('{"model": "claude-local", "max_tokens": 10, "messages": [{"role": "user", "content": '
                     '[{"type": "text", "text": "ALPHA %s"}]}]}', "messages[0].content[0].text"),
    "/v1/messages/count_tokens": ('{"model": "claude-local", "system": "be %s brief", "messages": '
                                  '[{"role": "user", "content": "ALPHA"}]}', "system"),
}


@pytest.fixture(scope="module")
def openai_server(artifacts_dir, qwen_tokenizer):
    live = start_server(scripted_artifact(artifacts_dir, qwen_tokenizer), qwen_tokenizer)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def anthropic_server(artifacts_dir, qwen_tokenizer):
    live = start_anthropic_server(artifacts_dir, qwen_tokenizer)
    yield live
    live.stop()


def post(server, path: str, raw: str | bytes) -> httpx.Response:
    content = raw.encode() if isinstance(raw, str) else raw
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=30)


def openai_error(r: httpx.Response, param: str) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "invalid_unicode", param)
    assert err["message"].startswith(param + ":")
    return err


@pytest.mark.parametrize("path", list(OPENAI_BODIES))
@pytest.mark.parametrize("stream", [False, True])
def test_openai_endpoints_name_the_field_with_a_lone_surrogate(openai_server, path, stream):
    template, param = OPENAI_BODIES[path]
    raw = template % (MODEL, LONE)
    if stream and path != "/v1/responses/input_tokens":
        raw = raw[:-1] + ', "stream": true}'
    openai_error(post(openai_server, path, raw), param)
    assert "x-request-id" in post(openai_server, path, raw).headers


@pytest.mark.parametrize("path", list(ANTHROPIC_BODIES))
def test_anthropic_endpoints_name_the_field_with_a_lone_surrogate(anthropic_server, path):
    template, param = ANTHROPIC_BODIES[path]
    r = post(anthropic_server, path, template % LONE)
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith(param + ":") and "surrogate" in body["error"]["message"]
    assert body["request_id"] == r.headers["request-id"]


def test_anthropic_stream_is_refused_before_it_opens(anthropic_server):
    template, param = ANTHROPIC_BODIES["/v1/messages"]
    r = post(anthropic_server, "/v1/messages", (template % LONE)[:-1] + ', "stream": true}')
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["message"].startswith(param + ":")


@pytest.mark.parametrize("fields, param", [
    # a high surrogate without its low half, in a tool schema the template renders
    ('"tools": [{"type": "function", "function": {"name": "f", "description": "x\\ud83d",'
     ' "parameters": {"type": "object"}}}]', "tools[0].function.description"),
    # a member name (historical tool arguments keep their keys in the prompt)
    ('"metadata": {"\\udcff": "v"}', "metadata.\\udcff"),
    # a low half before its high half is two lone surrogates, not a pair
    ('"user": "\\ude00\\ud83d"', "user"),
])
def test_any_field_and_member_names_are_checked(openai_server, fields, param):
    raw = '{"model": "%s", "messages": [{"role": "user", "content": "ALPHA"}], %s}' % (MODEL, fields)
    openai_error(post(openai_server, "/v1/chat/completions", raw), param)


def test_an_encoded_surrogate_in_raw_bytes_is_refused_too(openai_server):
    # CESU-style bytes for U+DCFF: not UTF-8, but json decodes bytes with surrogatepass
    raw = b'{"model": "%s", "input": "ALPHA \xed\xb3\xbf"}' % MODEL.encode()
    openai_error(post(openai_server, "/v1/responses/input_tokens", raw), "input")


def test_valid_pairs_and_escaped_backslashes_still_count(openai_server, anthropic_server):
    def count(escaped: str) -> int:
        r = post(openai_server, "/v1/responses/input_tokens", '{"model": "%s", "input": "hi %s"}' % (MODEL, escaped))
        assert r.status_code == 200, r.text
        return r.json()["input_tokens"]

    assert count(r"\ud83d\ude00") == count("\U0001F600")  # a pair is one code point, as if sent in UTF-8
    assert count(r"\\udcff") > 0  # an escaped backslash, then the text "udcff": no surrogate at all
    r = post(anthropic_server, "/v1/messages/count_tokens",
             '{"model": "m", "messages": [{"role": "user", "content": "ALPHA \\ud83d\\ude00"}]}')
    assert r.status_code == 200 and r.json()["input_tokens"] > 0


def test_generation_after_a_refusal_is_unaffected(openai_server):
    template, _ = OPENAI_BODIES["/v1/chat/completions"]
    assert post(openai_server, "/v1/chat/completions", template % (MODEL, LONE)).status_code == 400
    r = post(openai_server, "/v1/chat/completions", template.replace(" %s", "") % MODEL)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "The answer is 4."


def test_bodies_from_python_callers_are_checked_the_same_way():
    # the Router deployment's count_tokens handle method takes a dict, not JSON bytes
    from ninfer.protocol.errors import ProtocolError
    from ninfer.server.request_body import check_unicode

    check_unicode({"messages": [{"role": "user", "content": "fine \U0001F600"}]})
    with pytest.raises(ProtocolError) as caught:
        check_unicode({"messages": [{"role": "user", "content": ["ok", "bad \udcff"]}]})
    assert (caught.value.param, caught.value.code, caught.value.status) == ("messages[0].content[1]", "invalid_unicode", 400)
