"""OpenAI Responses: the create and input_tokens request contracts, lowered for the prompt path.

Every top-level field is known: an unknown one fails with unknown_parameter, and a recognized
feature this server cannot honour fails naming its field. What remains becomes a `ResponsesPrompt`
(shared with input_tokens, so both count the same prompt) plus the generation settings and the
request values a Response object echoes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal, Union

from pydantic import Field

from ninfer.chat import ir
from ninfer.engine.types import SamplingParams
from ninfer.protocol.errors import invalid, unsupported
from ninfer.protocol.openai_chat import EFFORTS, ChatDefaults, PromptCacheOptions
from ninfer.protocol.responses_history import conversation_messages, has_user_query
from ninfer.protocol.responses_items import Item, ItemRules, parse_items
from ninfer.protocol.responses_tools import ToolConfig, parse_tools
from ninfer.protocol.responses_wire import WireModel, validated

ENCRYPTED_REASONING = "reasoning.encrypted_content"
SUMMARIES = ("auto", "concise", "detailed", "none")

_PROMPT_FIELDS = frozenset({
    "model", "input", "instructions", "previous_response_id", "reasoning", "chat_template_kwargs",
    "preserve_thinking", "text", "tools", "tool_choice", "parallel_tool_calls", "truncation", "conversation",
})
CREATE_FIELDS = _PROMPT_FIELDS | {
    "max_output_tokens", "stream", "stream_options", "store", "temperature", "top_p", "metadata", "client_metadata",
    "max_tool_calls", "top_logprobs", "service_tier", "background", "include", "prompt_cache_key",
    "prompt_cache_options", "prompt_cache_retention", "safety_identifier", "user", "prompt", "context_management",
    "moderation",
}
COUNT_FIELDS = _PROMPT_FIELDS | {"personality"}

# Recognized platform features that need a service this server does not run.
_PLATFORM = {
    "conversation": ("conversations_not_supported", "Conversations objects are not stored here; chain Responses "
                                                    "with previous_response_id"),
    "prompt": ("prompt_templates_not_supported", "stored prompt templates are not available"),
    "context_management": ("context_management_not_supported", "server-side compaction is not available"),
    "moderation": ("moderation_not_supported", "moderation is not available"),
    "personality": ("personality_not_supported", "personalities are not available"),
}


class ReasoningOptions(WireModel):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None  # the older spelling of summary


class TextFormat(WireModel):
    type: str


class TextOptions(WireModel):
    format: TextFormat | None = None
    verbosity: str | None = None


class StreamOptions(WireModel):
    include_obfuscation: bool | None = None  # a transport hint: no padding is emitted


class PromptBody(WireModel):
    """The fields that shape the prompt: create and input_tokens share them."""

    model: str = Field(min_length=1)
    input: Union[str, list[Any], None] = None
    instructions: str | None = None
    previous_response_id: str | None = Field(None, min_length=1)
    reasoning: ReasoningOptions | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    preserve_thinking: bool | None = None
    text: TextOptions | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    truncation: str | None = None


class CreateBody(PromptBody):
    max_output_tokens: int | None = Field(None, ge=0)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    store: bool | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    metadata: dict[str, str] | None = None
    client_metadata: dict[str, Any] | None = None  # Codex tracing data: opaque, no generation effect
    max_tool_calls: int | None = Field(None, ge=0)  # a hosted-tool limit: no hosted tools run here
    top_logprobs: int | None = Field(None, ge=0, le=20)
    service_tier: str | None = None
    background: bool | None = None
    include: list[str] | None = None
    prompt_cache_key: str | None = Field(None, max_length=64)
    prompt_cache_options: PromptCacheOptions | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: str | None = Field(None, max_length=64)
    user: str | None = None


@dataclass
class ResponsesPrompt:
    """Everything the prompt is built from, before the stored parent's history is known."""

    model: str
    items: list[Item]
    instructions: str | None
    previous_response_id: str | None
    tools: ToolConfig
    options: ir.PromptOptions
    parallel_tool_calls: bool = True

    def conversation(self, history: list[Item], inherited_preserve_thinking: bool | None) -> ir.Conversation:
        """The conversation of the stored `history` continued by this request's input.

        The instructions lead for this request only (they are not part of the saved history), and a
        child that does not choose preserve_thinking keeps its parent's value.
        """
        stored = {item.id for item in history}
        for item in self.items:
            if item.id in stored:
                raise invalid(f"{item.where}.id: the Item id {item.id!r} is already in the previous response's "
                              "history", f"{item.where}.id", "duplicate_item_id")
        messages = conversation_messages([*history, *self.items])
        if not has_user_query(messages):
            raise invalid("input needs a user message when no previous response supplies one", "input")
        if self.instructions:
            messages.insert(0, ir.Message("developer", [ir.TextPart(self.instructions)]))
        options = self.options
        if inherited_preserve_thinking is not None and not self.chooses_preserve_thinking:
            options = replace(options, preserve_thinking=inherited_preserve_thinking)
        return ir.Conversation(messages, tools=self.tools.tools, tool_choice=self.tools.choice,
                               allowed_tools=self.tools.allowed, options=options)

    @property
    def chooses_preserve_thinking(self) -> bool:
        return (self.options.preserve_thinking is not None
                or self.options.template_kwargs.get("preserve_thinking") is not None)


