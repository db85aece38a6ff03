"""Prompt boundaries for the context cache (contract: "OpenAI prompt caching"; "Execution behavior":
conversation endpoints, the input checkpoint before a response, shared-prefix hints) and media binding.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ninfer.chat import frontend_for, ir

TEMPLATE = (Path(__file__).parent.parent / "ninfer" / "chat" / "templates" / "qwen3_6_ninfer.jinja").read_text()
QWEN_EOS = [248046, 248044]
IM_START, IM_END = 248045, 248046
TOOL_RESPONSE_CLOSE = 248067


@pytest.fixture(scope="module")
def qwen(qwen_tokenizer):
    return frontend_for(qwen_tokenizer, TEMPLATE, QWEN_EOS)


def text(t: str, **kw) -> ir.TextPart:
    return ir.TextPart(t, **kw)


def msg(role: str, *parts: ir.Part) -> ir.Message:
    return ir.Message(role, list(parts))


def ends_before(prompt: ir.Prompt, offset: int, tokenizer) -> str:
    return tokenizer.decode(prompt.token_ids[:offset])


CONVERSATION = [msg("system", text("Sys.")), msg("user", text("Q1")), msg("assistant", text("A1")),
                msg("user", text("Q2"))]


def test_message_ends_follow_each_turn(qwen, qwen_tokenizer):
    prompt = qwen.build_prompt(ir.Conversation(CONVERSATION))
    assert len(prompt.message_ends) == 4
    for end, body in zip(prompt.message_ends, ["Sys.", "Q1", "A1", "Q2"]):
        assert ends_before(prompt, end, qwen_tokenizer).endswith(f"{body}<|im_end|>\n")
        assert prompt.token_ids[end] == IM_START  # the next turn (or the generation prologue) opens right here


def test_tool_results_in_one_user_turn_end_one_by_one(qwen, qwen_tokenizer):
    conv = ir.Conversation([msg("user", text("go")),
                            msg("assistant", ir.ToolCallPart("a", "f", {}), ir.ToolCallPart("b", "f", {})),
                            msg("tool", ir.ToolResultPart("a", [text("r1")])),
                            msg("tool", ir.ToolResultPart("b", [text("r2")]))],
                           tools=[ir.ToolDef("f")])
    prompt = qwen.build_prompt(conv)
    first, second = prompt.message_ends[-2:]
    assert prompt.token_ids[first - 1] == TOOL_RESPONSE_CLOSE
    assert ends_before(prompt, first, qwen_tokenizer).endswith("<tool_response>\nr1\n</tool_response>")
    assert ends_before(prompt, second, qwen_tokenizer).endswith("r2\n</tool_response><|im_end|>\n")


def test_input_boundary_precedes_generation_prologue(qwen, qwen_tokenizer):
    """With no assistant turn after the last query, the input checkpoint is right before the prologue."""
    prompt = qwen.build_prompt(ir.Conversation(CONVERSATION))
    assert prompt.input_boundary == prompt.message_ends[-1]
    tail = qwen_tokenizer.decode(prompt.token_ids[prompt.input_boundary:])
    assert tail == "<|im_start|>assistant\n<think>\n"


TOOL_LOOP = [msg("user", text("Weather?")),
             msg("assistant", ir.ReasoningPart("need a call"), ir.ToolCallPart("c", "f", {"x": 1})),
             msg("tool", ir.ToolResultPart("c", [text("sunny")]))]


def test_input_boundary_with_preserve_thinking_on_precedes_the_prologue(qwen, qwen_tokenizer):
    """Contract: with preserve_thinking=true the boundary precedes the response's generation prologue."""
    conv = ir.Conversation(TOOL_LOOP, tools=[ir.ToolDef("f")], options=ir.PromptOptions(preserve_thinking=True))
    prompt = qwen.build_prompt(conv)
    assert qwen_tokenizer.decode(prompt.token_ids[prompt.input_boundary:]) == "<|im_start|>assistant\n<think>\n"


def test_input_boundary_with_preserve_thinking_off_precedes_the_turn_whose_reasoning_goes(qwen, qwen_tokenizer):
    """Contract: with false it precedes the assistant turn whose closed reasoning may be omitted."""
    prompt = qwen.build_prompt(ir.Conversation(TOOL_LOOP, tools=[ir.ToolDef("f")]))
    tail = qwen_tokenizer.decode(prompt.token_ids[prompt.input_boundary:])
    assert tail.startswith("<|im_start|>assistant\n<think>\nneed a call\n</think>")
    assert ends_before(prompt, prompt.input_boundary, qwen_tokenizer).endswith("Weather?<|im_end|>\n")
    # ...and that boundary is a prefix of the next request's prompt, after the reasoning is dropped.
    after = qwen.build_prompt(ir.Conversation([*TOOL_LOOP, msg("assistant", text("Sunny.")),
                                               msg("user", text("Thanks"))], tools=[ir.ToolDef("f")]))
    assert after.token_ids[: prompt.input_boundary] == prompt.token_ids[: prompt.input_boundary]


def test_prefill_input_boundary_precedes_the_continued_turn(qwen, qwen_tokenizer):
    conv = ir.Conversation([msg("user", text("Hi")), msg("assistant", text("Hello"))],
                           options=ir.PromptOptions(continue_final_message=True))
    prompt = qwen.build_prompt(conv)
    assert qwen_tokenizer.decode(prompt.token_ids[prompt.input_boundary:]).startswith("<|im_start|>assistant\n")
    assert prompt.message_ends == [prompt.input_boundary]  # the open turn has no end yet


# ---- cache write candidates ----------------------------------------------------------------------


