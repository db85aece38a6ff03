"""Speculative decoding on requests with images and video (serving.md, speculative decoding: greedy output with
drafts equals greedy output without them; vision: media rows and MRoPE positions).

A tiny Qwen3.6 artifact with a vision tower and a random MTP head, on the CPU in fp32. The MTP head drafts through
its eager path (MRoPE sequences run no graph), then the drafts are replaced below the engine by the plain engine's
own continuation with a quarter corrupted, so rounds accept runs of drafts and reject others; DFlash and DFlash2
draft from the target's hidden states with their own (random) weights. Every output must equal the engine without
drafts, a follow-up turn reusing the first turn's endpoint (media inside the reused prefix) too.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_no_leak
from test_speculative import _block_drafter_artifact
from test_vision_engine import CHUNK, image, run, video

from ninfer.artifact.presets import write_preset
from ninfer.engine.engine import EngineSettings
from ninfer.engine.loader import load_engine
from ninfer.engine.speculative import OracleProposer
from ninfer.engine.types import EngineRequest

MAX_TOKENS = 20
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def artifacts(artifacts_dir, tmp_path_factory) -> dict[str, object]:
    """The vision artifact with an MTP head, and with a DFlash / DFlash2 drafter."""
    path = artifacts_dir / "tiny-qwen3.6-vision-mtp.ninfer"
    if not path.exists():
        write_preset("tiny-qwen3.6", path, vision=True, mtp=True)
    work = tmp_path_factory.mktemp("spec-vision")
    return {"mtp": path, **{v: _block_drafter_artifact(path, work / v, v) for v in ("dflash", "dflash2")}}


def _settings(**extra) -> EngineSettings:
    return EngineSettings(vision=True, max_context=512, max_concurrency=2, prefill_chunk=CHUNK, page_size=16,
                          greedy=True, **extra)


def _first_turn(name: str) -> EngineRequest:
    """text, a video, text, an image, text (test_vision_engine's layout)."""
    ids = [10, 11, 12]
    vid_ids, vid = video(len(ids), seed=100)
    ids += vid_ids + [20, 21]
    img_ids, img = image(len(ids), seed=1)
    ids += img_ids + [30, 31, 32]
    return EngineRequest(name, ids, max_tokens=MAX_TOKENS, media=[vid, img])


def _follow_up(first: EngineRequest, answer: list[int], name: str) -> EngineRequest:
    """The first turn, its answer, then more text and a second image: its prefix is the first turn's endpoint."""
    ids = list(first.prompt_ids) + answer + [40, 41]
    img_ids, img = image(len(ids), seed=2)
    return EngineRequest(name, ids + img_ids + [42, 43], max_tokens=MAX_TOKENS, media=[*first.media, img])


@pytest.mark.parametrize("drafter", ["mtp", "dflash", "dflash2"])
def test_image_and_video_requests_decode_as_without_drafts(artifacts, drafter):
    path = artifacts[drafter]
    plain = load_engine(path, _settings(), device=CPU, dtype="fp32")
    try:
        first = _first_turn("first")
        expected_first, _ = run(plain, first)
        follow = _follow_up(first, expected_first, "follow")
        expected_follow, _ = run(plain, follow)
    finally:
        plain.shutdown()
    assert len(expected_first) == len(expected_follow) == MAX_TOKENS

    spec = load_engine(path, _settings(draft_tokens=3, spec=drafter), device=CPU, dtype="fp32")
    try:
        if drafter == "mtp":  # the head drafts first (its MRoPE path runs), then the oracle replaces its drafts
            oracle = OracleProposer({"first": expected_first, "follow": expected_follow}, corrupt=0.25, vocab=900,
                                    seed=3)
            head = spec.proposer.propose
            spec.proposer.propose = lambda works, budgets: (head(works, budgets), oracle.propose(works, budgets))
        got_first, _ = run(spec, first)
        got_follow, finish = run(spec, follow)
        counters = spec.counters
        assert got_first == expected_first
        assert got_follow == expected_follow
        assert finish.usage.cached_tokens >= len(first.prompt_ids)  # the follow-up reused the first turn's endpoint
        assert counters.spec_drafted_tokens > 0
        if drafter == "mtp":  # the oracle's drafts are mostly right: runs of them are accepted
            assert counters.spec_accepted_tokens > 0
        assert_no_leak(spec)
    finally:
        spec.shutdown()
