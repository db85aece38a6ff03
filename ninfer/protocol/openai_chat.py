"""OpenAI Chat Completions: the request model, capability checks, and lowering to the conversation IR.

The pydantic models are the schema contract (types, ranges, required fields); `lower` then applies
the semantic rules: capabilities the engine cannot honour are refused with a field-specific code,
neutral values pass, unknown top-level fields are ignored, and everything else becomes one
`ChatRequest` holding a protocol-free `Conversation` plus engine generation parameters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ninfer.chat import ir
from ninfer.engine.types import SamplingParams
from ninfer.protocol.errors import ProtocolError, from_validation_error, invalid, unsupported

TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_CONSTRAINED = ("grammar", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, protected_namespaces=())


# ---- content parts ---------------------------------------------------------------------------


class TextContent(_Model):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: Any = None


class RefusalContent(_Model):
    type: Literal["refusal"]
    refusal: str


class ImageURL(_Model):
    url: str
    detail: str | None = None


class ImageContent(_Model):
    type: Literal["image_url"]
    image_url: Union[str, ImageURL]  # the string form is a vLLM/SGLang shorthand
    prompt_cache_breakpoint: Any = None


class VideoURL(_Model):
    url: str


class VideoContent(_Model):
    type: Literal["video_url"]
    video_url: Union[str, VideoURL]
    prompt_cache_breakpoint: Any = None


class AudioContent(_Model):
    type: Literal["input_audio"]


class FileContent(_Model):
    type: Literal["file"]


ContentPart = Annotated[
    Union[TextContent, RefusalContent, ImageContent, VideoContent, AudioContent, FileContent],
    Field(discriminator="type"),
]
Content = Union[str, list[ContentPart]]


# ---- messages --------------------------------------------------------------------------------


class FunctionCall(_Model):
    name: str = Field(pattern=TOOL_NAME)
    arguments: str


class ToolCall(_Model):
    id: str
    type: str
    function: FunctionCall


class _NotAssistant(_Model):
    """Roles that cannot carry assistant-only history; a non-empty value would change the prompt."""

    @model_validator(mode="before")
    @classmethod
    def _assistant_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in ("tool_calls", "reasoning_content", "reasoning", "function_call"):
                if data.get(key) not in (None, "", []):
                    raise ValueError(f"{key} is only valid on assistant messages")
        return data


class SystemMessage(_NotAssistant):
    role: Literal["system"]
    content: Content
    name: str | None = None


class DeveloperMessage(_NotAssistant):
    role: Literal["developer"]
    content: Content
    name: str | None = None


class UserMessage(_NotAssistant):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(_Model):
    role: Literal["assistant"]
    content: Content | None = None
    refusal: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # the newer vLLM spelling of reasoning_content
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None
    audio: Any = None
    name: str | None = None


class ToolMessage(_NotAssistant):
    role: Literal["tool"]
    content: Content
    tool_call_id: str
    name: str | None = None  # clients mirror the function name here; ignored


class FunctionMessage(_NotAssistant):
    role: Literal["function"]
    name: str = Field(pattern=TOOL_NAME)
    content: str | None = None


Message = Annotated[
    Union[SystemMessage, DeveloperMessage, UserMessage, AssistantMessage, ToolMessage, FunctionMessage],
    Field(discriminator="role"),
]


# ---- tools and options -----------------------------------------------------------------------


class FunctionDef(_Model):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: str
    function: FunctionDef | None = None


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class AllowedTools(_Model):
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]


class AllowedToolsChoice(_Model):
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class CustomToolChoice(_Model):
    type: Literal["custom"]


ToolChoiceObject = Annotated[Union[NamedToolChoice, AllowedToolsChoice, CustomToolChoice],
                             Field(discriminator="type")]


class StreamOptions(_Model):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class ResponseFormat(_Model):
    type: str


class PromptCacheOptions(_Model):
    mode: Literal["implicit", "explicit"] | None = None
    ttl: str | None = None


class ChatCompletionRequest(_Model):
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=20)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # contract: a signed (64-bit) integer
    n: int | None = None
    stop: Union[str, list[str], None] = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["auto", "none", "required"], ToolChoiceObject, None] = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Union[Literal["none", "auto"], dict[str, Any], None] = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    modalities: list[str] | None = Field(None, min_length=1)
    audio: dict[str, Any] | None = None
    prediction: Any = None
    web_search_options: Any = None
    moderation: Any = None
    verbosity: Literal["low", "medium", "high"] | None = None
    store: bool | None = None
    reasoning_effort: str | None = None
    enable_thinking: bool | None = None
    preserve_thinking: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    timings_per_token: bool | None = None
    return_progress: bool | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    grammar: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    prompt_cache_key: str | None = Field(None, max_length=64)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    safety_identifier: str | None = Field(None, max_length=64)
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None


# ---- the lowered request ---------------------------------------------------------------------


@dataclass
class ChatDefaults:
    """Server settings that shape request lowering (startup flags)."""

    vision: bool = False


@dataclass
class ChatRequest:
    model: str
    conversation: ir.Conversation
    sampling: SamplingParams
    max_tokens: int | None  # None: the server's --default-max-tokens
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    timings_per_token: bool = False
    return_progress: bool = False


def parse_chat_request(body: Any, defaults: ChatDefaults) -> ChatRequest:
    """Validate a decoded JSON body; raises ProtocolError naming the first offending field."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_type")
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc.errors(), body, {"role": "unsupported_role"}) from None
    return lower(req, defaults)


