"""Anthropic request lowering without a server: the conversation IR and the prompt it renders.

History joining, the positional billing rule, tool results in call order, prefill, thinking modes,
cache-marker slots and sealed reasoning are each decided here, before any engine is involved.
"""

from __future__ import annotations

import pytest
from anthropic_fixtures import MAINTAINED

from ninfer.chat import frontend_for, ir
from ninfer.protocol.anthropic_lowering import AnthropicDefaults, parse_messages_request
from ninfer.protocol.errors import ProtocolError
from ninfer.protocol.reasoning_seal import seal

EOS_IDS = [248046, 248044]
BILLING = "x-anthropic-billing-header: cc_version=2.1.3.abc; cc_entrypoint=cli; cch=00000;"
CC = {"cache_control": {"type": "ephemeral"}}


def lower(messages, vision: bool = False, **fields):
    return parse_messages_request({"model": "m", "messages": messages, **fields}, AnthropicDefaults(vision=vision))


@pytest.fixture(scope="module")
def frontend(qwen_tokenizer):
    return frontend_for(qwen_tokenizer, MAINTAINED.read_text(), EOS_IDS)


def prompt_text(frontend, messages, **fields) -> str:
    return frontend.build_prompt(lower(messages, **fields).conversation).text


def texts(message: ir.Message) -> list[str]:
    return [p.text for p in message.parts if isinstance(p, ir.TextPart)]


def test_consecutive_messages_join_without_separators_and_system_keeps_its_place():
    conv = lower([{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"}]},
                  {"role": "assistant", "content": "c"}, {"role": "system", "content": "s"},
                  {"role": "assistant", "content": "d"}, {"role": "assistant", "content": "e"},
                  {"role": "user", "content": "f"}], system="top").conversation
    assert [m.role for m in conv.messages] == ["system", "user", "assistant", "system", "assistant", "user"]
    assert texts(conv.messages[1]) == ["a", "b"] and texts(conv.messages[4]) == ["d", "e"]
    assert texts(conv.messages[0]) == ["top"] and texts(conv.messages[3]) == ["s"]


def test_mid_conversation_system_message_renders_at_its_position(frontend):
    text = prompt_text(frontend, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                  {"role": "system", "content": "NOTE"}, {"role": "user", "content": "c"}])
    assert text.index("b<|im_end|>") < text.index("<|im_start|>system\nNOTE<|im_end|>") < text.index("user\nc")


def test_billing_block_is_consumed_only_in_first_position_of_a_system_array(frontend):
    user = [{"role": "user", "content": "hi"}]
    plain = prompt_text(frontend, user, system=[{"type": "text", "text": "You are helpful."}])
    for value in (BILLING, BILLING.replace("00000", "99999") + " cc_is_subagent=true;"):
        consumed = prompt_text(frontend, user, system=[{"type": "text", "text": value, **CC},
                                                       {"type": "text", "text": "You are helpful."}])
        assert consumed == plain
    assert BILLING in prompt_text(frontend, user, system=BILLING)  # a string system value is content
    later = [{"type": "text", "text": "You are helpful."}, {"type": "text", "text": BILLING}]
    assert BILLING in prompt_text(frontend, user, system=later)
    inline = [{"role": "system", "content": [{"type": "text", "text": BILLING}]}, *user]
    assert BILLING in prompt_text(frontend, inline)


def test_billing_block_takes_its_cache_mark_with_it():
    conv = lower([{"role": "user", "content": "hi"}],
                 system=[{"type": "text", "text": BILLING, **CC}, {"type": "text", "text": "rules"}]).conversation
    assert conv.messages[0].parts == [ir.TextPart("rules")]


def test_tool_results_are_matched_by_id_and_put_in_call_order():
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    conv = lower([
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {"x": 1}},
                                          {"type": "tool_use", "id": "b", "name": "g", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "b", "content": [{"type": "text", "text": "t1"}, image,
                                                                     {"type": "text", "text": "t2"}]},
            {"type": "tool_result", "tool_use_id": "a", "content": "failed", "is_error": True},
            {"type": "text", "text": "what now?"}]},
    ], vision=True).conversation
    results = conv.messages[2].parts
    assert [p.call_id for p in results[:2]] == ["a", "b"] and results[0].is_error and not results[1].is_error
    assert [type(p).__name__ for p in results[1].content] == ["TextPart", "ImagePart", "TextPart"]
    assert results[2] == ir.TextPart("what now?")


def test_is_error_reaches_the_prompt_and_a_truncated_history_renders(frontend):
    text = prompt_text(frontend, [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "gone", "content": "disk full", "is_error": True}]},
        {"role": "user", "content": "continue"}])
    assert "<tool_response>\nError: disk full\n</tool_response>" in text and text.endswith("<think>\n")


def test_final_text_assistant_message_is_continued(frontend):
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "text", "text": "The"},
                                                                                    {"type": "text", "text": " end"}]}]
    conv = lower(messages).conversation
    assert conv.options.continue_final_message
    assert prompt_text(frontend, messages).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nThe end")
    assert not lower(messages, thinking={"type": "adaptive"}).conversation.options.enable_thinking


@pytest.mark.parametrize("config,enable,budget,sealed", [
    (None, None, None, False),
    ({"type": "disabled"}, False, None, False),
    ({"type": "adaptive"}, None, None, False),
    ({"type": "adaptive", "display": "omitted"}, None, None, True),
    ({"type": "enabled", "budget_tokens": 2048, "display": "summarized"}, True, 2048, False),
    ({"type": "enabled", "budget_tokens": 31999, "display": "omitted"}, True, 31999, True),
])
def test_thinking_modes(config, enable, budget, sealed):
    fields = {"max_tokens": 32000, **({"thinking": config} if config else {})}
    msg = lower([{"role": "user", "content": "q"}], **fields)
    assert (msg.thinking.enable, msg.thinking.budget, msg.thinking.sealed) == (enable, budget, sealed)
    assert msg.conversation.options.enable_thinking == enable


