"""The Qwen output decoder (contract: reasoning/content split of "OpenAI Chat Completions"; the tool-call
paragraphs of "Function tools" and "Responses streaming"; the schema-typing paragraph; the fallback
reasons of the request log's tool_call_parse).
"""

from __future__ import annotations

import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer.chat import ir
from ninfer.chat.decoder import OutputDecoder, QwenToolCalls
from ninfer.engine.types import Channel

WEATHER = ir.ToolDef("get_weather", parameters={
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}}})
TYPED = ir.ToolDef("typed", parameters={"type": "object", "properties": {
    "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"}, "b": {"type": "boolean"},
    "o": {"type": "object"}, "a": {"type": "array"}, "z": {"type": "null"},
    "s_or_i": {"type": ["string", "integer"]}, "i_or_null": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
    "mixed": {"oneOf": [{"type": "integer"}, {"$ref": "#/x"}]}, "free": {"description": "no type"}}})
NAMESPACED = ir.ToolDef("get_current", namespace="mcp__weather",
                        parameters={"type": "object", "properties": {"city": {"type": "string"}}})


def ids():
    counter = itertools.count(1)
    return lambda: f"call_{next(counter)}"


def decoder(tools=(WEATHER, TYPED, NAMESPACED), *, thinking=False) -> OutputDecoder:
    calls = QwenToolCalls(list(tools), ids()) if tools else None
    return OutputDecoder(starts_in_reasoning=thinking, tool_calls=calls)


def run(chunks, tools=(WEATHER, TYPED, NAMESPACED), *, thinking=False):
    """Feed (text, channel) chunks; returns (all deltas, the decoded output)."""
    dec = decoder(tools, thinking=thinking)
    deltas = []
    for text, channel in chunks:
        deltas += dec.feed(text, channel)
    tail, result = dec.finish()
    return deltas + tail, result


def answer(text: str, tools=(WEATHER, TYPED, NAMESPACED)) -> ir.DecodedOutput:
    return run([(text, Channel.ANSWER)], tools)[1]


def call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


# ---- channels -------------------------------------------------------------------------------------


def test_reasoning_and_answer_are_split_and_the_break_after_think_is_dropped():
    deltas, result = run([("Let me see.\n", Channel.REASONING), ("\n\n", Channel.ANSWER), ("Four.", Channel.ANSWER)],
                         thinking=True)
    assert result.reasoning == "Let me see.\n" and result.content == "Four."
    assert [d.reasoning for d in deltas if d.reasoning] == ["Let me see.\n"]


def test_answer_without_thinking_keeps_its_leading_whitespace():
    assert run([("  indented", Channel.ANSWER)], tools=())[1].content == "  indented"


def test_ordinary_text_streams_at_once_and_only_an_ambiguous_marker_is_held():
    """Contract: only an ambiguous <tool_call> suffix is held, never ordinary text."""
    dec = decoder()
    assert [d.content for d in dec.feed("Hello", Channel.ANSWER)] == ["Hello"]
    assert dec.feed(" <tool", Channel.ANSWER) == []  # could still become a call
    assert [d.content for d in dec.feed("s are <fun>", Channel.ANSWER)] == [" <tools are <fun>"]
    deltas, result = dec.finish()
    assert deltas == [] and result.content == "Hello <tools are <fun>" and result.fallback_reason == "none"


def test_without_effective_tools_markers_are_plain_text():
    """Contract: tool_choice none disables structured tool output."""
    deltas, result = run([(call("get_weather", city="Paris"), Channel.ANSWER)], tools=())
    assert result.tool_calls == [] and result.content == call("get_weather", city="Paris")
    assert not result.tool_parse.marker_seen


# ---- calls ------------------------------------------------------------------------------------------


