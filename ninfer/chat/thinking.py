"""The reasoning channel's control for the engine: which ids open and close it, and the guidance text
committed (without sampling) when a thinking budget runs out, before `</think>`.

The chat frontend owns these: they are the Qwen template's spellings, not the engine's. The engine
only receives the ThinkingControl built here.
"""

from __future__ import annotations

from ninfer.engine.types import ThinkingControl

THINKING_GUIDANCE = (
    "\n\nConsidering the limited time by the user, I have to give the solution based on the thinking directly now.\n"
)


def thinking_control(tokenizer) -> ThinkingControl:
    """The control for a tokenizer with `<think>`/`</think>`; one that closes nothing without them."""
    end_id = tokenizer.token_to_id("</think>")
    if end_id is None:
        return ThinkingControl(think_end_id=None)
    suffix = tokenizer.encode(THINKING_GUIDANCE) + [end_id]
    return ThinkingControl(think_end_id=end_id, think_start_id=tokenizer.token_to_id("<think>"), close_suffix=suffix)


def close_suffix_length(tokenizer) -> int:
    """Tokens the budget's closing suffix takes (guidance + `</think>`)."""
    return len(thinking_control(tokenizer).close_suffix)
