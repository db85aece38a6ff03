"""The generic frontend, for models whose template is not Qwen's (such as the embedded SmolLM2 default).

Messages reach the template with their own roles; reasoning and answer are split as the engine
reports them; the answer is never parsed for tool calls, since no call format is known.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ninfer.chat.decoder import OutputDecoder
from ninfer.chat.ir import Conversation, Prompt
from ninfer.chat.options import ServerPromptDefaults
from ninfer.chat.prompt import PromptBuilder
from ninfer.chat.render import ChatTemplate
from ninfer.tokenizer import Tokenizer


class ChatMLFrontend:
    developer_as_system = False  # target-specific role lowering belongs to the family frontends

    def __init__(self, tokenizer: Tokenizer, chat_template: str | ChatTemplate, eos_token_ids: Sequence[int], *,
                 special_tokens: Mapping[str, str] | None = None, defaults: ServerPromptDefaults | None = None):
        self.tokenizer = tokenizer
        self.template = chat_template if isinstance(chat_template, ChatTemplate) else ChatTemplate(chat_template)
        self.eos_token_ids = list(eos_token_ids)
        if special_tokens is None:
            # Templates may print the end-of-sequence token (transformers passes the special tokens map).
            special_tokens = {"eos_token": tokenizer.decode(self.eos_token_ids[:1])} if self.eos_token_ids else {}
        self.builder = PromptBuilder(tokenizer, self.template, special_tokens=dict(special_tokens),
                                     defaults=defaults or ServerPromptDefaults(),
                                     developer_as_system=self.developer_as_system)

    def build_prompt(self, conversation: Conversation, media: Sequence[Any] | None = None) -> Prompt:
        """Token ids and cache boundaries; raises ninfer.chat.errors.PromptError subclasses. `media` are the
        prepared items of ir.media_parts(conversation): their placeholders are expanded to pads."""
        return self.builder.build(conversation, media)

    def output_decoder(self, conversation: Conversation, prompt: Prompt) -> OutputDecoder:
        return OutputDecoder(starts_in_reasoning=prompt.thinking)