def test_a_call_is_parsed_and_the_space_before_it_is_not_content():
    deltas, result = run([("Checking.\n\n", Channel.ANSWER), (call("get_weather", city="Paris", days="3"),
                                                              Channel.ANSWER)])
    assert result.content == "Checking."
    [c] = result.tool_calls
    assert (c.call_id, c.name, c.namespace, c.arguments) == ("call_1", "get_weather", None,
                                                             {"city": "Paris", "days": 3})
    assert result.fallback_reason == "none" and result.tool_parse.marker_seen
    starts = [d.tool_call_start for d in deltas if d.tool_call_start]
    arguments = [d.tool_call_arguments for d in deltas if d.tool_call_arguments]
    assert starts == [c] and arguments == [(0, '{"city": "Paris", "days": 3}')]


def test_parallel_calls_keep_their_order():
    result = answer(call("get_weather", city="A") + "\n" + call("get_weather", city="B"))
    assert [c.arguments["city"] for c in result.tool_calls] == ["A", "B"]
    assert [c.call_id for c in result.tool_calls] == ["call_1", "call_2"]


def test_namespace_and_name_are_the_identity():
    """Contract: namespace/function pairs restore separate namespace and name fields."""
    [c] = answer(call("mcp__weather__get_current", city="Oslo")).tool_calls
    assert (c.namespace, c.name) == ("mcp__weather", "get_current")


def test_only_the_effective_tool_set_becomes_calls():
    """Contract: allowed_tools filters the set; a declared but disallowed tool stays text."""
    conv = ir.Conversation([ir.Message("user", [ir.TextPart("q")])], tools=[WEATHER, NAMESPACED],
                           allowed_tools=[("mcp__weather", "get_current")])
    result = answer(call("get_weather", city="X"), tools=conv.effective_tools())
    assert result.tool_calls == [] and result.fallback_reason == "undeclared_tool"


def test_prose_quoting_a_marker_before_the_real_call_stays_content():
    text = "Use <tool_call> tags like this:\n" + call("get_weather", city="Rome")
    result = answer(text)
    assert result.content == "Use <tool_call> tags like this:"
    assert [c.arguments for c in result.tool_calls] == [{"city": "Rome"}]


def test_string_values_keep_nested_markers_and_balanced_parameter_blocks():
    """Contract: string parameters preserve call markers and balanced nested <parameter=...> text."""
    value = "<tool_call><function=x>\n<parameter=k>\ninner\n</parameter>\nend"
    [c] = answer(call("get_weather", city=value)).tool_calls
    assert c.arguments["city"] == value


# ---- fallback reasons: one test each ---------------------------------------------------------------


def assert_fallback(text: str, reason: str, tools=(WEATHER, TYPED, NAMESPACED)) -> None:
    """The whole output comes back as content, byte for byte, with the classified reason."""
    deltas, result = run([(text, Channel.ANSWER)], tools)
    assert result.tool_calls == [] and result.content == text
    assert "".join(d.content for d in deltas if d.content) == text
    assert result.fallback_reason == reason


def test_fallback_none_without_a_marker():
    assert_fallback("No tools needed: 2 < 3 and <tool_ is not a marker.", "none")


def test_fallback_malformed_structure():
    assert_fallback("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
                    "malformed_structure")


def test_fallback_malformed_when_the_output_ends_inside_a_call():
    assert_fallback("Sure. <tool_call>\n<function=get_weather>\n<parameter=city>\nPar", "malformed_structure")


def test_fallback_malformed_for_an_unmatched_nested_opener_or_a_stray_closer():
    """Contract: the wire format has no escape, so these cannot be represented unambiguously."""
    assert_fallback(call("get_weather", city="a <parameter=x> b"), "malformed_structure")
    assert_fallback("<tool_call>\n<function=get_weather>\n<parameter=city>\nx\n</parameter>\ny</parameter>\n"
                    "</function>\n</tool_call>", "malformed_structure")


def test_fallback_duplicate_parameter():
    assert_fallback("<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n"
                    "<parameter=city>\nB\n</parameter>\n</function>\n</tool_call>", "duplicate_parameter")


def test_fallback_invalid_tool_name():
    assert_fallback(call("get weather!", city="x"), "invalid_tool_name")


def test_fallback_undeclared_tool():
    assert_fallback(call("delete_everything", path="/"), "undeclared_tool")


def test_fallback_trailing_content():
    assert_fallback(call("get_weather", city="x") + "\nI called it.", "trailing_content")


