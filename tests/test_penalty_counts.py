"""Generated-token counts for presence/frequency penalties (serving.md, sampling: the penalties apply
to the request's own generated tokens). Only a request with a penalty counts its tokens and resets
its lane's counts when it starts, so an unpenalized decode step does no counting work, and a
penalized request never sees another request's tokens.

The model emits token 1000 with logit 1 and 0 elsewhere; greedy with frequency penalty 0.6: 1000
twice (1, then 0.4), then -0.2 loses to the zeros and the lowest ids follow, each once.
"""

from __future__ import annotations

import threading

from ninfer.chat.thinking import thinking_control
from ninfer.engine.engine import Engine, EngineSettings
from ninfer.engine.types import EngineRequest, FinishEvent, SamplingParams, TokenEvent
from ninfer.models.scripted import FixedLogitsModel

PENALIZED = [1000, 1000, 0, 1, 2]


def _run(engine: Engine, rid: str, sampling: SamplingParams) -> list[int]:
    tokens, done = [], threading.Event()

    def on_event(ev):
        if isinstance(ev, TokenEvent):
            tokens.extend(ev.token_ids)
        if isinstance(ev, (FinishEvent, Exception)):
            done.set()

    engine.submit(EngineRequest(rid, [5, 6, 7], max_tokens=5, sampling=sampling), on_event)
    assert done.wait(30)
    return tokens


def test_only_penalized_requests_count_and_they_start_from_zero(qwen_tokenizer):
    settings = EngineSettings(max_context=64, max_concurrency=1, eos_ids=set())
    engine = Engine(FixedLogitsModel(2000), qwen_tokenizer, settings, thinking=thinking_control(qwen_tokenizer)).start()
    engine.settings.eos_ids = set()
    plain, penalized = SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, frequency_penalty=0.6)
    try:
        assert _run(engine, "a", plain) == [1000] * 5
        assert engine.runner.counts.abs().sum().item() == 0  # nothing counted for it
        assert _run(engine, "b", penalized) == PENALIZED
        # its own tokens on its lane (1000 twice; the last token's count may land after its finish event)
        assert engine.runner.counts[0, 1000].item() == 2 and engine.runner.counts[0, 0].item() == 1
        assert _run(engine, "c", plain) == [1000] * 5  # stale counts on the lane: no penalty reads them
        assert _run(engine, "d", penalized) == PENALIZED  # the lane reset when it started
    finally:
        engine.shutdown()
