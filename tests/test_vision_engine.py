"""The engine consumes EngineRequest.media: a tiny Qwen3.6 artifact with a vision tower, on CPU in fp32.

Greedy output with images and a video equals a manual reference (text embeddings with the tower's
embeddings in the pads' rows, MRoPE positions, one uncached forward per token), with prefill chunks
that split media items; prefix reuse hits with the same media (and the tower does not run for media
inside the reused prefix) and misses with other media; one chat completion with a real PNG through
the official openai SDK.
"""

from __future__ import annotations

import base64
import io
from dataclasses import replace

import numpy as np
import openai
import pytest
import torch
from engine_helpers import assert_no_leak, run_all, token_ids
from PIL import Image
from server_fixtures import LiveServer, base_context

from ninfer.artifact.presets import write_preset
from ninfer.config import ServerConfig
from ninfer.engine.engine import EngineSettings
from ninfer.engine.loader import load_engine
from ninfer.engine.media_inputs import item_token_indices
from ninfer.engine.types import EngineRequest, FinishEvent, InvalidRequestError, MediaInput, TokenEvent
from ninfer.forward import ForwardBatch, ModelCache
from ninfer.media import MediaPreprocessor
from ninfer.models.mrope import MediaSpan, mrope_positions
from ninfer.protocol.openai_chat import ChatDefaults
from ninfer.server.engine_client import LocalEngineClient
from ninfer.server.media_client import LocalMediaClient
from ninfer.server.startup import engine_settings

IMAGE_PAD, VIDEO_PAD, V_START, V_END = 248056, 248057, 248053, 248054
CHUNK = 8  # prefill chunks split every item below
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def vision_path(artifacts_dir):
    path = artifacts_dir / "tiny-qwen3.6-vision.ninfer"
    return path if path.exists() else write_preset("tiny-qwen3.6", path, vision=True)


@pytest.fixture(scope="module")
def engine(vision_path):
    settings = EngineSettings(vision=True, max_context=512, prefill_chunk=CHUNK, page_size=16, greedy=True)
    eng = load_engine(vision_path, settings, device=torch.device("cpu"), dtype="fp32")
    tower = eng.runner.vision_tower
    eng.tower_calls = []
    forward = tower.forward
    tower.forward = lambda patches, grid: (eng.tower_calls.append([tuple(g) for g in grid]), forward(patches, grid))[1]
    yield eng
    eng.shutdown()


def pixels(grid: tuple[int, int, int], seed: int) -> torch.Tensor:
    t, h, w = grid
    return torch.randn(t * h * w, 1536, generator=torch.Generator().manual_seed(seed)).bfloat16()


def image(at: int, seed: int, grid=(1, 8, 8)) -> tuple[list[int], MediaInput]:
    """<|vision_start|> pads <|vision_end|>, the pads starting at `at` + 1."""
    n = grid[1] * grid[2] // 4
    return [V_START] + [IMAGE_PAD] * n + [V_END], MediaInput(at + 1, n, grid, "image", f"img-{seed}",
                                                             pixels(grid, seed), [at + 1])


def video(at: int, seed: int) -> tuple[list[int], MediaInput]:
    """Two temporal groups of 2x2 merged tokens with 'timestamp' text between them."""
    ids = [V_START] + [VIDEO_PAD] * 4 + [V_END, 101, 102, V_START] + [VIDEO_PAD] * 4 + [V_END]
    return ids, MediaInput(at + 1, 8, (2, 4, 4), "video", f"vid-{seed}", pixels((2, 4, 4), seed), [at + 1, at + 10])


def prompt(image_seed: int = 1, tail: tuple[int, ...] = (30, 31, 32)) -> EngineRequest:
    """text, a video, text, an image, text."""
    ids = [10, 11, 12]
    vid_ids, vid = video(len(ids), seed=100)
    ids += vid_ids + [20, 21]
    img_ids, img = image(len(ids), seed=image_seed)
    ids += img_ids + list(tail)
    return EngineRequest(f"r{np.random.randint(1 << 30)}", ids, max_tokens=MAX_TOKENS, media=[vid, img])


def run(engine, request: EngineRequest) -> tuple[list[int], FinishEvent]:
    events = engine.generate(request)
    return [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids], events[-1]