@dataclass
class ResponsesCreate:
    prompt: ResponsesPrompt
    sampling: SamplingParams
    max_output_tokens: int | None  # None: the server's --default-max-tokens
    stream: bool
    store: bool
    single_call: bool  # parallel_tool_calls:false with a callable tool: stop after the first call
    seal_reasoning: bool  # include: ["reasoning.encrypted_content"]
    echo: dict[str, Any] = field(default_factory=dict)  # request values every Response object repeats


def parse_create_request(body: Any, defaults: ChatDefaults) -> ResponsesCreate:
    """Validate a decoded JSON body; raises ProtocolError naming the first offending field."""
    _check_shape(body, CREATE_FIELDS)
    req: CreateBody = validated(CreateBody, body, body, ())
    prompt = _prompt(req, body, defaults)
    _check_output_controls(req)
    include = req.include or []
    for i, value in enumerate(include):
        if value != ENCRYPTED_REASONING:
            raise unsupported(f"include[{i}]", "include_not_supported",
                              f"{value!r} is not available; only {ENCRYPTED_REASONING!r} can be included")
    _check_metadata(req.metadata)
    if req.prompt_cache_options and req.prompt_cache_options.ttl not in (None, "30m"):
        raise invalid("prompt_cache_options.ttl must be '30m'", "prompt_cache_options.ttl")
    store = req.store is not False
    return ResponsesCreate(
        prompt=prompt, sampling=SamplingParams(temperature=req.temperature, top_p=req.top_p),
        max_output_tokens=req.max_output_tokens, stream=bool(req.stream), store=store,
        single_call=not prompt.parallel_tool_calls and prompt.tools.callable(),
        seal_reasoning=ENCRYPTED_REASONING in include, echo=_echo(req, prompt, store))


def parse_input_tokens_request(body: Any, defaults: ChatDefaults) -> ResponsesPrompt:
    _check_shape(body, COUNT_FIELDS)
    return _prompt(validated(PromptBody, body, body, ()), body, defaults)


def _check_shape(body: Any, known: frozenset[str]) -> None:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_type")
    for key in body:
        if key not in known:
            raise invalid(f"unknown parameter {key!r}", key, "unknown_parameter")
    for key, (code, why) in _PLATFORM.items():
        if key in known and body.get(key) is not None:
            raise unsupported(key, code, why)