# ---- schema typing: one test per rule -------------------------------------------------------------


def typed(param: str, raw: str):
    """(arguments, stats) of one `typed` call with a raw parameter block."""
    result = answer(f"<tool_call>\n<function=typed>\n<parameter={param}>{raw}</parameter>\n</function>\n</tool_call>")
    [c] = result.tool_calls
    return c.arguments, result.tool_parse


def test_string_admitting_values_stay_strings_including_empty():
    assert typed("s", "\n42\n")[0] == {"s": "42"}
    assert typed("s", "\n\n")[0] == {"s": ""}
    assert typed("s_or_i", "\n7\n")[0] == {"s_or_i": "7"}
    assert typed("s", "\n  two lines\n  kept \n\n")[0] == {"s": "  two lines\n  kept \n"}  # one framing break


def test_empty_block_of_a_declared_non_string_is_omitted():
    arguments, stats = typed("i", "\n \n")
    assert arguments == {} and stats.empty_arguments_omitted == 1


def test_admitted_json_keeps_its_type():
    assert typed("i", "\n3\n")[0] == {"i": 3}
    assert typed("n", "\n2.5\n")[0] == {"n": 2.5}
    assert typed("n", "\n4\n")[0] == {"n": 4}
    assert typed("o", '\n{"b": 1, "a": [true]}\n')[0] == {"o": {"b": 1, "a": [True]}}
    assert typed("a", "\n[1, \"x\"]\n")[0] == {"a": [1, "x"]}
    assert typed("z", "\nnull\n")[0] == {"z": None}
    assert typed("i_or_null", "\nnull\n")[0] == {"i_or_null": None}


def test_case_insensitive_boolean_text_is_normalized():
    assert typed("b", "\nTrue\n")[0] == {"b": True}
    assert typed("b", "\nFALSE\n")[0] == {"b": False}


def test_mismatched_valid_json_keeps_its_represented_type():
    arguments, stats = typed("i", "\n2.5\n")
    assert arguments == {"i": 2.5} and stats.schema_mismatch_arguments == 1
    assert typed("b", '\n"yes"\n')[0] == {"b": "yes"}


def test_mismatched_non_json_text_becomes_a_string():
    arguments, stats = typed("i", "\nabout 3\n")
    assert arguments == {"i": "about 3"} and stats.schema_mismatch_arguments == 1
    assert typed("n", "\nNaN\n")[0] == {"n": "NaN"}  # not JSON


def test_schema_without_a_supported_type_keeps_untyped_inference():
    assert typed("free", "\n 12 \n")[0] == {"free": 12}
    assert typed("free", "\nhello\n")[0] == {"free": "hello"}
    assert typed("mixed", "\n[1]\n")[0] == {"mixed": [1]}  # an anyOf branch without a type: untyped


def test_undeclared_parameter_is_kept_untyped_and_counted():
    arguments, stats = typed("extra", "\n{\"k\": 1}\n")
    assert arguments == {"extra": {"k": 1}} and stats.schema_mismatch_arguments == 1


# ---- replay -------------------------------------------------------------------------------------------