@torch.inference_mode()
def reference(engine, request: EngineRequest, steps: int = MAX_TOKENS) -> list[int]:
    """Greedy tokens by uncached full forwards with inputs_embeds and MRoPE positions built here."""
    model, tower = engine.runner.model, engine.runner.vision_tower
    device = engine.device
    spans = [MediaSpan(s, (1, m.grid_thw[1], m.grid_thw[2])) for m in request.media for s in m.group_starts]
    mrope = mrope_positions(len(request.prompt_ids), spans, device=device)
    media_rows = {}
    for m in request.media:
        emb = tower(m.pixel_values.to(device, next(tower.parameters()).dtype), [m.grid_thw])
        media_rows.update(zip(item_token_indices(m).tolist(), emb))
    ids, out = list(request.prompt_ids), []
    width = engine.tokenizer.vocab_size
    for _ in range(steps):
        n = len(ids)
        x = model.embed_tokens(torch.tensor(ids, device=device))
        for row, emb in media_rows.items():
            x[row] = emb
        later = torch.arange(len(request.prompt_ids), n, device=device) + mrope.rope_delta
        positions = torch.cat([mrope.positions, later.expand(3, -1)], dim=1)
        pages = list(range(-(-n // 16)))
        batch = ForwardBatch.build([ids], [0], [pages], 16, state_slots=[0], device=device)
        batch.positions, batch.inputs_embeds = positions, x
        cache = ModelCache(model.cache_spec(), len(pages), 16, 1, x.dtype, device)
        hidden = model(batch, cache)
        out.append(int(model.compute_logits(hidden[-1:])[0, :width].argmax()))
        ids.append(out[-1])
    return out


def test_generation_with_a_video_and_an_image_equals_the_manual_reference(engine):
    request = prompt()
    engine.tower_calls.clear()
    tokens, fin = run(engine, request)
    assert fin.usage.completion_tokens == MAX_TOKENS and fin.usage.cached_tokens == 0
    # each item encoded once though chunks of 8 split both: the video at its first chunk, the image at its own
    assert engine.tower_calls == [[(2, 4, 4)], [(1, 8, 8)]]
    assert tokens == reference(engine, request)


def test_a_different_image_changes_the_output(engine):
    first, _ = run(engine, prompt(image_seed=1))
    other_request = prompt(image_seed=2)
    other, _ = run(engine, other_request)
    assert other != first
    assert other == reference(engine, other_request)


def test_prefix_reuse_hits_with_the_same_media_and_misses_with_other_media(engine):
    engine.cache.clear()
    base = prompt(image_seed=3)
    out, _ = run(engine, base)
    follow = base.prompt_ids + out + [40, 41]  # the next turn: the endpoint is a prefix of it
    same = replace(base, request_id="same", prompt_ids=follow)
    engine.tower_calls.clear()
    tokens, fin = run(engine, same)
    assert fin.usage.cached_tokens == len(base.prompt_ids) + len(out) - 1  # the endpoint
    assert fin.prefix_reuse_path == "checkpoint"
    assert engine.tower_calls == []  # both items lie inside the reused prefix: no encoding
    assert tokens == reference(engine, same)

    other_media = prompt(image_seed=4).media  # same pads and grids, another image
    other = replace(base, request_id="other", prompt_ids=follow, media=[base.media[0], other_media[1]])
    tokens, fin = run(engine, other)
    assert fin.usage.cached_tokens == 0 and fin.prefix_reuse_path == "root"
    assert tokens == reference(engine, other)


def test_a_checkpoint_inside_an_image_reuses_part_of_it_and_encodes_the_rest(engine):
    engine.cache.clear()
    base = prompt(image_seed=5)
    image = base.media[1]
    mid = image.start + 5  # a hybrid checkpoint (KV and state) inside the image's pads
    run(engine, replace(base, request_id="with-checkpoint", checkpoints=[mid]))
    later = replace(base, request_id="later", prompt_ids=base.prompt_ids[:-3] + [50, 51, 52, 53])
    engine.tower_calls.clear()
    tokens, fin = run(engine, later)
    assert fin.usage.cached_tokens == mid
    assert engine.tower_calls == [[(1, 8, 8)]]  # the video is inside the prefix; the image is encoded, rows sliced
    assert tokens == reference(engine, later)


@pytest.mark.parametrize("host_mib", [0, 64])  # replay (re-encodes the media) and host snapshots
def test_pausing_media_requests_keeps_greedy_output(engine, vision_path, host_mib):
    requests = [replace(prompt(image_seed=10 + i), request_id=f"p{i}") for i in range(4)]
    alone = [run(engine, r)[0] for r in requests]
    settings = EngineSettings(vision=True, max_context=512, prefill_chunk=CHUNK, page_size=4, greedy=True,
                              max_concurrency=4, kv_capacity=96, state_slots=8, host_context_bytes=host_mib << 20)
    pressed = load_engine(vision_path, settings, device=torch.device("cpu"), dtype="fp32")
    try:
        results = run_all(pressed, requests)
        assert pressed.scheduler.preemptions > 0
    finally:
        pressed.shutdown()
    assert [token_ids(r) for r in results] == alone
    assert_no_leak(pressed)


def test_an_engine_without_vision_refuses_media(vision_path):
    eng = load_engine(vision_path, EngineSettings(max_context=512), device=torch.device("cpu"), dtype="fp32")
    try:
        assert eng.runner.vision_tower is None
        with pytest.raises(InvalidRequestError, match="vision"):
            eng.submit(prompt(), lambda ev: None)
    finally:
        eng.shutdown()


# ---- HTTP --------------------------------------------------------------------------------------------


def png(seed: int, size: int = 256) -> str:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_a_chat_completion_with_a_png_generates(vision_path):
    cfg = ServerConfig(artifact=str(vision_path), max_context=1024, page_size=16, vision=True, greedy=True,
                       dtype="fp32")
    engine = load_engine(vision_path, engine_settings(cfg), device=torch.device("cpu"), dtype="fp32")
    media = MediaPreprocessor(64, 256, 2)
    ctx = replace(base_context(vision_path), config=cfg, engine=LocalEngineClient(engine),
                  max_model_len=cfg.max_model_len, chat_defaults=ChatDefaults(vision=True), media=LocalMediaClient(media))
    live = LiveServer(ctx, engine)
    try:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)

        def ask(uri: str):
            return client.chat.completions.create(model=ctx.model_id, max_tokens=6, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": "What is this?"}]}])

        first = ask(png(1))
        assert first.usage.completion_tokens == 6 and first.usage.prompt_tokens > 64  # 64 image pads + text
        again = ask(png(1))
        assert again.choices[0].message.content == first.choices[0].message.content
        assert ask(png(2)).usage.prompt_tokens == first.usage.prompt_tokens
        assert media.snapshot()["leases"] == 0
    finally:
        live.stop()
        media.close()
