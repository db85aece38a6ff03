"""Jinja rendering of chat templates, in the environment Hugging Face transformers gives them.

Templates are written against transformers' `apply_chat_template`, so the environment mirrors it:
a sandbox with trim_blocks/lstrip_blocks, loop controls, a `{% generation %}` tag, a `tojson` that
keeps non-ASCII text and member order, and the `raise_exception` / `strftime_now` globals.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ninfer.chat.errors import ChatTemplateError, TemplateRenderError

MAX_TEMPLATE_BYTES = 16 * 1024 * 1024


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering keeps the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore attributes, so a template cannot reach interpreter internals."""

    def __init__(*args: Any, **kwargs: Any):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a template namespace cannot hold {name!r}")


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = lambda *args, **kwargs: dict(*args, **kwargs)
    env.globals["namespace"] = _Namespace
    return env


class ChatTemplate:
    """A compiled chat template. `render` raises TemplateRenderError when the template rejects its input."""

    def __init__(self, source: str, name: str = "chat template"):
        if not source.strip():
            raise ChatTemplateError(f"{name} is empty")
        self.source = source
        self.name = name
        self._template = _compile(source, name)

    def render(self, variables: dict[str, Any]) -> str:
        try:
            return self._template.render(**variables)
        except jinja2.exceptions.TemplateError as exc:  # raise_exception, undefined values, sandbox refusals
            raise TemplateRenderError(f"the chat template rejected the conversation: {exc}", param="messages") from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise TemplateRenderError(f"the chat template failed on the conversation: {exc}",
                                      param="messages") from exc

    def mentions(self, text: str) -> bool:
        return text in self.source


@lru_cache(maxsize=16)
def _compile(source: str, name: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"{name} does not compile: {exc}") from exc


def load_chat_template(path: str | os.PathLike) -> ChatTemplate:
    """The `--chat-template FILE` override: a non-empty UTF-8 Jinja file of at most 16 MiB."""
    name = os.fspath(path)
    try:
        size = os.path.getsize(path)
        if size == 0 or size > MAX_TEMPLATE_BYTES:
            raise ChatTemplateError(f"chat template {name} must be a non-empty file of at most 16 MiB")
        with open(path, encoding="utf-8") as f:
            return ChatTemplate(f.read(), name)
    except OSError as exc:
        raise ChatTemplateError(f"cannot read chat template {name}: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ChatTemplateError(f"chat template {name} is not UTF-8 text") from exc
