"""Media input through the router: protocols -> media preparation -> expanded prompt -> EngineRequest.

Real PNG/JPEG bytes (pillow) and an MP4 (PyAV) made here, sent with the official openai and
anthropic SDKs to the in-process app over a real socket. Token counts must equal the text-only
count plus the expanded media tokens. The scripted engine here has no vision tower, so generations
carrying media reach it and are refused there (vision_disabled); tests/test_vision_engine.py generates
from media with a real tiny Qwen artifact.
"""

from __future__ import annotations

import asyncio
import base64
import io
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anthropic
import av
import numpy as np
import openai
import pytest
from PIL import Image
from server_fixtures import MODEL, LiveServer, base_context, scripted_artifact, scripted_engine, start_server

from ninfer.chat import ir
from ninfer.cli import build_parser
from ninfer.config import ServerConfig
from ninfer.media import MediaLimits, MediaPreprocessor
from ninfer.models.mrope import media_spans
from ninfer.protocol.openai_chat import ChatDefaults
from ninfer.server.engine_client import LocalEngineClient
from ninfer.server.launch import config_from_args
from ninfer.server.media_client import LocalMediaClient
from ninfer.server.media_prep import media_inputs, prepare_media
from ninfer.server.startup import check_implemented

MAX_CONTEXT = 1024
MAX_MEDIA_TOKENS = 2000  # a 1536x1536 image (2304 tokens) is over it, a 1024x1024 one (1024) is not
QUESTION = "What is this?"


# ---- media made here -----------------------------------------------------------------------------


def picture(size: int, fmt: str = "PNG") -> bytes:
    rng = np.random.default_rng(size)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