def lower(req: ChatCompletionRequest, defaults: ChatDefaults) -> ChatRequest:
    _check_output_controls(req)
    _check_compatibility_hints(req)
    tools = _tools(req)
    tool_choice, allowed = _tool_choice(req, tools)
    conversation = ir.Conversation(messages=_messages(req, defaults), tools=tools, tool_choice=tool_choice,
                                   allowed_tools=allowed, options=_prompt_options(req))
    if req.parallel_tool_calls is False and conversation.effective_tools():
        raise unsupported("parallel_tool_calls", "parallel_tool_calls_not_supported",
                          "false asks for at most one call, which cannot be guaranteed while tools are enabled")
    if req.n is not None and req.n != 1:
        raise unsupported("n", "n_not_supported", "only n=1 is available: one completion per request")
    stream = bool(req.stream)
    options = req.stream_options
    sampling = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                              presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                              seed=req.seed)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return ChatRequest(model=req.model, conversation=conversation, sampling=sampling, max_tokens=max_tokens,
                       stop=_stop(req.stop), stream=stream,
                       include_usage=bool(stream and options and options.include_usage),
                       timings_per_token=bool(req.timings_per_token), return_progress=bool(req.return_progress))


# ---- capability checks -----------------------------------------------------------------------


def _check_output_controls(req: ChatCompletionRequest) -> None:
    if req.functions:
        raise unsupported("functions", "legacy_tools_not_supported",
                          "non-empty legacy functions need the single-function-call contract; use tools instead")
    if isinstance(req.function_call, dict):
        raise unsupported("function_call", "legacy_tools_not_supported",
                          "a named legacy function_call forces a call, which cannot be guaranteed")
    for key, bias in (req.logit_bias or {}).items():  # malformed before unsupported: a bad map is the client's
        if not (key.isascii() and key.isdigit()):
            raise invalid(f"logit_bias keys are token ids; got {key!r}", "logit_bias", "invalid_value")
        if not -100 <= bias <= 100:
            raise invalid(f"logit_bias values lie in [-100, 100]; got {bias} for token {key}", "logit_bias",
                          "invalid_value")
    if req.logit_bias and any(v != 0 for v in req.logit_bias.values()):
        raise unsupported("logit_bias", "logit_bias_not_supported", "nonzero biases need per-token logit edits")
    if req.logprobs:
        raise unsupported("logprobs", "logprobs_not_supported", "per-token log probabilities are not reported")
    if req.top_logprobs:
        raise unsupported("top_logprobs", "logprobs_not_supported", "alternative-token probabilities are not reported")
    if req.response_format is not None and req.response_format.type != "text":
        raise unsupported("response_format", "response_format_not_supported",
                          f"type {req.response_format.type!r} needs constrained output; only 'text' is available")
    if req.modalities and any(m != "text" for m in req.modalities):
        raise unsupported("modalities", "modality_not_supported", "only text output is produced")
    if req.web_search_options is not None:
        raise unsupported("web_search_options", "web_search_not_supported", "hosted web search is not available")
    if req.moderation is not None:
        raise unsupported("moderation", "moderation_not_supported", "moderation is not available")
    if req.verbosity in ("low", "high"):
        raise unsupported("verbosity", "verbosity_not_supported",
                          f"{req.verbosity!r} asks for an output-length style that cannot be guaranteed; "
                          "'medium' is accepted")
    if req.store:
        raise unsupported("store", "store_not_supported", "Chat Completions are not stored; use /v1/responses")
    for name in _CONSTRAINED:
        value = getattr(req, name)
        if value is not None and not (name == "grammar" and value == ""):
            raise unsupported(name, "constrained_decoding_not_supported", "constrained decoding is not available")