def test_member_order_survives_a_replay(qwen_tokenizer):
    """Contract: canonical model-origin arguments keep member order, so an unmodified replay reconstructs
    the same ordered call, and the prompt holds the exact bytes the model generated."""
    from pathlib import Path

    from ninfer.chat import frontend_for

    template = (Path(__file__).parent.parent / "ninfer" / "chat" / "templates" / "qwen3_6_ninfer.jinja").read_text()
    frontend = frontend_for(qwen_tokenizer, template, [248046])
    tool = ir.ToolDef("plan", parameters={"type": "object", "properties": {
        "title": {"type": "string"}, "steps": {"type": "array"}, "budget": {"type": "number"}}})
    generated = ('<tool_call>\n<function=plan>\n<parameter=steps>\n["b", "a"]\n</parameter>\n'
                 '<parameter=title>\nTrip\n</parameter>\n<parameter=budget>\n12.5\n</parameter>\n'
                 "</function>\n</tool_call>")
    conv = ir.Conversation([ir.Message("user", [ir.TextPart("Plan it")])], tools=[tool])
    prompt = frontend.build_prompt(conv)
    dec = frontend.output_decoder(conv, prompt)
    dec.feed("I should plan.\n", Channel.REASONING)
    dec.feed("\n\n" + generated, Channel.ANSWER)
    _, result = dec.finish()
    [c] = result.tool_calls
    assert list(c.arguments) == ["steps", "title", "budget"]
    # The client replays the call it received (arguments as JSON text) with the tool's result.
    replayed = ir.ToolCallPart(c.call_id, c.name, json.loads(c.arguments_json()), raw_arguments=c.arguments_json())
    history = ir.Conversation([*conv.messages,
                               ir.Message("assistant", [ir.ReasoningPart(result.reasoning), replayed]),
                               ir.Message("tool", [ir.ToolResultPart(c.call_id, [ir.TextPart("ok")])])],
                              tools=[tool])
    assert f"<|im_start|>assistant\n<think>\nI should plan.\n</think>\n\n{generated}<|im_end|>" in \
        frontend.build_prompt(history).text


# ---- streaming properties -------------------------------------------------------------------------------

FRAGMENTS = ["Hello", " ", "\n", "<", "tool", "_call>", "<tool_call>", "</tool_call>", "<function=get_weather>",
             "<function=typed>", "</function>", "<parameter=city>", "<parameter=i>", "</parameter>", "Paris", "42",
             "<tool_", "é", "🌍", " <t", call("get_weather", city="Nice"), call("typed", i="7", b="true")]


@st.composite
def streams(draw):
    """A reasoning prefix (maybe) and an answer assembled from marker-heavy fragments, split at random."""
    thinking = draw(st.booleans())
    reasoning = draw(st.text(max_size=20)) if thinking else ""
    answer_text = "".join(draw(st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=4), max_size=12)))
    chunks = []
    for channel, body in ((Channel.REASONING, reasoning), (Channel.ANSWER, answer_text)):
        cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=6)))
        pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)])]
        chunks += [(p, channel) for p in pieces]
    return thinking, reasoning, answer_text, chunks


def summary(result: ir.DecodedOutput):
    return (result.reasoning, result.content, [(c.name, c.namespace, c.arguments) for c in result.tool_calls],
            result.fallback_reason, result.tool_parse)


@settings(max_examples=300, deadline=None)
@given(streams())
def test_any_chunking_decodes_like_one_pass(stream):
    thinking, reasoning, answer_text, chunks = stream
    _, whole = run([(reasoning, Channel.REASONING), (answer_text, Channel.ANSWER)], thinking=thinking)
    _, split = run(chunks, thinking=thinking)
    assert summary(split) == summary(whole)


@settings(max_examples=300, deadline=None)
@given(streams())
def test_concatenated_deltas_equal_the_final_result(stream):
    thinking, _, _, chunks = stream
    deltas, result = run(chunks, thinking=thinking)
    assert "".join(d.reasoning or "" for d in deltas) == result.reasoning
    assert "".join(d.content or "" for d in deltas) == result.content
    starts = [d.tool_call_start for d in deltas if d.tool_call_start is not None]
    arguments: dict[int, str] = {}
    for d in deltas:
        if d.tool_call_arguments is not None:
            index, text = d.tool_call_arguments
            arguments[index] = arguments.get(index, "") + text
    assert starts == result.tool_calls
    assert [arguments[i] for i in range(len(starts))] == [c.arguments_json() for c in result.tool_calls]


@settings(max_examples=300, deadline=None)
@given(streams())
def test_no_answer_byte_is_lost(stream):
    """Contract: malformed markup flows back as ordinary text without losing bytes; accepted calls take
    only the region they consume and the whitespace right before it."""
    thinking, _, answer_text, chunks = stream
    _, result = run(chunks, thinking=thinking)
    expected = answer_text.lstrip(" \t\r\n\f\v") if thinking else answer_text
    if result.tool_calls:
        assert expected.startswith(result.content) and "<tool_call>" in expected[len(result.content):].lstrip()
    else:
        assert result.content == expected
