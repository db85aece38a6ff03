"""The Qwen3.5/3.6/3.8 frontend: developer turns read as system turns, and answers are parsed for
Qwen's XML tool calls against the request's effective tool set.
"""

from __future__ import annotations

from collections.abc import Callable

from ninfer.chat.chatml import ChatMLFrontend
from ninfer.chat.decoder import OutputDecoder, QwenToolCalls, new_call_id
from ninfer.chat.ir import Conversation, Prompt
from ninfer.chat.render import ChatTemplate
from ninfer.tokenizer import Tokenizer


class QwenFrontend(ChatMLFrontend):
    developer_as_system = True  # Qwen templates know no developer role

    def output_decoder(self, conversation: Conversation, prompt: Prompt,
                       new_id: Callable[[], str] = new_call_id) -> OutputDecoder:
        tools = conversation.effective_tools()  # tool_choice none / allowed_tools restrict which become calls
        calls = QwenToolCalls(tools, new_id) if tools else None
        return OutputDecoder(starts_in_reasoning=prompt.thinking, tool_calls=calls)

    @staticmethod
    def recognizes(tokenizer: Tokenizer, template: ChatTemplate) -> bool:
        """A ChatML tokenizer with Qwen's call markers and a template that writes the XML call format."""
        tokens = tokenizer.added_tokens
        return ("<|im_start|>" in tokens and "<tool_call>" in tokens
                and template.mentions("<tool_call>") and template.mentions("<function="))
