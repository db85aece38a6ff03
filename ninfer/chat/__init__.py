"""The conversation frontend: protocol-independent prompt building and output decoding.

Interface (implemented per template family; `frontend_for` picks one for an artifact):

  frontend = frontend_for(tokenizer, chat_template, eos_token_ids)
  prompt = frontend.build_prompt(conversation)          # ir.Prompt: token ids + cache boundaries
  decoder = frontend.output_decoder(conversation, prompt)
  deltas = decoder.feed(text, channel)                  # engine TokenEvent text/channel -> [ir.OutputDelta]
  deltas, result = decoder.finish()                     # flush + ir.DecodedOutput (reasoning, content, calls)

Errors found while building a prompt are raised as `ninfer.chat.errors.PromptError` subclasses with
a contract error code (conflicting_template_option, invalid_prompt, ...) and the offending param.
"""