def _check_compatibility_hints(req: ChatCompletionRequest) -> None:
    if req.repetition_penalty is not None and req.repetition_penalty != 1:
        raise unsupported("repetition_penalty", "repetition_penalty_not_supported",
                          "the sampler has no repetition penalty; only the neutral value 1 is accepted")
    if req.mm_processor_kwargs and any(v is not None for v in req.mm_processor_kwargs.values()):
        raise unsupported("mm_processor_kwargs", "mm_processor_kwargs_not_supported",
                          "media preprocessing overrides cannot be applied")
    if req.prompt_cache_options and req.prompt_cache_options.ttl not in (None, "30m"):
        raise invalid("prompt_cache_options.ttl must be '30m'", "prompt_cache_options.ttl")


def _stop(stop: str | list[str] | None) -> list[str]:
    values = [stop] if isinstance(stop, str) else list(stop or [])
    if len(values) > 4:
        raise invalid("stop takes at most 4 strings", "stop")
    for i, s in enumerate(values):
        if not s:
            raise invalid("stop strings must not be empty", "stop" if isinstance(stop, str) else f"stop[{i}]")
    return values


# ---- tools -----------------------------------------------------------------------------------


def _tools(req: ChatCompletionRequest) -> list[ir.ToolDef]:
    out: list[ir.ToolDef] = []
    for i, tool in enumerate(req.tools or []):
        if tool.type != "function":
            raise unsupported(f"tools[{i}].type", "tool_type_not_supported",
                              f"tool type {tool.type!r} needs an executor or output contract other than a function call")
        if tool.function is None:
            raise invalid("function tools need a function object", f"tools[{i}].function",
                          "missing_required_parameter")
        fn = tool.function
        if fn.strict:
            raise unsupported(f"tools[{i}].function.strict", "strict_tools_not_supported",
                              "strict:true needs arguments that satisfy the schema, which needs constrained decoding")
        out.append(ir.ToolDef(name=fn.name, description=fn.description, parameters=fn.parameters))
    return out


def _tool_choice(req: ChatCompletionRequest, tools: list[ir.ToolDef]):
    choice = req.tool_choice
    if choice is None or choice == "auto":
        return "auto", None
    if choice == "none":
        return "none", None
    if choice == "required" or isinstance(choice, NamedToolChoice):
        raise unsupported("tool_choice", "tool_choice_not_supported",
                          "forcing a tool call cannot be guaranteed; use 'auto', 'none' or allowed_tools in auto mode")
    if isinstance(choice, CustomToolChoice):
        raise unsupported("tool_choice", "tool_type_not_supported", "custom tools are not available")
    if choice.allowed_tools.mode == "required":
        raise unsupported("tool_choice.allowed_tools.mode", "tool_choice_not_supported",
                          "'required' forces a tool call, which cannot be guaranteed; use 'auto'")
    declared = {t.name for t in tools}
    allowed: list[tuple[str | None, str]] = []
    for i, entry in enumerate(choice.allowed_tools.tools):
        param = f"tool_choice.allowed_tools.tools[{i}]"
        if entry.get("type") != "function":
            raise unsupported(param, "tool_type_not_supported", "only function tools can be allowed")
        fn = entry.get("function")
        name = fn.get("name") if isinstance(fn, dict) else entry.get("name")
        if not isinstance(name, str):
            raise invalid(f"{param} must name a function", param, "invalid_type")
        if name not in declared:
            raise invalid(f"allowed tool {name!r} is not declared in tools", param)
        allowed.append((None, name))
    return "auto", allowed


# ---- messages --------------------------------------------------------------------------------


def _messages(req: ChatCompletionRequest, defaults: ChatDefaults) -> list[ir.Message]:
    out: list[ir.Message] = []
    legacy_calls: list[tuple[str, str]] = []  # (synthesized id, name) of unanswered legacy function calls
    results = _ToolResults()
    for i, msg in enumerate(req.messages):
        param = f"messages[{i}]"
        if msg.role not in ("tool", "function") and msg.name:
            raise unsupported(f"{param}.name", "message_name_not_supported",
                              "a participant name cannot be represented by the chat template")
        if isinstance(msg, ToolMessage):
            parts = _parts(msg.content, "tool", f"{param}.content", defaults)
            results.add(ir.ToolResultPart(call_id=msg.tool_call_id, content=parts), f"{param}.tool_call_id")
            continue
        if isinstance(msg, FunctionMessage):
            call_id = _answer_legacy_call(legacy_calls, msg.name, f"{param}.name")
            results.add(ir.ToolResultPart(call_id=call_id, content=[ir.TextPart(msg.content or "")]), f"{param}.name")
            continue
        out += results.flush()
        results.leading = results.leading and msg.role in ("system", "developer")
        if isinstance(msg, AssistantMessage):
            out.append(_assistant(msg, param, defaults, legacy_calls, i))
            results.expect(out[-1], param)
        else:
            out.append(ir.Message(msg.role, _parts(msg.content, msg.role, f"{param}.content", defaults)))
    return out + results.flush()


