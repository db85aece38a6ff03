"""The conversation frontend: protocol-independent prompt building and output decoding.

Interface (implemented per template family; `frontend_for` picks one for an artifact):

  frontend = frontend_for(tokenizer, chat_template, eos_token_ids)   # + defaults=ServerPromptDefaults(...)
  prompt = frontend.build_prompt(conversation)          # ir.Prompt: token ids + cache boundaries
  decoder = frontend.output_decoder(conversation, prompt)
  deltas = decoder.feed(text, channel)                  # engine TokenEvent text/channel -> [ir.OutputDelta]
  deltas, result = decoder.finish()                     # flush + ir.DecodedOutput (reasoning, content, calls)

`chat_template` is the artifact's template text or `load_chat_template(path)` (--chat-template FILE).
Errors found while building a prompt are raised as `ninfer.chat.errors.PromptError` subclasses with
a contract error code (conflicting_template_option, invalid_prompt, ...) and the offending param;
an unusable template file raises ChatTemplateError at startup.

Modules: ir (the IR), options (kwargs rules), lowering (IR -> template messages), render (Jinja),
control_tokens (client text stays text), probes/layout (boundaries in the rendered text), prompt
(the builder), tool_schema + qwen_tool_parser + decoder (output side), chatml/qwen (the families).
"""

from ninfer.chat.errors import ChatTemplateError, PromptError
from ninfer.chat.frontend import frontend_for
from ninfer.chat.options import ServerPromptDefaults
from ninfer.chat.render import ChatTemplate, load_chat_template

__all__ = ["ChatTemplate", "ChatTemplateError", "PromptError", "ServerPromptDefaults", "frontend_for",
           "load_chat_template"]