def _prompt(req: PromptBody, body: dict, defaults: ChatDefaults) -> ResponsesPrompt:
    if not req.input:  # omitted or empty: the stored parent must supply the user query
        if req.previous_response_id is None:
            raise invalid("missing required parameter input", "input", "missing_required_parameter")
    text_input = isinstance(req.input, str) and req.input != ""
    values = [{"role": "user", "content": req.input}] if text_input else list(req.input or [])
    items = parse_items(values, {"input": values} if text_input else body, ItemRules(defaults.vision))
    _check_text(req.text)
    if req.truncation not in (None, "disabled"):
        if req.truncation == "auto":
            raise unsupported("truncation", "truncation_not_supported",
                              "'auto' would silently drop input Items; overlong input fails instead")
        raise invalid(f"truncation: {req.truncation!r} is not one of auto, disabled", "truncation")
    reasoning = req.reasoning or ReasoningOptions()
    for key in ("summary", "generate_summary"):
        value = getattr(reasoning, key)
        if value is not None and value not in SUMMARIES:  # accepted; the summary itself stays empty
            raise invalid(f"reasoning.{key} must be one of {', '.join(SUMMARIES)}", f"reasoning.{key}")
    if reasoning.effort is not None and reasoning.effort not in EFFORTS:
        raise invalid(f"reasoning.effort must be one of {', '.join(EFFORTS)}", "reasoning.effort")
    implicit = not (isinstance(req, CreateBody) and req.prompt_cache_options
                    and req.prompt_cache_options.mode == "explicit")
    options = ir.PromptOptions(preserve_thinking=req.preserve_thinking, reasoning_effort=reasoning.effort,
                               template_kwargs=dict(req.chat_template_kwargs or {}), implicit_cache=implicit,
                               option_params={"reasoning_effort": "reasoning.effort"})
    return ResponsesPrompt(model=req.model, items=items, instructions=req.instructions,
                           previous_response_id=req.previous_response_id,
                           tools=parse_tools(req.tools, req.tool_choice, body), options=options,
                           parallel_tool_calls=req.parallel_tool_calls is not False)


def _check_text(text: TextOptions | None) -> None:
    if text is None:
        return
    if text.format is not None and text.format.type != "text":
        raise unsupported("text.format", "structured_outputs_not_supported",
                          f"format {text.format.type!r} needs constrained decoding; only 'text' is available")
    if text.verbosity in ("low", "high"):
        raise unsupported("text.verbosity", "verbosity_not_supported",
                          f"{text.verbosity!r} asks for an output-length style that cannot be guaranteed; "
                          "'medium' is accepted")
    if text.verbosity not in (None, "medium"):
        raise invalid("text.verbosity must be one of low, medium, high", "text.verbosity")


def _check_output_controls(req: CreateBody) -> None:
    if req.background:
        raise unsupported("background", "background_not_supported", "background execution is not available")
    if req.top_logprobs:
        raise unsupported("top_logprobs", "logprobs_not_supported", "alternative-token probabilities are not reported")
    if req.service_tier not in (None, "auto", "default"):
        raise unsupported("service_tier", "service_tier_not_supported",
                          f"tier {req.service_tier!r} is not provided by this local server; use 'auto' or 'default'")


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > 16:
        raise invalid("metadata holds at most 16 pairs", "metadata")
    for key, value in metadata.items():
        if len(key) > 64:
            raise invalid("metadata keys are at most 64 characters", "metadata")
        if len(value) > 512:
            raise invalid(f"metadata.{key}: values are at most 512 characters", f"metadata.{key}")


def _echo(req: CreateBody, prompt: ResponsesPrompt, store: bool) -> dict[str, Any]:
    """The request values a Response object repeats (contract: Response object)."""
    reasoning = req.reasoning or ReasoningOptions()
    text = {"format": {"type": "text"}, "verbosity": (req.text and req.text.verbosity) or "medium"}
    return {
        "background": False, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls, "metadata": dict(req.metadata or {}), "model": req.model,
        "parallel_tool_calls": prompt.parallel_tool_calls, "previous_response_id": req.previous_response_id,
        "prompt_cache_key": req.prompt_cache_key, "prompt_cache_retention": req.prompt_cache_retention,
        "reasoning": {"effort": reasoning.effort, "summary": reasoning.summary or reasoning.generate_summary},
        "safety_identifier": req.safety_identifier, "service_tier": "default", "store": store,
        "temperature": req.temperature, "text": text, "tool_choice": prompt.tools.wire_choice,
        "tools": prompt.tools.wire_tools, "top_logprobs": 0, "top_p": req.top_p, "truncation": "disabled",
        "user": req.user,
    }
