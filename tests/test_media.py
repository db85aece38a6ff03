"""ninfer.media: fetching, image/video preparation, the patch layout, the payload cache, the pool."""

from __future__ import annotations

import base64
import io
import pickle
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import av
import numpy as np
import pytest
import torch
from PIL import Image

from ninfer.media import (
    InvalidMediaError,
    MediaBudgetExceededError,
    MediaFetchError,
    MediaItem,
    MediaLimits,
    MediaPreprocessor,
    MediaTimeoutError,
    media_digest,
    patches,
)
from ninfer.media.cache import PayloadCache
from ninfer.media.errors import MediaError
from ninfer.media.fetch import Fetcher, decode_data_uri
from ninfer.media.image import prepare_image
from ninfer.media.types import MIB, PreparedMedia
from ninfer.media.video import group_timestamps, prepare_video, sample_indices

# ---- media made in the test -------------------------------------------------------------------


def image_bytes(height: int, width: int, mode: str = "RGB", fmt: str = "PNG", seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 4 if mode == "RGBA" else 3), dtype=np.uint8)
    image = Image.fromarray(pixels, "RGBA" if mode == "RGBA" else "RGB")
    if mode not in ("RGB", "RGBA"):
        image = image.convert(mode)
    buf = io.BytesIO()
    image.save(buf, fmt)
    return buf.getvalue()