def clip(frames: int = 8, fps: int = 4, size: int = 64) -> bytes:
    """8 frames at 4 fps: sampled at 2 fps to frames 0, 2, 5, 7, i.e. two groups at 0.25 s and 1.5 s."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            frame = np.full((size, size, 3), i * 30, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def data_uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


PNG = picture(256)  # 256x256 -> 8x8 merged tokens
JPEG = picture(512, "JPEG")  # 512x512 -> 16x16
LARGE = picture(1024)  # 1024 tokens: beyond a 1024-token context once the template is added
HUGE = picture(1536)  # 2304 tokens: beyond the media budget
MP4 = clip()
CORRUPT = b"\x89PNG\r\n\x1a\n" + b"not really an image" * 8
PNG_URI, JPEG_URI, MP4_URI = data_uri(PNG, "image/png"), data_uri(JPEG, "image/jpeg"), data_uri(MP4, "video/mp4")
IMAGE_TOKENS = {"png": 64, "jpeg": 256}
# one `<t seconds>` text and a start/pads/end run per temporal group (64x64 frames: 2x2 merged tokens)
VIDEO_GROUPS = [("<0.2 seconds>", 4), ("<1.5 seconds>", 4)]


def image_cost(tokens: int) -> int:
    """What an image adds to a prompt: <|vision_start|>, its pads, <|vision_end|>."""
    return tokens + 2


def video_cost(tokenizer) -> int:
    return sum(len(tokenizer.encode(stamp)) + pads + 2 for stamp, pads in VIDEO_GROUPS)


# ---- servers -------------------------------------------------------------------------------------


class _Files(BaseHTTPRequestHandler):
    files = {"/cat.png": PNG}

    def do_GET(self):  # noqa: N802 (http.server's spelling)
        body = self.files.get(self.path)
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def files():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def media():
    pre = MediaPreprocessor(64, 256, 2, limits=MediaLimits(max_request_tokens=MAX_MEDIA_TOKENS))
    yield pre
    pre.close()


@pytest.fixture(scope="module")
def vision(artifacts_dir, qwen_tokenizer, media):
    """A --vision server whose preprocessor lives in this process."""
    path = scripted_artifact(artifacts_dir, qwen_tokenizer)
    cfg = ServerConfig(artifact=str(path), max_context=MAX_CONTEXT, page_size=16, vision=True)
    engine = scripted_engine(path, qwen_tokenizer, cfg)
    ctx = replace(base_context(path), config=cfg, engine=LocalEngineClient(engine), max_model_len=cfg.max_model_len,
                  chat_defaults=ChatDefaults(vision=True), media=LocalMediaClient(media))
    live = LiveServer(ctx, engine)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def plain(artifacts_dir, qwen_tokenizer):
    live = start_server(scripted_artifact(artifacts_dir, qwen_tokenizer), qwen_tokenizer)
    yield live
    live.stop()


def oai(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def claude(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=30)


def count_input(server: LiveServer, content) -> int:
    """Responses input_tokens of one user message."""
    return oai(server).responses.input_tokens.count(model=MODEL, input=[{"role": "user", "content": content}]).input_tokens


def count_messages(server: LiveServer, messages) -> int:
    return claude(server).messages.count_tokens(model="claude-local", messages=messages).input_tokens


def b64_block(data: bytes, mime: str = "image/png") -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": mime, "data": base64.b64encode(data).decode()}}


def input_image(uri: str) -> dict:
    return {"type": "input_image", "image_url": uri, "detail": "auto"}


TEXT = {"type": "input_text", "text": QUESTION}


# ---- startup ---------------------------------------------------------------------------------------


def test_vision_is_an_accepted_startup_option():
    cfg = config_from_args(build_parser().parse_args(["serve", "m.ninfer", "--vision"]))
    assert cfg.vision
    check_implemented(cfg)  # no longer refused (YAML args land in the same ServerConfig)
    check_implemented(ServerConfig(**{"artifact": "m.ninfer", "vision": True}))


# ---- counting with media ---------------------------------------------------------------------------


def test_anthropic_count_tokens_expands_base64_and_url_images(vision, files):
    text_only = count_messages(vision, [{"role": "user", "content": QUESTION}])
    png = count_messages(vision, [{"role": "user", "content": [b64_block(PNG), {"type": "text", "text": QUESTION}]}])
    assert png == text_only + image_cost(IMAGE_TOKENS["png"])
    two = count_messages(vision, [{"role": "user", "content": [
        b64_block(PNG), b64_block(JPEG, "image/jpeg"), {"type": "text", "text": QUESTION}]}])
    assert two == text_only + image_cost(IMAGE_TOKENS["png"]) + image_cost(IMAGE_TOKENS["jpeg"])
    url = count_messages(vision, [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": files + "/cat.png"}}, {"type": "text", "text": QUESTION}]}])
    assert url == png


def test_responses_input_tokens_expand_images_and_video_with_timestamps(vision, qwen_tokenizer):
    text_only = count_input(vision, [TEXT])
    assert count_input(vision, [input_image(JPEG_URI), TEXT]) == text_only + image_cost(IMAGE_TOKENS["jpeg"])
    video = {"type": "input_video", "video_url": MP4_URI}
    assert count_input(vision, [video, TEXT]) == text_only + video_cost(qwen_tokenizer)
    both = count_input(vision, [video, input_image(PNG_URI), TEXT])
    assert both == text_only + video_cost(qwen_tokenizer) + image_cost(IMAGE_TOKENS["png"])


def test_tool_result_images_are_counted(vision):
    ask = {"role": "user", "content": "Look."}
    call = {"type": "function_call", "call_id": "call_1", "name": "look", "arguments": "{}"}
    output = [{"type": "input_text", "text": "here"}]

    def count(*parts):
        result = {"type": "function_call_output", "call_id": "call_1", "output": [*output, *parts]}
        return oai(vision).responses.input_tokens.count(model=MODEL, input=[ask, call, result]).input_tokens

    without, with_image = count(), count(input_image(PNG_URI))
    assert with_image == without + image_cost(IMAGE_TOKENS["png"])

    use = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "look", "input": {}}]}

    def result(*content):
        return [{"role": "user", "content": "Look."}, use, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                    "content": [{"type": "text", "text": "here"}, *content]}]}]

    assert count_messages(vision, result(b64_block(PNG))) == count_messages(vision, result()) + image_cost(64)


def test_counting_releases_the_media(vision, media):
    count_input(vision, [input_image(PNG_URI), TEXT])
    assert media.snapshot()["leases"] == 0


# ---- the prompt and the engine request -------------------------------------------------------------


def test_engine_request_media_point_at_their_pads(vision, media):
    """MediaInput start/group starts/grid/digest agree with the prompt, and with the mrope span finder."""
    ctx = vision.ctx
    video, image = ir.VideoPart(MP4_URI), ir.ImagePart(PNG_URI)
    conv = ir.Conversation([ir.Message("user", [video, ir.TextPart(QUESTION), image])])
    prepared = asyncio.run(prepare_media(ctx, conv, hold=True))
    assert media.snapshot()["leases"] == 1
    try:
        prompt = ctx.frontend.build_prompt(conv, prepared.items)
        inputs = media_inputs(prompt, prepared)
    finally:
        asyncio.run(prepared.release())
    assert media.snapshot()["leases"] == 0
    ids = prompt.token_ids
    pad = {k: ctx.frontend.tokenizer.token_to_id(f"<|{k}_pad|>") for k in ("image", "video")}
    assert [m.kind for m in inputs] == ["video", "image"]
    assert [m.num_tokens for m in inputs] == [8, 64] and inputs[0].grid_thw == (2, 4, 4)
    assert len(inputs[0].group_starts) == 2 and inputs[1].group_starts == [inputs[1].start]
    for m, item in zip(inputs, prepared.items):
        assert m.digest == item.digest and m.pixel_values is item.pixel_values
        per_group = m.num_tokens // len(m.group_starts)
        for start in m.group_starts:
            assert ids[start:start + per_group] == [pad[m.kind]] * per_group
    assert ids.count(pad["video"]) == 8 and ids.count(pad["image"]) == 64
    found = media_spans(ids, image_grid_thw=[inputs[1].grid_thw], video_grid_thw=[inputs[0].grid_thw])
    assert [(s.start, s.grid_thw, s.kind) for s in found] == [(s.start, s.grid_thw, s.kind) for s in prompt.media_spans]


# ---- generation: an engine without a vision tower ------------------------------------------------------


def test_generation_with_media_is_refused_by_an_engine_without_a_tower(vision, media):
    client = oai(vision)
    for content in ([{"type": "image_url", "image_url": {"url": PNG_URI}}, {"type": "text", "text": QUESTION}],
                    [{"type": "image_url", "image_url": PNG_URI}]):  # the string form too
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}])
        assert err.value.code == "vision_disabled" and "engine" in err.value.message
    with pytest.raises(anthropic.BadRequestError, match="engine"):
        claude(vision).messages.create(model="claude-local", max_tokens=16, messages=[
            {"role": "user", "content": [b64_block(PNG)]}])
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input=[{"role": "user", "content": [input_image(PNG_URI)]}])
    assert err.value.code == "vision_disabled"
    assert media.snapshot()["leases"] == 0  # the refused requests gave their payloads back
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ALPHA"}]).choices


def test_chat_tool_result_images_reach_the_preprocessor(vision):
    messages = [{"role": "user", "content": "WEATHER"},
                {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                      "function": {"name": "look", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "image_url", "image_url": {"url": ""}}]}]
    client = oai(vision)
    messages[2]["content"][0]["image_url"]["url"] = data_uri(CORRUPT, "image/png")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=messages)
    assert (err.value.code, err.value.param) == ("invalid_media", "messages[2].content[0]")
    messages[2]["content"][0]["image_url"]["url"] = PNG_URI
    with pytest.raises(openai.BadRequestError, match="engine"):
        client.chat.completions.create(model=MODEL, messages=messages)


def test_an_expanded_prompt_beyond_the_context_is_context_length_exceeded(vision):
    content = [{"type": "image_url", "image_url": {"url": data_uri(LARGE, "image/png")}}]
    with pytest.raises(openai.BadRequestError) as err:
        oai(vision).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}])
    assert err.value.code == "context_length_exceeded"
    assert err.value.body["max_context"] == MAX_CONTEXT and err.value.body["prompt_tokens"] > 1024


# ---- media errors --------------------------------------------------------------------------------


def test_corrupt_bytes_are_invalid_media_naming_the_field(vision):
    with pytest.raises(openai.BadRequestError) as err:
        count_input(vision, [TEXT, input_image(data_uri(CORRUPT, "image/png"))])
    assert (err.value.code, err.value.param) == ("invalid_media", "input[0].content[1].image_url")
    with pytest.raises(openai.BadRequestError) as err:
        count_input(vision, [{"type": "input_video", "video_url": data_uri(b"\0" * 64, "video/mp4")}])
    assert err.value.code == "invalid_media"
    with pytest.raises(anthropic.BadRequestError) as bad:
        count_messages(vision, [{"role": "user", "content": [b64_block(CORRUPT)]}])
    assert bad.value.status_code == 400 and bad.value.body["error"]["type"] == "invalid_request_error"


def test_unsupported_schemes_are_invalid_media(vision):
    with pytest.raises(openai.BadRequestError) as err:
        oai(vision).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "ftp://example.com/cat.png"}}]}])
    assert err.value.code == "invalid_media"
    with pytest.raises(openai.BadRequestError) as err:
        count_input(vision, [input_image("file:///etc/passwd")])
    assert err.value.code == "invalid_media"
    with pytest.raises(anthropic.BadRequestError, match="http"):
        count_messages(vision, [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "file:///etc/passwd"}}]}])


def test_over_budget_media_is_media_budget_exceeded(vision):
    with pytest.raises(openai.BadRequestError) as err:
        count_input(vision, [input_image(data_uri(HUGE, "image/png"))])
    assert err.value.code == "media_budget_exceeded"
    with pytest.raises(anthropic.BadRequestError, match="vision tokens"):
        count_messages(vision, [{"role": "user", "content": [b64_block(HUGE)]}])


def test_a_failed_fetch_keeps_its_server_error_code(vision, files):
    with pytest.raises(openai.APIStatusError) as err:
        count_input(vision, [input_image(files + "/missing.png")])
    assert (err.value.status_code, err.value.code) == (502, "media_fetch_failed")
    assert err.value.param == "input[0].content[0].image_url"


# ---- without --vision --------------------------------------------------------------------------------


def test_without_vision_media_and_media_counts_are_vision_disabled(plain):
    client = oai(plain)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "video_url", "video_url": MP4_URI}]}])
    assert (err.value.code, err.value.param) == ("vision_disabled", "messages[0].content[0]")
    with pytest.raises(openai.BadRequestError) as err:
        count_input(plain, [input_image(PNG_URI), TEXT])
    assert err.value.code == "vision_disabled"
    with pytest.raises(anthropic.BadRequestError, match="--vision") as bad:
        count_messages(plain, [{"role": "user", "content": [b64_block(PNG)]}])
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert count_messages(plain, [{"role": "user", "content": QUESTION}]) > 0  # text counting is unaffected


def test_ray_media_errors_arrive_as_the_typed_cause():
    """A replica's MediaError reaches the router wrapped by Ray; the client hands on the cause."""
    from ninfer.media import InvalidMediaError
    from ninfer.server.media_client import RayMediaClient

    class Wrapped(Exception):  # what Ray raises around a replica's exception
        def __init__(self, cause):
            super().__init__(str(cause))
            self.cause = cause

    class Method:
        async def remote(self, *args, **kwargs):
            raise Wrapped(InvalidMediaError("bad bytes", item=1))

    class Handle:
        prepare = Method()

    with pytest.raises(InvalidMediaError) as err:
        asyncio.run(RayMediaClient(Handle()).prepare([], timeout_s=None, hold=False))
    assert err.value.item == 1 and err.value.code == "invalid_media"
