"""Speculative decoding through the served API: a server started with `--spec mtp --draft-tokens 3 --lm-head-draft`
(contract: server options; the startup example) answers the official SDKs as a server without them does, and
reports its draft work where the contract says: Chat Completions' terminal timings draft_n / draft_n_accepted
("Speculative requests additionally include terminal draft_n and draft_n_accepted when draft work occurred"),
/metrics ninfer_spec_decode_{rounds,draft_tokens,accepted_tokens,fallback_steps}_total, and the request log's
request_done.timings_seconds.speculative (backend, draft_window, rounds, drafted_tokens, accepted_tokens,
fallback_steps, accepted_per_position).

The engines are the real ones (tiny random Qwen3.6 with an MTP head and a proposal head, built by the startup
path); only the drafts the MTP head proposes are replaced, below the engine, by the plain server's own greedy
continuation with a share corrupted, so that drafts are accepted as a trained head's would be, and every
decode step drafts (the fixture says why).
"""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import openai
import pytest
from server_fixtures import LiveServer, wait_until

from ninfer.cli import main as cli_main
from ninfer.config import ServerConfig
from ninfer.engine.speculative import OracleProposer
from ninfer.engine.types import TokenEvent
from ninfer.server.context import build_context
from ninfer.server.engine_client import LocalEngineClient
from ninfer.server.startup import load_engine_for

QUESTIONS = ["What is speculative decoding?", "Name three rivers.", "Count from one to ten."]
MAX_TOKENS = 24


class _PromptOracle(OracleProposer):
    """The oracle keyed by prompt ids (the router names requests itself): each prompt's continuation is what
    the plain server's engine generated for it."""

    def drafts(self, seq, budget: int) -> list[int]:
        known = self.continuations.get(tuple(seq.request.prompt_ids), [])
        done = len(seq.output_ids)
        return [self._replacement(str(len(seq.request.prompt_ids)), done + j, t)
                for j, t in enumerate(known[done: done + budget])]


def _serve(cfg: ServerConfig) -> LiveServer:
    engine = load_engine_for(cfg)
    return LiveServer(build_context(cfg, LocalEngineClient(engine)), engine)


@pytest.fixture(scope="module")
def served(tiny_qwen_mtp_path, tmp_path_factory):
    """A plain server and a speculative one over the same artifact (with a proposal head); the plain engine's
    outputs by prompt feed the speculative engine's oracle."""
    work = tmp_path_factory.mktemp("spec-http")
    corpus = work / "corpus.txt"
    corpus.write_text("rivers count one two three speculative decoding drafts tokens. " * 10)
    artifact = work / "with-head.ninfer"
    assert cli_main(["convert-draft-head", str(tiny_qwen_mtp_path), str(artifact), "--tokens", "300",
                     "--corpus", str(corpus)]) == 0
    log = work / "requests.jsonl"
    common = dict(artifact=str(artifact), max_context=512, max_concurrency=2, page_size=16)
    plain = _serve(ServerConfig(**common))
    spec = _serve(ServerConfig(**common, spec="mtp", draft_tokens=3, lm_head_draft=True, request_log_jsonl=str(log)))
    continuations: dict[tuple, list[int]] = {}
    submit = plain.engine.submit

    def recording(request, on_event):
        out = continuations.setdefault(tuple(request.prompt_ids), [])
        submit(request, lambda ev: (out.extend(ev.token_ids) if isinstance(ev, TokenEvent) else None, on_event(ev)))

    plain.engine.submit = recording
    oracle = _PromptOracle(continuations, corrupt=0.25, vocab=900, seed=7)
    propose = spec.engine.proposer.propose

    def drafting(works, budgets):
        propose(works, budgets)  # the MTP head on its proposal head, as served
        oracle.propose(works, budgets)

    spec.engine.proposer.propose = drafting
    # every decode row drafts its whole window: the served engine's draft controller would choose draft counts
    # from this machine's step times (its own tests cover it), and the counts checked here must not depend on them
    spec.engine.drafts_control = None
    yield plain, spec, log
    plain.stop()
    spec.stop()