def test_effort_passes_unless_thinking_is_disabled():
    user = [{"role": "user", "content": "q"}]
    assert lower(user, output_config={"effort": "max"}).conversation.options.reasoning_effort == "max"
    disabled = lower(user, output_config={"effort": "max"}, thinking={"type": "disabled"})
    assert disabled.conversation.options.reasoning_effort is None


def test_max_tokens_is_optional_and_output_fields_are_skipped_when_counting():
    body = {"model": "m", "messages": [{"role": "user", "content": "q"}], "stop_sequences": ["a"], "top_k": 3,
            "thinking": {"type": "enabled", "budget_tokens": 9000}}
    msg = parse_messages_request(body, AnthropicDefaults(default_max_tokens=10000))
    assert msg.max_tokens is None and msg.stop == ["a"] and msg.sampling.top_k == 3
    with pytest.raises(ProtocolError, match=r"less than max_tokens \(8192\)"):
        parse_messages_request(body, AnthropicDefaults())
    counted = parse_messages_request({**body, "max_tokens": 0}, AnthropicDefaults(), counting=True)
    assert counted.stop == [] and counted.thinking.budget == 9000


def test_cache_marks_land_on_their_blocks_and_the_request_level_one_on_the_last_cacheable_block():
    tool = {"name": "f", "input_schema": {"type": "object"}, **CC}
    conv = lower([{"role": "user", "content": [{"type": "text", "text": "a",
                                                "cache_control": {"type": "ephemeral", "ttl": "1h"}}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "b"},
                                                    {"type": "redacted_thinking", "data": "x"}]},
                  {"role": "user", "content": []}],
                 tools=[tool], system=[{"type": "text", "text": "s", **CC}],
                 cache_control={"type": "ephemeral"}).conversation
    assert conv.tools[0].cache == ir.CacheMark("5m") and conv.messages[0].parts[0].cache == ir.CacheMark("5m")
    assert conv.messages[1].parts[0].cache == ir.CacheMark("1h")
    # neither a thinking block nor an empty message can be cached: the text before them is the target
    assert conv.messages[2].parts[0].cache == ir.CacheMark("5m")
    conv = lower([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                 cache_control={"type": "ephemeral", "ttl": "1h"}).conversation
    assert conv.messages[1].parts[0].cache == ir.CacheMark("1h") and conv.messages[0].parts[0].cache is None


def test_cache_marks_become_write_candidates(frontend):
    shared = "a long shared prefix" * 8
    messages = [{"role": "user", "content": [{"type": "text", "text": shared, **CC},
                                             {"type": "text", "text": "\n\nthe question"}]}]
    marked = frontend.build_prompt(lower(messages).conversation)
    plain = frontend.build_prompt(lower([{"role": "user", "content": shared + "\n\nthe question"}]).conversation)
    assert marked.token_ids == plain.token_ids  # a marker changes no prompt content
    assert len(marked.cache_candidates) == 1 and not plain.cache_candidates


def test_sealed_reasoning_is_restored_and_visible_text_wins(frontend):
    def history(block):
        return [{"role": "user", "content": "q"}, {"role": "assistant", "content": [block, {"type": "text",
                                                                                          "text": "A."}]},
                {"role": "user", "content": "next"}]

    reasoning = "Weigh the options.\n"
    hidden = history({"type": "thinking", "thinking": "", "signature": seal(reasoning)})
    visible = history({"type": "thinking", "thinking": reasoning, "signature": "anything"})
    foreign = history({"type": "thinking", "thinking": "", "signature": "EqQBCkYIBxgCKkB"})
    kwargs = {"preserve_thinking": True}
    assert prompt_text(frontend, hidden, **kwargs) == prompt_text(frontend, visible, **kwargs)
    assert "Weigh the options." in prompt_text(frontend, hidden, **kwargs)
    assert "Weigh" not in prompt_text(frontend, foreign, **kwargs)
    damaged = history({"type": "thinking", "thinking": "", "signature": seal(reasoning)[:-6]})
    with pytest.raises(ProtocolError, match="signature cannot be read") as err:
        lower(damaged)
    assert err.value.param == "messages[1].content[0].signature"


def test_tools_render_as_given_with_input_examples_after_the_description(frontend):
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
              "properties": {"-n": {"type": "integer", "minimum": 1, "default": 5}}, "additionalProperties": False}
    tools = [{"name": "head", "description": "First lines.", "input_schema": schema,
              "input_examples": [{"-n": 3}]}]
    msg = lower([{"role": "user", "content": "q"}], tools=tools)
    assert msg.conversation.tools[0].parameters == schema
    assert msg.conversation.tools[0].description == 'First lines.\n\nExample inputs:\n{"-n": 3}'
    text = frontend.build_prompt(msg.conversation).text
    assert '"-n": {"type": "integer", "minimum": 1, "default": 5}' in text and "Example inputs:" in text


def test_tool_choice_none_keeps_tools_in_the_prompt_but_disables_calls():
    msg = lower([{"role": "user", "content": "q"}], tools=[{"name": "f", "input_schema": {"type": "object"}}],
                tool_choice={"type": "none"})
    assert msg.conversation.tools and msg.conversation.effective_tools() == []