class _ToolResults:
    """The tool messages after an assistant message, matched to its calls by id and put in call order: the Qwen
    prompt shows results without ids, and the model pairs them with calls by position. As for Responses' Items
    (contract: the Input Item contract), unknown and duplicate results fail, and so does a partial set that
    leaves a call unanswered before an answered one (no order of the results could show it). Results before any
    user or assistant message stand as they are: a truncated or imported history (as the contract keeps one for
    Anthropic Messages)."""

    def __init__(self):
        self.calls: dict[str, int] | None = None  # call id -> position, of the assistant message results follow
        self.where = ""
        self.results: list[tuple[int, ir.ToolResultPart]] = []
        self.leading = True  # only system / developer messages so far

    def expect(self, assistant: ir.Message, param: str) -> None:
        ids = [p.call_id for p in assistant.parts if isinstance(p, ir.ToolCallPart)]
        for k, call_id in enumerate(ids):
            if call_id in ids[:k]:
                raise invalid(f"tool call id {call_id!r} is used twice in one assistant message",
                              f"{param}.tool_calls", "invalid_tool_history")
        self.calls, self.where = {call_id: k for k, call_id in enumerate(ids)}, param

    def add(self, result: ir.ToolResultPart, param: str) -> None:
        if self.leading:
            self.results.append((len(self.results), result))
            return
        if not self.calls:
            raise invalid("a tool result must follow the assistant message whose tool call it answers", param,
                          "invalid_tool_history")
        k = self.calls.get(result.call_id)
        if k is None:
            raise invalid(f"tool_call_id {result.call_id!r} is not one of the tool calls of the assistant message "
                          f"it follows ({self.where})", param, "invalid_tool_history")
        if any(k == seen for seen, _ in self.results):
            raise invalid(f"tool_call_id {result.call_id!r} already has a result", param, "invalid_tool_history")
        self.results.append((k, result))

    def flush(self) -> list[ir.Message]:
        """The results gathered since the last assistant message, one tool message each, in call order."""
        ordered = sorted(self.results)
        if ordered and self.calls is not None and ordered[-1][0] >= len(ordered):
            missing = next(call_id for call_id, k in self.calls.items() if k not in dict(ordered))
            raise invalid(f"tool call {missing!r} has no result while a later call of that message does; answer "
                          "the calls in order", self.where, "invalid_tool_history")
        self.calls, self.results = None, []
        return [ir.Message("tool", [result]) for _, result in ordered]


def _assistant(msg: AssistantMessage, param: str, defaults: ChatDefaults,
               legacy_calls: list[tuple[str, str]], index: int) -> ir.Message:
    if msg.audio is not None:
        raise unsupported(f"{param}.audio", "assistant_history_not_supported",
                          "assistant audio history refers to an earlier audio response that cannot be resolved")
    reasoning = msg.reasoning_content or None
    if msg.reasoning and reasoning and msg.reasoning != reasoning:
        raise unsupported(f"{param}.reasoning", "conflicting_template_option",
                          "reasoning and reasoning_content disagree")
    reasoning = reasoning or msg.reasoning or None
    parts: list[ir.Part] = [ir.ReasoningPart(reasoning)] if reasoning else []
    if msg.content is not None:
        parts += _parts(msg.content, "assistant", f"{param}.content", defaults)
    if msg.refusal:
        parts.append(ir.RefusalPart(msg.refusal))
    if msg.function_call is not None:  # legacy history: the call precedes any tool_calls
        call_id = f"call_legacy_{index}"
        legacy_calls.append((call_id, msg.function_call.name))
        parts.append(_tool_call(call_id, msg.function_call))
    for j, call in enumerate(msg.tool_calls or []):
        if call.type != "function":
            raise unsupported(f"{param}.tool_calls[{j}].type", "tool_type_not_supported",
                              "only function tool calls are available")
        parts.append(_tool_call(call.id, call.function))
    return ir.Message("assistant", parts)


