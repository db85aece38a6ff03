"""Typed errors of the conversation frontend.

Each carries the contract's error code and the request parameter it concerns; the protocol layer
renders them once at the HTTP edge (ninfer.protocol.errors.from_prompt_error).
"""

from __future__ import annotations


class PromptError(Exception):
    """A conversation that cannot become a prompt: the client must change the request."""

    code = "invalid_prompt"
    status = 400

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class InvalidPromptError(PromptError):
    """The normalized conversation breaks the prompt contract (unrepresentable history, media mismatch...)."""


class TemplateRenderError(PromptError):
    """The chat template refused the conversation (raise_exception) or failed while rendering it."""


class ConflictingTemplateOptionError(PromptError):
    """Two explicit values of one template option disagree (typed field vs kwargs, effort vs thinking)."""

    code = "conflicting_template_option"


class InvalidTemplateOptionError(PromptError):
    """A template option has a value of the wrong type or outside its vocabulary."""

    code = "invalid_value"


class TemplateOptionNotAllowedError(PromptError):
    """chat_template_kwargs tried to set what the server owns: messages, tools, generation mode, special tokens."""

    code = "chat_template_option_not_supported"


class ChatTemplateError(ValueError):
    """A chat template that cannot be used at all (startup configuration, not a client error)."""