def test_implicit_candidate_precedes_the_latest_message_closing_tokens(qwen, qwen_tokenizer):
    """Contract: omitted prompt_cache_options gives one candidate at the end of the latest cacheable part."""
    prompt = qwen.build_prompt(ir.Conversation(CONVERSATION))
    [candidate] = prompt.cache_candidates
    assert prompt.token_ids[candidate] == IM_END
    assert ends_before(prompt, candidate, qwen_tokenizer).endswith("<|im_start|>user\nQ2")


def test_growing_message_body_keeps_the_implicit_candidate_as_prefix(qwen):
    """Contract: the automatic candidate allows reuse when the same message body grows."""
    short = qwen.build_prompt(ir.Conversation([msg("user", text("Summarize this.\n\nFirst paragraph."))]))
    longer = qwen.build_prompt(ir.Conversation([msg("user", text("Summarize this.\n\nFirst paragraph.\n\nMore."))]))
    [cut] = short.cache_candidates
    assert longer.token_ids[:cut] == short.token_ids[:cut]


def test_explicit_mode_disables_the_implicit_candidate(qwen):
    """Contract: mode:"explicit" disables that implicit write for the request."""
    conv = ir.Conversation(CONVERSATION, options=ir.PromptOptions(implicit_cache=False))
    assert qwen.build_prompt(conv).cache_candidates == []


def test_explicit_markers_keep_their_location(qwen, qwen_tokenizer):
    """Contract: an explicit marker keeps its requested location, here after the system text."""
    conv = ir.Conversation([msg("system", text("Long shared instructions.", cache=ir.CacheMark())),
                            msg("user", text("Q"))])
    prompt = qwen.build_prompt(conv)
    assert len(prompt.cache_candidates) == 2  # the explicit one and the implicit one
    assert ends_before(prompt, prompt.cache_candidates[0], qwen_tokenizer).endswith("Long shared instructions.")


def test_latest_four_explicit_markers_win_and_leave_no_implicit_slot(qwen, qwen_tokenizer):
    """Contract: at most four writes; explicit markers first, the latest four remain."""
    users = [msg("user", text(f"turn {i}.", cache=ir.CacheMark())) for i in range(6)]
    conv = ir.Conversation([m for u in users for m in (u, msg("assistant", text("ok")))][:-1])
    prompt = qwen.build_prompt(conv)
    assert len(prompt.cache_candidates) == 4
    ends = [ends_before(prompt, c, qwen_tokenizer) for c in prompt.cache_candidates]
    assert [e.rsplit("\n", 1)[-1] for e in ends] == ["turn 2.", "turn 3.", "turn 4.", "turn 5."]


def test_three_explicit_markers_leave_room_for_the_implicit_one(qwen):
    users = [msg("user", text(f"turn {i}.", cache=ir.CacheMark() if i < 3 else None)) for i in range(4)]
    conv = ir.Conversation([m for u in users for m in (u, msg("assistant", text("ok")))][:-1])
    assert len(qwen.build_prompt(conv).cache_candidates) == 4


def test_marker_inside_a_token_is_ignored_without_changing_the_prompt(qwen):
    """Contract: a legal boundary that is no exact token frontier is ignored; the prompt is unchanged."""
    marked = ir.Conversation([msg("user", text("hel", cache=ir.CacheMark()), text("lo"))],
                             options=ir.PromptOptions(implicit_cache=False))
    plain = ir.Conversation([msg("user", text("hello"))], options=ir.PromptOptions(implicit_cache=False))
    prompt = qwen.build_prompt(marked)
    assert prompt.cache_candidates == []
    assert prompt.token_ids == qwen.build_prompt(plain).token_ids


def test_markers_on_tools_media_results_and_calls(qwen, qwen_tokenizer):
    """Anthropic cache_control on a tool, an image, a tool result and a tool_use block."""
    tool = ir.ToolDef("f", description="d", parameters={"type": "object"}, cache=ir.CacheMark())
    conv = ir.Conversation([
        msg("user", ir.ImagePart("data:image/png;base64,AA", cache=ir.CacheMark()), text("what?")),
        msg("assistant", ir.ToolCallPart("c", "f", {}, cache=ir.CacheMark())),
        msg("user", ir.ToolResultPart("c", [text("done")], cache=ir.CacheMark())),
    ], tools=[tool], options=ir.PromptOptions(implicit_cache=False))
    prompt = qwen.build_prompt(conv)
    heads = [ends_before(prompt, c, qwen_tokenizer) for c in prompt.cache_candidates]
    assert len(heads) == 4
    assert heads[0].endswith('"parameters": {"type": "object"}}}')
    assert heads[1].endswith("<|vision_start|><|image_pad|><|vision_end|>")
    assert heads[2].endswith("</function>\n</tool_call><|im_end|>\n")
    assert heads[3].endswith("<tool_response>\ndone")


# ---- media -------------------------------------------------------------------------------------------


def test_media_bind_to_their_placeholders_in_order(qwen, qwen_tokenizer):
    """Contract: media placeholders come from the template and bind to the actual inputs."""
    image, video = ir.ImagePart("data:image/png;base64,AA"), ir.VideoPart("https://example.com/v.mp4")
    conv = ir.Conversation([msg("user", text("a"), video, text("b <|image_pad|> c"), image)])
    prompt = qwen.build_prompt(conv)
    assert prompt.media == [video, image]
    pads = [qwen_tokenizer.token_to_id("<|video_pad|>"), qwen_tokenizer.token_to_id("<|image_pad|>")]
    assert [prompt.token_ids[o] for o in prompt.media_token_offsets] == pads
    assert sum(prompt.token_ids.count(p) for p in pads) == 2  # the quoted spelling is text
