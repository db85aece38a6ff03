"""The prompt builder: a conversation rendered by the chat template, tokenized with client text as
plain text, plus the boundaries the context cache needs (contract: "OpenAI prompt caching" and the
checkpoint paragraphs of "Execution behavior").
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from ninfer.chat import ir
from ninfer.chat.control_tokens import ControlTokens, TokenizedText, tokenize_rendered
from ninfer.chat.errors import InvalidPromptError, TemplateRenderError
from ninfer.chat.layout import Layout, message_layout, turn_start_at_or_before
from ninfer.chat.lowering import CacheSpot, Lowered, Site, lower
from ninfer.chat.media_tokens import Expansion, expand_media
from ninfer.chat.options import ServerPromptDefaults, template_variables
from ninfer.chat.probes import resolve_markers, with_leading_markers, with_markers
from ninfer.chat.render import ChatTemplate
from ninfer.tokenizer import Tokenizer

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
MEDIA_PADS = {"<|image_pad|>": "image", "<|video_pad|>": "video"}
MAX_CACHE_WRITES = 4


class PromptBuilder:
    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate, *, special_tokens: dict[str, Any],
                 defaults: ServerPromptDefaults, developer_as_system: bool):
        self.tokenizer = tokenizer
        self.template = template
        self.controls = ControlTokens(tokenizer)
        self.special_tokens = dict(special_tokens)
        self.defaults = defaults
        self.developer_as_system = developer_as_system

    def build(self, conversation: ir.Conversation, media: Sequence[Any] | None = None) -> ir.Prompt:
        """`media`: the prepared items (ninfer.media.PreparedMedia) of ir.media_parts(conversation), in
        that order; with them each placeholder is expanded to its pads, without them it stays one pad."""
        return _Build(self, conversation, media).prompt()


class _Build:
    """One prompt build: the real render plus the probes that locate boundaries in it."""

    def __init__(self, builder: PromptBuilder, conversation: ir.Conversation, media: Sequence[Any] | None = None):
        self.b = builder
        self.conv = conversation
        self.media = media
        options = conversation.options
        self.continuation = options.continue_final_message
        self.generation = options.add_generation_prompt and not self.continuation
        if self.continuation:
            _check_prefill(conversation)
        self.lowered: Lowered = lower(conversation, builder.controls,
                                      developer_as_system=builder.developer_as_system)
        self.variables = template_variables(options, builder.defaults, builder.special_tokens)
        self.base: dict[str, Any] = {
            **builder.special_tokens,
            **{k: builder.controls.inert_value(v) for k, v in self.variables.items()},
            "tools": self.lowered.tools,
            "documents": None,
        }
        if self.continuation:
            self.base["continue_final_message"] = True

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.b.template.render({**self.base, "messages": messages,
                                       "add_generation_prompt": add_generation_prompt})

    def prompt(self) -> ir.Prompt:
        messages = self.lowered.messages
        full = self.render(messages, self.generation)  # inert text: client control spellings disarmed
        text = self._prefill_cut(full) if self.continuation else full
        text_controls = self.b.controls.find(text)
        self._check_placeholders(text_controls)
        expansion = self._expand(text, text_controls)
        tokens = tokenize_rendered(expansion.text, self.b.controls, self.b.tokenizer)
        full_controls = text_controls if text is full else self.b.controls.find(full)
        layout = self._layout(full, full_controls)

        def offsets(chars) -> list[int]:
            """Token offsets of the character offsets that are exact token frontiers of the prompt."""
            moved = (expansion.shift(c) for c in chars if c is not None and c <= len(text))
            found = (tokens.token_offset(c, self.b.tokenizer) for c in moved if c is not None)
            return sorted({o for o in found if o is not None})

        boundary = offsets([self._input_boundary(full, full_controls, layout)])
        media, media_offsets, spans = self._bind_media(tokens, expansion)
        return ir.Prompt(
            token_ids=tokens.ids,
            text=tokens.text,
            thinking=_ends_thinking(tokens),
            message_ends=offsets(layout.ends),
            input_boundary=boundary[0] if boundary else None,
            cache_candidates=offsets(self._cache_writes(full, layout)),
            media=media,
            media_token_offsets=media_offsets,
            media_spans=spans,
            preserve_thinking=self.variables.get("preserve_thinking"),
        )

    # ---- assistant prefill --------------------------------------------------------------------

    def _prefill_cut(self, full: str) -> str:
        """The render cut right after the final assistant content, so generation continues it."""
        last = len(self.lowered.messages) - 1
        content = self.lowered.messages[last]["content"]
        assert isinstance(content, str)  # a prefill is text only
        end = self._locate_parts(full, [Site(last, None, len(content))])[0]
        if end is None:
            raise InvalidPromptError("the chat template does not show the final assistant message as written, "
                                     "so it cannot be continued", param="messages")
        return full[:end]

    # ---- layout and boundaries ---------------------------------------------------------------

    def _layout(self, full: str, full_controls: list[tuple[int, int, str]]) -> Layout:
        count = len(self.lowered.messages)
        try:
            probe = self.render(with_leading_markers(self.lowered.messages), self.generation)
        except TemplateRenderError:
            return Layout.unknown(count)
        return message_layout(full, full_controls, probe, self.b.controls.find(probe), count)

    def _input_boundary(self, full: str, controls: list[tuple[int, int, str]], layout: Layout) -> int | None:
        """The stable point before the response (contract: the input checkpoint).

        It precedes the generation prologue, unless the template would rewrite an assistant turn of
        the current exchange once the conversation moves on (closed reasoning dropped when
        preserve_thinking is off): then it precedes that turn, found by rendering the next turn.
        """
        roles = self.lowered.roles
        if self.continuation:
            return layout.starts[-1]
        if not self.generation:
            return None
        history = self.render(self.lowered.messages, False)
        if not full.startswith(history):
            return None
        last_user = max((i for i, role in enumerate(roles) if role == "user"), default=-1)
        if "assistant" not in roles[last_user + 1:]:
            return len(history)
        try:
            next_turn = self.render([*self.lowered.messages, {"role": "user", "content": ""}], False)
        except TemplateRenderError:
            next_turn = ""
        if next_turn.startswith(history):
            return len(history)
        changed = len(os.path.commonprefix([history, next_turn]))
        return turn_start_at_or_before(controls, changed)

    # ---- cache writes -------------------------------------------------------------------------

    def _cache_writes(self, full: str, layout: Layout) -> list[int]:
        """At most four write candidates: the latest explicit markers, then the implicit one if room is left."""
        spots = self.lowered.spots
        chosen = [s for s in spots if s.explicit][-MAX_CACHE_WRITES:]
        if self.conv.options.implicit_cache and len(chosen) < MAX_CACHE_WRITES:
            latest = next((s for s in reversed(spots) if s.kind == "part"), None)
            if latest is not None and all(s.site != latest.site for s in chosen):
                chosen.append(CacheSpot("part", explicit=False, site=latest.site))
        offsets: list[int | None] = [None] * len(chosen)
        parts = [i for i, s in enumerate(chosen) if s.kind == "part"]
        for i, found in zip(parts, self._locate_parts(full, [chosen[i].site for i in parts])):
            offsets[i] = found
        for i, spot in enumerate(chosen):
            if spot.kind == "message_end":
                offsets[i] = layout.ends[spot.message]
            elif spot.kind == "tool":
                offsets[i] = self._tool_end(full, spot.tool)
        return [o for o in offsets if o is not None and o > 0]

    def _locate_parts(self, full: str, sites: list[Site]) -> list[int | None]:
        """Offsets in `full` just after each site; a site the template trimmed is retried at its trimmed end."""
        found = self._probe(full, sites)
        retry = {i: trimmed for i, site in enumerate(sites)
                 if found[i] is None and (trimmed := self._trimmed(site)) != site}
        if retry:
            again = self._probe(full, list(retry.values()))
            for i, offset in zip(retry, again):
                found[i] = offset
        return found

    def _probe(self, full: str, sites: list[Site]) -> list[int | None]:
        if not sites:
            return []
        messages = with_markers(self.lowered.messages, [(site, k) for k, site in enumerate(sites)])
        try:
            located = resolve_markers(self.render(messages, self.generation), full)
        except TemplateRenderError:
            return [None] * len(sites)
        return [located.get(k) for k in range(len(sites))]

    def _trimmed(self, site: Site) -> Site:
        if site.offset is None:
            return site
        content = self.lowered.messages[site.message]["content"]
        text = content if site.item is None else content[site.item]["text"]
        return Site(site.message, site.item, len(text[: site.offset].rstrip()))

    def _tool_end(self, full: str, index: int) -> int | None:
        """After a tool's definition, when the template printed it as tojson does."""
        tools = self.lowered.tools or []
        pos = 0
        for k in range(index + 1):
            spelled = json.dumps(tools[k], ensure_ascii=False)
            at = full.find(spelled, pos)
            if at < 0:
                return None
            pos = at + len(spelled)
        return pos

    # ---- media ---------------------------------------------------------------------------------

    def _check_placeholders(self, controls: list[tuple[int, int, str]]) -> None:
        kinds = [MEDIA_PADS[spelling] for _, _, spelling in controls if spelling in MEDIA_PADS]
        expected = [part.type for part in self.lowered.media]
        if kinds != expected:
            raise InvalidPromptError(
                f"the chat template placed {len(kinds)} media placeholders for {len(expected)} image/video inputs",
                param="messages")

    def _expand(self, text: str, controls: list[tuple[int, int, str]]) -> Expansion:
        """The text with every placeholder expanded, or unchanged when no media were prepared."""
        if self.media is None or not self.lowered.media:
            return Expansion(text)
        parts = ir.media_parts(self.conv.messages)
        if len(parts) != len(self.media):
            raise ValueError(f"{len(self.media)} prepared media for {len(parts)} media parts")
        at = {id(part): k for k, part in enumerate(parts)}
        ordered = [self.media[at[id(part)]] for part in self.lowered.media]  # template order
        for part, prepared in zip(self.lowered.media, ordered):
            if prepared.modality != part.type:
                raise ValueError(f"a prepared {prepared.modality} was given for a {part.type} part")
        return expand_media(text, controls, ordered)

    def _bind_media(self, tokens: TokenizedText,
                    expansion: Expansion) -> tuple[list[ir.Part], list[int], list[ir.MediaSpan]]:
        """The media in placeholder order, each one's first pad token, and the expanded pad runs."""
        media = list(self.lowered.media)
        if not expansion.runs:
            # A control token always starts a chunk, so each pad has an exact token offset.
            pads = [start for start, _, spelling in tokens.controls if spelling in MEDIA_PADS]
            return media, [tokens.token_offset(start, self.b.tokenizer) for start in pads], []
        spans = [ir.MediaSpan(tokens.token_offset(run.char, self.b.tokenizer), run.grid_thw, run.kind, run.digest,
                              run.item) for run in expansion.runs]
        firsts: dict[int, int] = {}
        for span in spans:
            firsts.setdefault(span.item, span.start)
        return media, [firsts[k] for k in range(len(media))], spans


def _check_prefill(conversation: ir.Conversation) -> None:
    last = conversation.messages[-1] if conversation.messages else None
    if last is None or last.role != "assistant" or not all(isinstance(p, ir.TextPart) for p in last.parts):
        raise InvalidPromptError("continuing the final message needs a final assistant message of text only",
                                 param="messages")


def _ends_thinking(tokens: TokenizedText) -> bool:
    """Whether the prompt leaves a reasoning block open (the template's own think markers only)."""
    opened = closed = -1
    for i, (_, _, spelling) in enumerate(tokens.controls):
        if spelling == THINK_OPEN:
            opened = i
        elif spelling == THINK_CLOSE:
            closed = i
    return opened > closed
