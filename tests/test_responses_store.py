"""Without a server: the Response store (LRU by count and bytes, shared chain history, deletion that
keeps descendants usable, oversize refusal), the reasoning seal, and Item grouping into turns."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from ninfer.chat import ir
from ninfer.protocol.errors import ProtocolError
from ninfer.protocol.reasoning_seal import SealError, seal, unseal
from ninfer.protocol.responses_history import conversation_messages
from ninfer.protocol.responses_items import ItemRules, parse_items
from ninfer.store import LocalResponseStore, NewResponse, PutResult, RayResponseStore, ResponseStore
from ninfer.store.response_store import json_size


def item(text: str) -> dict:
    return {"id": f"msg_{text}", "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def new(rid: str, parent: str | None = None, text: str = "x", **extra) -> NewResponse:
    return NewResponse(id=rid, response={"id": rid, "object": "response"}, input_items=[item(f"{rid}-in-{text}")],
                       output_items=[item(f"{rid}-out")], session_key=f"responses:{rid}", preserve_thinking=None,
                       parent_id=parent, **extra)


def test_lru_by_record_count():
    store = ResponseStore(max_records=2, max_bytes=1 << 20)
    for rid in ("a", "b"):
        assert store.put(new(rid)) is PutResult.STORED
    assert store.response("a") is not None  # touch: b is now the oldest
    store.put(new("c"))
    assert store.response("b") is None and store.response("a") and store.response("c")


def test_lru_by_bytes_and_exact_accounting():
    one = json_size({"id": "a", "object": "response"}) + json_size([item("a-in-x"), item("a-out")])
    store = ResponseStore(max_records=100, max_bytes=2 * one + 10)
    store.put(new("a"))
    assert store.usage() == {"records": 1, "bytes": one, "nodes": 1}
    store.put(new("b"))
    store.put(new("c"))  # a third would pass the byte limit: the oldest goes
    assert store.response("a") is None and store.usage()["records"] == 2
    for rid in ("b", "c"):
        store.delete(rid)
    assert store.usage() == {"records": 0, "bytes": 0, "nodes": 0}


def test_chains_share_history_and_survive_parent_deletion():
    store = ResponseStore(max_records=10, max_bytes=1 << 20)
    store.put(new("root"))
    store.put(new("child", parent="root"))
    store.put(new("grandchild", parent="child"))
    history = store.continuation("grandchild").history
    assert [i["id"] for i in history] == ["msg_root-in-x", "msg_root-out", "msg_child-in-x", "msg_child-out",
                                          "msg_grandchild-in-x", "msg_grandchild-out"]
    assert store.continuation("child").session_key == "responses:child"  # the router decides inheritance
    assert store.delete("root") and store.delete("child")
    assert store.response("root") is None and store.continuation("child") is None
    assert len(store.continuation("grandchild").history) == 6  # descendants keep their context
    assert store.input_items("grandchild") == [item("grandchild-in-x")]
    store.delete("grandchild")
    assert store.usage() == {"records": 0, "bytes": 0, "nodes": 0}


def test_oversized_response_is_refused_without_changes():
    store = ResponseStore(max_records=10, max_bytes=400)
    store.put(new("small"))
    before = store.usage()
    assert store.put(new("big", text="y" * 1000)) is PutResult.TOO_LARGE
    assert store.usage() == before and store.response("small")
    assert ResponseStore(max_records=0, max_bytes=1 << 20).put(new("a")) is PutResult.TOO_LARGE


def test_parent_that_left_the_store_travels_with_the_child():
    store = ResponseStore(max_records=10, max_bytes=1 << 20)
    assert store.put(new("child", parent="gone")) is PutResult.PARENT_GONE and store.usage()["records"] == 0
    assert store.put(new("child", parent="gone", parent_history=[item("old")])) is PutResult.STORED
    assert [i["id"] for i in store.continuation("child").history] == ["msg_old", "msg_child-in-x", "msg_child-out"]
    store.delete("child")
    assert store.usage()["bytes"] == 0


def test_store_clients_offer_the_same_methods_as_the_deployment():
    local = LocalResponseStore(ResponseStore(4, 1 << 20))
    assert asyncio.run(local.put(new("a"))) is PutResult.STORED
    assert asyncio.run(local.response("a")) == {"id": "a", "object": "response"}

    class Handle:  # what a Serve DeploymentHandle looks like to the client: handle.method.remote(...)
        def __getattr__(self, name):
            method = getattr(local.store, name)

            class Remote:
                async def remote(self, *args):
                    return method(*args)

            return Remote()

    ray_store = RayResponseStore(Handle())
    assert asyncio.run(ray_store.input_items("a")) == [item("a-in-x")]
    assert asyncio.run(ray_store.delete("a")) is True
    methods = {n for n, _ in inspect.getmembers(LocalResponseStore, inspect.iscoroutinefunction)}
    assert methods == {n for n, _ in inspect.getmembers(RayResponseStore, inspect.iscoroutinefunction)}
    assert methods <= set(dir(ResponseStore))


def test_seal_round_trip_and_damage():
    text = "Ünïcode reasoning\n" * 50
    sealed = seal(text)
    assert unseal(sealed) == text and len(sealed) < len(text.encode())
    for damaged in (sealed[:-4], sealed[:12] + ("A" if sealed[12] != "A" else "B") + sealed[13:], "gAAAAB-openai",
                    "ninfer.r1.!!!"):
        with pytest.raises(SealError):
            unseal(damaged)


def parsed(*values):
    return parse_items(list(values), {"input": list(values)}, ItemRules(vision=False))


CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"b": 1, "a": 2}'}


def test_assistant_items_form_one_turn_in_template_order():
    messages = conversation_messages(parsed(
        {"role": "user", "content": "q"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "think "}]},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "more"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "a"}, {"type": "refusal", "refusal": "r"}]},
        CALL, {**CALL, "call_id": "c2", "namespace": "ns"},
        {"type": "function_call_output", "call_id": "c2", "output": "two"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"}))
    assert [m.role for m in messages] == ["user", "assistant", "tool"]
    parts = messages[1].parts
    assert [p.type for p in parts] == ["reasoning", "reasoning", "text", "refusal", "tool_call", "tool_call"]
    assert list(parts[4].arguments) == ["b", "a"] and (parts[5].namespace, parts[5].name) == ("ns", "f")
    assert [(r.call_id, r.content[0].text) for r in messages[2].parts] == [("c1", "one"), ("c2", "two")]


def test_a_partial_prefix_of_results_is_kept_and_a_reasoning_only_turn_stays():
    messages = conversation_messages(parsed(
        {"role": "user", "content": "q"}, CALL, {**CALL, "call_id": "c2"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"role": "user", "content": "next"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "only"}]},
        {"type": "reasoning", "summary": [], "encrypted_content": None},  # Codex's empty replay: nothing to add
        {"role": "user", "content": "again"}))
    assert [m.role for m in messages] == ["user", "assistant", "tool", "user", "assistant", "user"]
    assert messages[4].parts == [ir.ReasoningPart("only")]


def test_generated_ids_and_canonical_items():
    items = parsed({"role": "assistant", "content": "hi"}, CALL,
                   {"type": "function_call_output", "call_id": "c1", "output": "ok", "id": "mine"})
    assert items[0].id.startswith("msg_") and items[1].id.startswith("fc_") and items[2].id == "mine"
    assert items[0].wire["content"] == [{"type": "output_text", "text": "hi", "annotations": []}]
    assert items[1].wire == {"id": items[1].id, "type": "function_call", "status": "completed", "call_id": "c1",
                             "name": "f", "arguments": CALL["arguments"]}
    with pytest.raises(ProtocolError) as err:
        parsed({"type": "reasoning", "content": [], "encrypted_content": seal("x")[:-3]})
    assert err.value.code == "invalid_encrypted_content"
