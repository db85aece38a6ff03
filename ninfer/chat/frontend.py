"""Choosing the frontend for an artifact's tokenizer and chat template."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ninfer.chat.chatml import ChatMLFrontend
from ninfer.chat.options import ServerPromptDefaults
from ninfer.chat.qwen import QwenFrontend
from ninfer.chat.render import ChatTemplate
from ninfer.tokenizer import Tokenizer


def frontend_for(tokenizer: Tokenizer, chat_template: str | ChatTemplate, eos_token_ids: Sequence[int], *,
                 special_tokens: Mapping[str, str] | None = None,
                 defaults: ServerPromptDefaults | None = None) -> ChatMLFrontend:
    """The Qwen frontend when the template writes Qwen's tool-call format, else the generic one.

    `chat_template` is the artifact's template text, or a ChatTemplate from load_chat_template for
    `--chat-template FILE`; `defaults` carries --no-thinking / --preserve-thinking.
    """
    template = chat_template if isinstance(chat_template, ChatTemplate) else ChatTemplate(chat_template)
    family = QwenFrontend if QwenFrontend.recognizes(tokenizer, template) else ChatMLFrontend
    return family(tokenizer, template, eos_token_ids, special_tokens=special_tokens, defaults=defaults)