def _openai(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(server: LiveServer, question: str):
    return _openai(server).chat.completions.create(model=server.ctx.model_id, temperature=0, max_tokens=MAX_TOKENS,
                                                   messages=[{"role": "user", "content": question}])


def _metric(server: LiveServer, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    match = re.search(rf'^{name}{{replica="[^"]*"}} ([0-9.e+]+)$', text, re.M)
    assert match, name
    return float(match.group(1))


def test_greedy_answers_equal_a_server_without_speculation_and_timings_count_the_drafts(served):
    plain, spec, _ = served
    for question in QUESTIONS:
        want, got = _chat(plain, question), _chat(spec, question)
        assert got.choices[0].message.model_dump() == want.choices[0].message.model_dump()
        assert got.usage.completion_tokens == want.usage.completion_tokens
        timings = got.model_extra["timings"]
        assert "draft_n" not in want.model_extra["timings"]  # no draft work, no draft fields
        assert timings["draft_n"] >= 1 and 0 <= timings["draft_n_accepted"] <= timings["draft_n"]
        assert timings["predicted_n"] == got.usage.completion_tokens
    assert spec.engine.counters.spec_accepted_tokens > 0  # the oracle's drafts stood: multi-token commits


def test_streamed_and_anthropic_answers_equal_the_plain_servers(served):
    plain, spec, _ = served

    def streamed(server):
        chunks = list(_openai(server).chat.completions.create(
            model=server.ctx.model_id, messages=[{"role": "user", "content": QUESTIONS[2]}], temperature=0,
            max_tokens=MAX_TOKENS, stream=True, stream_options={"include_usage": True}))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        text = "".join((d.content or "") + "|" + (getattr(d, "reasoning_content", None) or "") for d in deltas)
        return text, chunks[-1].model_extra["timings"]

    (want, _), (got, timings) = streamed(plain), streamed(spec)
    assert got == want and timings["draft_n"] >= 1

    def messages(server):
        client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
        return client.messages.create(model=server.ctx.model_id, max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
                                      messages=[{"role": "user", "content": QUESTIONS[1]}])

    want, got = messages(plain), messages(spec)
    assert [b.model_dump() for b in got.content] == [b.model_dump() for b in want.content]
    assert got.usage.output_tokens == want.usage.output_tokens


def test_a_penalized_request_drafts_and_answers_as_the_plain_server(served):
    """Presence and frequency penalties (serving.md, sampling) with speculation: the request drafts (each verify
    position counts the drafts before it) and its answer equals the plain server's."""
    plain, spec, _ = served

    def chat(server):
        return _openai(server).chat.completions.create(
            model=server.ctx.model_id, temperature=0, presence_penalty=1.5, frequency_penalty=0.5, max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": "Penalties: list rivers, never the same twice."}])

    want, got = chat(plain), chat(spec)
    assert got.choices[0].message.model_dump() == want.choices[0].message.model_dump()
    timings = got.model_extra["timings"]
    assert timings["draft_n"] >= 1 and timings["draft_n_accepted"] >= 1


def test_metrics_and_request_log_report_the_same_draft_work(served):
    """The engine's counters, /metrics and the request log's per-request speculative objects agree."""
    plain, spec, log = served
    _chat(plain, QUESTIONS[0])  # the oracle's continuation
    raw = _openai(spec).chat.completions.with_raw_response.create(
        model=spec.ctx.model_id, temperature=0, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": QUESTIONS[0]}])
    timings, http_id = raw.parse().model_extra["timings"], raw.headers["x-request-id"]
    assert wait_until(lambda: _done_count(log) == _finished(spec))
    c = spec.engine.counters
    assert _metric(spec, "ninfer_spec_decode_rounds_total") == c.spec_rounds > 0
    assert _metric(spec, "ninfer_spec_decode_draft_tokens_total") == c.spec_drafted_tokens
    assert _metric(spec, "ninfer_spec_decode_accepted_tokens_total") == c.spec_accepted_tokens
    assert _metric(spec, "ninfer_spec_decode_fallback_steps_total") == c.spec_fallback_steps
    done = [json.loads(line) for line in log.read_text().splitlines() if '"request_done"' in line]
    specs = [r["timings_seconds"]["speculative"] for r in done]
    mine = next(r["timings_seconds"]["speculative"] for r in done if r["request"]["x_request_id"] == http_id)
    assert (timings["draft_n"], timings["draft_n_accepted"]) == (mine["drafted_tokens"], mine["accepted_tokens"])
    assert 0 < mine["accepted_tokens"] < mine["drafted_tokens"]  # some drafts stood, some fell (corrupted)
    assert all(s["backend"] == "mtp" and s["draft_window"] == 3 for s in specs)
    assert sum(s["rounds"] for s in specs) == c.spec_rounds
    assert sum(s["drafted_tokens"] for s in specs) == c.spec_drafted_tokens
    assert sum(s["accepted_tokens"] for s in specs) == c.spec_accepted_tokens
    for s in specs:  # accepted_per_position[i]: rounds whose draft i stood, so non-increasing and summing up
        per = s["accepted_per_position"]
        assert sum(per) == s["accepted_tokens"] and per == sorted(per, reverse=True) and len(per) <= 3


def _done_count(log) -> int:
    return sum('"request_done"' in line for line in log.read_text().splitlines())


def _finished(server: LiveServer) -> int:
    return sum(server.engine.snapshot()["requests"].values())
