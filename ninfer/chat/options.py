"""Template options: typed request fields, chat_template_kwargs and server defaults merged into the
variables a chat template sees (contract: "OpenAI Chat Completions", chat_template_kwargs rules).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ninfer.chat.errors import (
    ConflictingTemplateOptionError,
    InvalidTemplateOptionError,
    TemplateOptionNotAllowedError,
)
from ninfer.chat.ir import PromptOptions

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")

# Options with a meaning of their own: a null value means "unspecified", not None.
STANDARD_OPTIONS = ("enable_thinking", "preserve_thinking", "reasoning_effort", "add_vision_id")
_BOOLEAN_OPTIONS = ("enable_thinking", "preserve_thinking", "add_vision_id")

# What the server decides and kwargs may not override: the conversation, the generation mode and
# the tokenizer's special tokens.
_SERVER_OWNED = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token",
    "additional_special_tokens",
})


@dataclass(frozen=True)
class ServerPromptDefaults:
    """Process flags: --no-thinking gives enable_thinking=False, --preserve-thinking preserve_thinking=True."""

    enable_thinking: bool | None = None
    preserve_thinking: bool | None = None


def template_variables(options: PromptOptions, defaults: ServerPromptDefaults,
                       special_tokens: dict[str, Any]) -> dict[str, Any]:
    """The template's option variables; a standard option left unspecified is absent (template default)."""
    kwargs = dict(options.template_kwargs)
    for key in kwargs:
        if key in _SERVER_OWNED or key in special_tokens:
            raise TemplateOptionNotAllowedError(f"chat_template_kwargs cannot set {key!r}: the server decides it",
                                                param=f"chat_template_kwargs.{key}")
    for key in STANDARD_OPTIONS:
        if key in kwargs and kwargs[key] is None:
            del kwargs[key]
    _check_types(kwargs)  # before merging, so a typed value cannot mask a malformed kwarg
    typed = {"enable_thinking": options.enable_thinking, "preserve_thinking": options.preserve_thinking,
             "reasoning_effort": options.reasoning_effort}
    for key, value in typed.items():
        if value is None:
            continue
        if key in kwargs and kwargs[key] != value:
            raise ConflictingTemplateOptionError(
                f"{options.option_params.get(key, key)}={value!r} disagrees with chat_template_kwargs.{key}="
                f"{kwargs[key]!r}", param=options.option_params.get(key, key))
        kwargs[key] = value
    _check_types(kwargs)
    effort = kwargs.get("reasoning_effort")
    if effort is not None:
        wants_thinking = effort != "none"
        if kwargs.get("enable_thinking", wants_thinking) != wants_thinking:
            param = options.option_params.get("reasoning_effort", "reasoning_effort")
            raise ConflictingTemplateOptionError(
                f"{param}={effort!r} conflicts with enable_thinking={kwargs['enable_thinking']}", param=param)
        if not wants_thinking:
            kwargs["enable_thinking"] = False
    # Request options override server defaults; an explicit effort other than none asks for thinking.
    if "enable_thinking" not in kwargs and defaults.enable_thinking is not None and effort is None:
        kwargs["enable_thinking"] = defaults.enable_thinking
    if "preserve_thinking" not in kwargs and defaults.preserve_thinking is not None:
        kwargs["preserve_thinking"] = defaults.preserve_thinking
    return kwargs


def _check_types(kwargs: dict[str, Any]) -> None:
    for key in _BOOLEAN_OPTIONS:
        if key in kwargs and not isinstance(kwargs[key], bool):
            raise InvalidTemplateOptionError(f"{key} must be a boolean or null", param=f"chat_template_kwargs.{key}")
    effort = kwargs.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise InvalidTemplateOptionError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}",
                                         param="reasoning_effort")