def mp4_bytes(seconds: float = 3, fps: int = 10, width: int = 64, height: int = 48) -> bytes:
    """A real H.264 MP4 whose frame i is a flat grey of level 8 * i (so frames are recognisable)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("h264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(int(seconds * fps)):
            frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), 8 * i % 256, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


PNG = image_bytes(300, 500)
MP4 = mp4_bytes()


def no_reserve(nbytes: int) -> None:
    pass


# ---- a local HTTP server ------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep test output clean
        pass

    def do_GET(self):
        if self.path == "/img.png":
            self._send(PNG)
        elif self.path == "/clip.mp4":
            self._send(MP4, "video/mp4")
        elif self.path == "/slow.png":
            time.sleep(1.5)
            self._send(PNG)
        elif self.path == "/stall.png":  # headers and a little of the body, then nothing for a while
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            try:
                self.wfile.write(PNG[:50])
                self.wfile.flush()
                time.sleep(3.0)
            except OSError:
                pass
        elif self.path == "/big.png":  # declares its size up front
            self.send_response(200)
            self.send_header("Content-Length", str(10 * MIB))
            self.end_headers()
        elif self.path == "/chunked.png":  # no length: the limit must hold while reading
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            chunk = b"x" * 65536
            try:
                for _ in range(40):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                pass  # the client hung up at its limit
        else:
            self.send_error(404)

    def _send(self, body: bytes, mime: str = "image/png") -> None:
        self.send_response(200)
        self.send_header("Content-Type", mime)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:
            pass  # the client gave up first (the timeout case)


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def pre():
    media = MediaPreprocessor(cache_mib=64, live_mib=128, threads=2,
                              limits=MediaLimits(max_item_source_bytes=1 * MIB, fetch_timeout_s=0.5))
    yield media
    media.close()


# ---- layout parity ------------------------------------------------------------------------------


def _hf_image_processor():
    module = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    # the Qwen3.5 preprocessor config: patch 16, merge 2, temporal 2, mean = std = 0.5
    return module.Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
        size={"shortest_edge": patches.IMAGE_MIN_PIXELS, "longest_edge": patches.IMAGE_MAX_PIXELS})


@pytest.mark.parametrize("height,width,mode,fmt", [
    (300, 500, "RGB", "PNG"), (217, 129, "RGBA", "PNG"), (640, 480, "RGB", "JPEG"),
    (40, 1000, "L", "PNG"), (90, 70, "P", "PNG"),
])
def test_image_patches_equal_transformers_qwen2vl_processor(height, width, mode, fmt):
    data = image_bytes(height, width, mode, fmt)
    ours = prepare_image(data, "d", MediaLimits(), no_reserve)
    ref = _hf_image_processor()(Image.open(io.BytesIO(data)), return_tensors="pt")
    assert ours.grid_thw == tuple(ref["image_grid_thw"][0].tolist())
    assert ours.pixel_values.dtype == torch.bfloat16
    assert torch.equal(ours.pixel_values, ref["pixel_values"].to(torch.bfloat16))


def test_smart_resize_equals_transformers_for_images_and_video():
    image_mod = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    video_mod = pytest.importorskip("transformers.models.qwen3_vl.video_processing_qwen3_vl")
    sizes = [(1, 1), (16, 16), (31, 33), (48, 80), (300, 500), (1080, 1920), (4000, 3000), (10000, 60), (8192, 8192)]
    for h, w in sizes:
        assert patches.image_size(h, w) == image_mod.smart_resize(
            h, w, factor=32, min_pixels=patches.IMAGE_MIN_PIXELS, max_pixels=patches.IMAGE_MAX_PIXELS)
        for frames in (2, 5, 64, 768):
            budget = patches.video_frame_budget(frames)
            assert patches.video_size(frames, h, w, max_pixels=budget) == video_mod.smart_resize(
                frames, h, w, temporal_factor=2, factor=32, min_pixels=patches.VIDEO_MIN_PIXELS, max_pixels=budget)


def test_video_sampling_timestamps_and_layout_equal_transformers():
    video_mod = pytest.importorskip("transformers.models.qwen3_vl.video_processing_qwen3_vl")
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    proc = video_mod.Qwen3VLVideoProcessor()
    for total, fps in ((30, 10.0), (7, 30.0), (3000, 25.0), (100000, 60.0), (11, 2.0)):
        ref = proc.sample_frames(VideoMetadata(total_num_frames=total, fps=fps))
        ours = sample_indices(total, fps)
        assert ours.tolist() == ref.tolist()
        assert list(group_timestamps(ours, fps)) == Qwen3VLProcessor._calculate_timestamps(None, ref, fps, 2)

    rng = np.random.default_rng(1)
    frames = rng.integers(0, 256, (5, 64, 96, 3), dtype=np.uint8)  # odd: the last frame is repeated
    normalized = torch.from_numpy(patches._LUT[frames]).view(torch.bfloat16).float()
    ref, t, h, w = proc.patchify(normalized.permute(0, 3, 1, 2)[None].contiguous(), 16, 2, 2)
    assert (t, h, w) == patches.grid_thw(5, 64, 96)
    assert torch.equal(patches.pack(frames), ref[0].to(torch.bfloat16))


def test_pack_layout_by_index_arithmetic():
    """An independent statement of the layout: value (frame f, y, x, channel c) lands at row
    ((g * H/32 + y//32) * W/32 + x//32) * 4 + (y//16 % 2) * 2 + x//16 % 2 of group g = f // 2,
    column c * 512 + (f % 2) * 256 + (y % 16) * 16 + x % 16."""
    t, height, width = 4, 64, 96
    codes = np.arange(t * height * width * 3, dtype=np.int64).reshape(t, height, width, 3)
    frames = (codes % 251).astype(np.uint8)
    packed = patches.pack(frames)
    values = torch.from_numpy(patches._LUT).view(torch.bfloat16)
    expect = torch.empty_like(packed)
    for f in range(t):
        for y in range(height):
            for x in range(width):
                row = (((f // 2) * (height // 32) + y // 32) * (width // 32) + x // 32) * 4 \
                    + (y // 16 % 2) * 2 + x // 16 % 2
                for c in range(3):
                    expect[row, c * 512 + (f % 2) * 256 + (y % 16) * 16 + x % 16] = values[frames[f, y, x, c]]
    assert torch.equal(packed, expect)


def test_single_image_is_repeated_in_time_and_counts_merged_tokens():
    item = prepare_image(image_bytes(64, 96), "d", MediaLimits(), no_reserve)
    assert item.grid_thw == (1, 14, 20)  # 64x96 is below min_pixels: scaled up to 224x320
    assert item.num_tokens == 14 * 20 // 4
    by_frame = item.pixel_values.reshape(-1, 3, 2, 256)  # (patch, channel, frame, pixel)
    assert torch.equal(by_frame[:, :, 0], by_frame[:, :, 1])


# ---- video ------------------------------------------------------------------------------------


def test_mp4_video_is_sampled_packed_and_timestamped():
    claims = []
    item = prepare_video(MP4, "d", MediaLimits(), claims.append)
    # 30 frames at 10 fps, sampled at 2 fps: 6 frames (0, 6, 12, 17, 23, 29) -> 3 temporal groups
    assert item.grid_thw == (3, 4, 4)
    assert item.timestamps == pytest.approx((0.3, 1.45, 2.6))
    assert item.num_tokens == 12 and item.tokens_per_group == 4
    assert claims[-1] == item.nbytes
    # frame levels survive the codec roughly: group 0 holds frames 0 and 6 (grey 0 and 48)
    values = item.pixel_values.float().reshape(3, 16, 3, 2, 256)
    level = (values + 1) * 127.5
    assert abs(level[0, :, :, 0].mean().item() - 0) < 8
    assert abs(level[0, :, :, 1].mean().item() - 48) < 8
    assert abs(level[2, :, :, 1].mean().item() - 8 * 29) < 8


def test_corrupt_video_is_invalid_media():
    with pytest.raises(InvalidMediaError):
        prepare_video(b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 64, "d", MediaLimits(), no_reserve)
    with pytest.raises(InvalidMediaError):
        prepare_video(PNG[:100], "d", MediaLimits(), no_reserve)


# ---- fetch --------------------------------------------------------------------------------------


def test_data_uris_decode_and_reject_bad_base64():
    assert decode_data_uri(data_uri(PNG), 1 * MIB) == PNG
    wrapped = "data:image/png;base64," + "\n".join(base64.b64encode(b"abcdef" * 30).decode()[i:i + 76]
                                                  for i in range(0, 240, 76))
    assert decode_data_uri(wrapped, 1 * MIB) == b"abcdef" * 30
    assert decode_data_uri("data:text/plain,a%20b", 100) == b"a b"
    for bad in ("data:image/png;base64,@@@@", "data:image/png;base64,abc", "data:image/png;base64", "data:,"):
        with pytest.raises(InvalidMediaError):
            decode_data_uri(bad, 1 * MIB)
    with pytest.raises(MediaBudgetExceededError):
        decode_data_uri(data_uri(PNG), 1000)


def test_unsupported_schemes_are_invalid_media():
    fetcher = Fetcher(1 * MIB)
    for source in ("ftp://example.com/a.png", "file:///etc/passwd", "/tmp/a.png", "", "http://"):
        with pytest.raises(InvalidMediaError):
            fetcher.acquire(source)
    fetcher.close()


def test_http_fetch_success_error_timeout_and_oversize(server):
    fetcher = Fetcher(1 * MIB, timeout_s=0.5)
    assert fetcher.acquire(f"{server}/img.png") == PNG
    with pytest.raises(MediaFetchError) as err:
        fetcher.acquire(f"{server}/nope.png?token=secret")
    assert err.value.code == "media_fetch_failed" and err.value.status == 502
    assert "secret" not in err.value.message
    with pytest.raises(MediaTimeoutError) as err:
        fetcher.acquire(f"{server}/slow.png")
    assert err.value.code == "media_timeout" and err.value.status == 504
    for path in ("/big.png", "/chunked.png"):
        with pytest.raises(MediaBudgetExceededError):
            fetcher.acquire(server + path)
    fetcher.close()
    refused = Fetcher(1 * MIB, timeout_s=0.5)
    with pytest.raises(MediaFetchError):
        refused.acquire("http://127.0.0.1:9/x.png")  # the discard port: nothing listens
    refused.close()


def test_a_stalled_body_is_abandoned_at_the_requests_deadline(server):
    """Contract, "Execution behavior": --pending-timeout-ms is an absolute deadline that covers media acquisition.
    A peer that sends headers and then stalls was waited for the client's whole 30 s read timeout, holding one of
    the preprocessing pool's few threads (a couple of such URLs starved every media request on the server)."""
    fetcher = Fetcher(1 * MIB)  # the server's 30 s timeouts
    started = time.monotonic()
    with pytest.raises(MediaTimeoutError):
        fetcher.acquire(f"{server}/stall.png", deadline=started + 0.3)
    assert time.monotonic() - started < 2.0  # the stall lasts 3 s
    with pytest.raises(MediaTimeoutError):  # a deadline already past: no connection at all
        fetcher.acquire(f"{server}/img.png", deadline=time.monotonic() - 1)
    fetcher.close()


# ---- the preprocessor ---------------------------------------------------------------------------


def test_prepare_image_and_video_from_url_and_data_uri(pre, server):
    batch = pre.prepare([MediaItem("image", data_uri(PNG)), {"type": "video", "source": f"{server}/clip.mp4"},
                         MediaItem("image", f"{server}/img.png")])
    image, video, same_image = batch.items
    assert (image.modality, video.modality) == ("image", "video")
    assert image.digest == media_digest("image", PNG) and same_image is image  # same bytes, one payload
    assert video.timestamps and video.grid_thw[0] == len(video.timestamps)
    stats = batch.stats
    assert stats.items == 3 and stats.source_bytes == 2 * len(PNG) + len(MP4)
    assert stats.cache_misses + stats.single_flight_joins + stats.cache_hits == 3
    assert stats.vision_tokens == image.num_tokens * 2 + video.num_tokens
    assert stats.payload_bytes == 2 * image.nbytes + video.nbytes
    assert stats.wall_seconds > 0 and stats.work_seconds > 0
    assert pre.cache.live_bytes == image.nbytes + video.nbytes
    assert pre.release(batch.lease) and not pre.release(batch.lease)


def test_batch_and_errors_pickle(pre):
    batch = pre.prepare([MediaItem("image", data_uri(PNG))])
    copy = pickle.loads(pickle.dumps(batch))
    assert torch.equal(copy.items[0].pixel_values, batch.items[0].pixel_values)
    assert copy.items[0].grid_thw == batch.items[0].grid_thw and copy.stats == batch.stats
    err = pickle.loads(pickle.dumps(InvalidMediaError("bad", item=3)))
    assert (type(err), err.item, err.code, str(err)) == (InvalidMediaError, 3, "invalid_media", "bad")
    pre.release(batch.lease)


def test_corrupt_bytes_and_bad_sources_name_their_item(pre):
    truncated = PNG[: len(PNG) // 2]
    cases = [("data:image/png;base64," + base64.b64encode(b"not an image").decode(), InvalidMediaError),
             (data_uri(truncated), InvalidMediaError),
             ("ftp://host/x.png", InvalidMediaError),
             ("data:image/png;base64,%%%", InvalidMediaError)]
    for source, kind in cases:
        with pytest.raises(kind) as err:
            pre.prepare([MediaItem("image", data_uri(PNG)), MediaItem("image", source)])
        assert err.value.item == 1 and err.value.code == "invalid_media"
    assert pre.cache.live_bytes == pre.cache.cached_bytes  # the good item's request reference came back
    with pytest.raises(InvalidMediaError):
        pre.prepare([{"type": "audio", "source": "data:,x"}])


def test_budget_rejections_are_media_budget_exceeded(server):
    small = MediaPreprocessor(cache_mib=0, live_mib=1, threads=2)  # a 1 MiB live budget
    big = image_bytes(1024, 1024)  # 32 x 32 merge blocks: 4096 patches, 12 MiB of bf16
    with pytest.raises(MediaBudgetExceededError) as err:
        small.prepare([MediaItem("image", data_uri(big))])
    assert err.value.code == "media_budget_exceeded" and err.value.status == 400
    assert small.cache.live_bytes == 0
    small.close()

    capped = MediaPreprocessor(threads=2, limits=MediaLimits(max_request_tokens=300, max_image_pixels=10**6))
    item = MediaItem("image", data_uri(PNG))  # 144 tokens each
    capped.release(capped.prepare([item, item]).lease)
    with pytest.raises(MediaBudgetExceededError):
        capped.prepare([item, item, item])
    with pytest.raises(MediaBudgetExceededError):
        capped.prepare([MediaItem("image", data_uri(image_bytes(1001, 1000)))])  # over the pixel limit
    assert capped.cache.live_bytes == capped.cache.cached_bytes  # no request reference leaked
    capped.close()


def test_second_request_hits_the_cache(pre):
    item = MediaItem("image", data_uri(PNG))
    first = pre.prepare([item])
    second = pre.prepare([item])
    assert (first.stats.cache_misses, second.stats.cache_hits, second.stats.work_seconds) == (1, 1, 0.0)
    assert second.items[0] is first.items[0]
    assert media_digest("image", PNG) != media_digest("video", PNG)
    pre.release(first.lease)
    pre.release(second.lease)


def test_concurrent_identical_misses_build_once():
    cache = PayloadCache(cache_bytes=64 * MIB, live_bytes=64 * MIB)
    started, proceed, calls = threading.Event(), threading.Event(), []
    payload = PreparedMedia("image", "k", torch.zeros(4, 1536, dtype=torch.bfloat16), (1, 2, 2))

    def build(reserve):
        calls.append(1)
        reserve(payload.nbytes)
        started.set()
        proceed.wait(5)
        return payload

    results = {}

    def run(name):
        results[name] = cache.acquire("k", build)

    a = threading.Thread(target=run, args=("a",))
    a.start()
    started.wait(5)
    b = threading.Thread(target=run, args=("b",))
    b.start()
    time.sleep(0.05)  # b is waiting on a's flight
    proceed.set()
    a.join(5)
    b.join(5)
    assert len(calls) == 1 and cache.builds == 1
    assert sorted(how for _, how in results.values()) == ["joined", "miss"]
    assert results["a"][0] is results["b"][0]
    cache.release("k")
    cache.release("k")
    assert cache.live_bytes == payload.nbytes  # only the cache's retention remains


def test_a_failed_build_fails_its_joiners_and_returns_its_claim():
    cache = PayloadCache(cache_bytes=MIB, live_bytes=MIB)
    started, proceed = threading.Event(), threading.Event()

    def build(reserve):
        reserve(1000)
        started.set()
        proceed.wait(5)
        raise InvalidMediaError("broken")

    errors = []

    def run():
        try:
            cache.acquire("k", build)
        except InvalidMediaError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    threads[0].start()
    started.wait(5)
    threads[1].start()
    time.sleep(0.05)
    proceed.set()
    for t in threads:
        t.join(5)
    assert len(errors) == 2 and cache.live_bytes == 0 and cache.builds == 1


def _payload(key: str, rows: int) -> PreparedMedia:
    return PreparedMedia("image", key, torch.zeros(rows, 1536, dtype=torch.bfloat16), (1, rows // 2, 2))


def test_cache_eviction_keeps_referenced_payloads_live_until_released():
    size = _payload("x", 64).nbytes  # 192 KiB
    cache = PayloadCache(cache_bytes=size, live_bytes=3 * size)  # the cache retains one payload
    a, _ = cache.acquire("a", lambda reserve: _payload("a", 64))
    cache.acquire("b", lambda reserve: _payload("b", 64))  # evicts a from the cache; a is still referenced
    assert cache.cached_bytes == size and cache.live_bytes == 2 * size
    again, how = cache.acquire("a", lambda reserve: pytest.fail("a is live: no rebuild"))
    assert how == "hit" and again is a  # and a is retained again, b leaves the cache but stays referenced
    cache.release("a")
    cache.release("a")
    assert cache.live_bytes == 2 * size  # a is cached, b referenced
    cache.release("b")
    assert cache.live_bytes == size and cache.cached_bytes == size  # b's bytes returned on its last release
    # a new build that needs room evicts unreferenced cached payloads rather than failing
    cache.acquire("c", lambda reserve: (reserve(3 * size), _payload("c", 192))[1])
    assert cache.live_bytes == 3 * size and cache.cached_bytes == 0
    with pytest.raises(MediaBudgetExceededError):
        cache.acquire("d", lambda reserve: (reserve(size), _payload("d", 64))[1])
    assert cache.live_bytes == 3 * size


def test_a_build_waits_for_live_memory_until_its_deadline():
    size = _payload("x", 64).nbytes
    cache = PayloadCache(cache_bytes=0, live_bytes=size)
    cache.acquire("a", lambda reserve: _payload("a", 64))
    threading.Timer(0.1, cache.release, args=("a",)).start()
    start = time.monotonic()
    _, how = cache.acquire("b", lambda reserve: (reserve(size), _payload("b", 64))[1], deadline=start + 5)
    assert how == "miss" and 0.05 < time.monotonic() - start < 4
    cache.release("b")
    assert cache.live_bytes == 0


def test_no_retention_returns_live_bytes_on_release():
    media = MediaPreprocessor(cache_mib=0, live_mib=64, threads=1)
    item = MediaItem("image", data_uri(PNG))
    batch = media.prepare([item])
    assert media.cache.live_bytes == batch.items[0].nbytes and media.cache.cached_bytes == 0
    media.release(batch.lease)
    assert media.cache.live_bytes == 0
    unheld = media.prepare([item], hold=False)
    assert unheld.lease is None and unheld.stats.cache_misses == 1 and media.cache.live_bytes == 0
    media.close()


def test_threads_default_and_gate_size():
    media = MediaPreprocessor(live_mib=2048)
    assert 1 <= media.threads <= 16
    assert media.gate_permits == 5  # 2048 MiB over the 384 MiB largest request payload
    media.close()


def test_every_media_error_has_a_code_and_status():
    for kind in (InvalidMediaError, MediaBudgetExceededError, MediaFetchError, MediaTimeoutError):
        assert issubclass(kind, MediaError) and kind.code != MediaError.code and kind.status in (400, 502, 504)