def _tool_call(call_id: str, fn: FunctionCall) -> ir.ToolCallPart:
    """Historical arguments keep their member order; text that is not a JSON object is replayed as given."""
    try:
        parsed = json.loads(fn.arguments)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        return ir.ToolCallPart(call_id=call_id, name=fn.name, arguments=parsed, raw_arguments=fn.arguments)
    return ir.ToolCallPart(call_id=call_id, name=fn.name, arguments={}, raw_arguments=fn.arguments)


def _answer_legacy_call(pending: list[tuple[str, str]], name: str, param: str) -> str:
    for k, (call_id, called) in enumerate(pending):
        if called == name:
            del pending[k]
            return call_id
    raise invalid(f"function result {name!r} answers no earlier assistant function_call", param, "invalid_tool_history")


_MEDIA_ROLES = {"image_url": ("user", "tool"), "video_url": ("user",)}


def _parts(content: Content, role: str, param: str, defaults: ChatDefaults) -> list[ir.Part]:
    if isinstance(content, str):
        return [ir.TextPart(content)]
    out: list[ir.Part] = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if isinstance(part, TextContent):
            out.append(ir.TextPart(part.text, cache=_breakpoint(part.prompt_cache_breakpoint, where)))
        elif isinstance(part, RefusalContent):
            if role != "assistant":
                raise invalid("refusal parts are only valid on assistant messages", f"{where}.type")
            out.append(ir.RefusalPart(part.refusal))
        elif isinstance(part, (ImageContent, VideoContent)):
            out.append(_media(part, role, where, defaults))
        else:
            raise unsupported(f"{where}.type", "modality_not_supported",
                              f"{part.type!r} input is not available; text, image_url and video_url are")
    return out


def _media(part: ImageContent | VideoContent, role: str, where: str, defaults: ChatDefaults) -> ir.Part:
    if role not in _MEDIA_ROLES[part.type]:
        raise unsupported(f"{where}.type", "modality_not_supported",
                          f"{part.type} is only accepted on {' or '.join(_MEDIA_ROLES[part.type])} messages")
    ref = part.image_url if isinstance(part, ImageContent) else part.video_url
    url = ref if isinstance(ref, str) else ref.url
    detail = None if isinstance(ref, str) else getattr(ref, "detail", None)
    if detail not in (None, "auto"):
        raise unsupported(f"{where}.image_url.detail", "image_detail_not_supported",
                          f"detail {detail!r} asks for a preprocessing profile that cannot be applied; use 'auto'")
    if not url.startswith(("http://", "https://", "data:")):
        raise ProtocolError(f"{where}: media must be an http(s) URL or a data URI", param=where, code="invalid_media")
    if not defaults.vision:
        raise ProtocolError("media input needs the server started with --vision", param=where, code="vision_disabled")
    cache = _breakpoint(part.prompt_cache_breakpoint, where)
    if isinstance(part, ImageContent):
        return ir.ImagePart(source=url, detail=detail, cache=cache, param=where)
    return ir.VideoPart(source=url, cache=cache, param=where)


def _breakpoint(value: Any, where: str) -> ir.CacheMark | None:
    if value is None:
        return None
    if value != {"mode": "explicit"}:
        raise invalid("prompt_cache_breakpoint must be {\"mode\": \"explicit\"}", f"{where}.prompt_cache_breakpoint",
                      "invalid_cache_breakpoint")
    return ir.CacheMark()


# ---- template options ------------------------------------------------------------------------


def _prompt_options(req: ChatCompletionRequest) -> ir.PromptOptions:
    """Typed options and chat_template_kwargs as sent; the chat frontend merges them with the server's
    defaults (--no-thinking, --preserve-thinking) and rejects disagreements, for every protocol alike."""
    implicit = not (req.prompt_cache_options and req.prompt_cache_options.mode == "explicit")
    return ir.PromptOptions(enable_thinking=req.enable_thinking, preserve_thinking=req.preserve_thinking,
                            reasoning_effort=_effort(req.reasoning_effort, "reasoning_effort"),
                            template_kwargs=dict(req.chat_template_kwargs or {}), implicit_cache=implicit)


def _effort(value: Any, param: str) -> str | None:
    if value is None or value in ("default", "auto"):  # client spellings of "the server's level"
        return None
    if not isinstance(value, str) or value not in EFFORTS:
        raise invalid(f"{param} must be one of {', '.join(EFFORTS)}", param)
    return value
