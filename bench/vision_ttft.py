"""Vision on the device (issue 22's benchmark): media preparation (cache miss against hit), the vision
tower's encode, and engine TTFT for a 1024x1024 image and a 10 s video at a text shape, with a second
request that reuses the prefix (the media inside it is not encoded again).

Random weights built on the device (text: the preset; tower: the Qwen3.5 shape with the text's hidden
size); media made here (a noise PNG, an H.264 MP4 of moving noise). One JSON line per measurement.

    python bench/vision_ttft.py --shape qwen3.6-27b
    python bench/vision_ttft.py --dry-run     # tiny shapes on the CPU: the harness itself
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import time

import numpy as np
import torch

VISION_27B = {"depth": 27, "hidden_size": 1152, "num_heads": 16, "intermediate_size": 4304, "in_channels": 3,
              "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 2304,
              "hidden_act": "gelu_pytorch_tanh"}
IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END = 248056, 248057, 248053, 248054


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def png_uri(side: int) -> str:
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def mp4_uri(seconds: int, width: int, height: int, fps: int = 24) -> str:
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        rng = np.random.default_rng(1)
        base = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        for i in range(seconds * fps):
            frame = av.VideoFrame.from_ndarray(np.roll(base, i * 4, axis=1), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return "data:video/mp4;base64," + base64.b64encode(buf.getvalue()).decode()


def prompt_with(item, text: list[int]):
    """Prompt ids with the item's pad runs (a video's groups separated by three text tokens, standing in
    for the timestamp text) and its MediaInput."""
    from ninfer.engine.types import MediaInput

    ids, starts = list(text), []
    groups = item.grid_thw[0] if item.modality == "video" else 1
    per_group = item.num_tokens // groups
    pad = VIDEO_PAD if item.modality == "video" else IMAGE_PAD
    for g in range(groups):
        if g:
            ids += text[:3]
        ids.append(VISION_START)
        starts.append(len(ids))
        ids += [pad] * per_group
        ids.append(VISION_END)
    ids += text
    media = MediaInput(start=starts[0], num_tokens=item.num_tokens, grid_thw=tuple(item.grid_thw), kind=item.modality,
                       digest=item.digest, pixel_values=item.pixel_values, group_starts=starts)
    return ids, [media]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3.6-27b")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    from ninfer.artifact.presets import TINY_VISION_CONFIG, get_preset
    from ninfer.engine.engine import EngineSettings
    from ninfer.engine.loader import engine_from_preset
    from ninfer.engine.types import EngineRequest, SamplingParams, TokenEvent
    from ninfer.media.preprocessor import MediaPreprocessor
    from ninfer.media.types import MediaItem
    from ninfer.models.vision import build_vision_tower

    if args.dry_run:
        args.shape = "tiny-qwen3.6"
    side, video = (64, (2, 96, 64)) if args.dry_run else (1024, (10, 640, 360))
    hidden = get_preset(args.shape).text_config()["hidden_size"]
    settings = EngineSettings(max_context=16384, kv_capacity=16384, max_concurrency=1, prefill_chunk=1024, vision=True)
    engine = engine_from_preset(args.shape, settings, start=False)
    device, dtype = engine.device, (torch.bfloat16 if engine.device.type == "cuda" else torch.float32)
    config = dict(TINY_VISION_CONFIG if args.dry_run else VISION_27B, out_hidden_size=hidden)
    with torch.device(device):
        tower = build_vision_tower(config)
    tower.init_random_(0)
    engine.runner.vision_tower = tower.to(device=device, dtype=dtype).eval()
    engine.start()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    prep = MediaPreprocessor(cache_mib=1024, live_mib=4096)
    sources = {"image": png_uri(side), "video": mp4_uri(*video)}
    text = [(31 * j) % 5000 + 100 for j in range(32)]
    greedy = SamplingParams(temperature=0.0)
    try:
        for kind, source in sources.items():
            timings = []
            for attempt in ("miss", "hit"):
                t = time.perf_counter()
                batch = prep.prepare([MediaItem(kind, source)])
                timings.append(time.perf_counter() - t)
                if attempt == "miss":
                    item = batch.items[0]
                    prep.release(batch.lease)
                else:
                    prep.release(batch.lease)
            emit(kind="media_prepare", media=kind, grid_thw=list(item.grid_thw), vision_tokens=item.num_tokens,
                 miss_s=timings[0], hit_s=timings[1])
            pixels = item.pixel_values.to(device=device, dtype=dtype)
            encode = []
            with torch.inference_mode():
                for _ in range(3):
                    sync()
                    t = time.perf_counter()
                    engine.runner.vision_tower(pixels, [tuple(item.grid_thw)])
                    sync()
                    encode.append(time.perf_counter() - t)
            emit(kind="vision_encode", shape=args.shape, media=kind, patches=int(pixels.shape[0]),
                 encode_ms=min(encode) * 1e3, first_ms=encode[0] * 1e3)
            ids, media = prompt_with(item, text)
            for attempt in ("cold", "reused"):
                request = EngineRequest(f"{kind}-{attempt}", ids, sampling=greedy, max_tokens=2, media=media)
                t = time.perf_counter()
                events = engine.generate(request)
                out = [i for ev in events if isinstance(ev, TokenEvent) for i in ev.token_ids]
                finish = events[-1]
                emit(kind="vision_ttft", shape=args.shape, media=kind, attempt=attempt, prompt_tokens=len(ids),
                     cached_tokens=finish.usage.cached_tokens, ttft_ms=finish.timings.prompt_ms,
                     wall_ms=(time.perf_counter() - t) * 1e3)
                # the next turn: the retained endpoint (prompt + the first output token, whose KV is computed)
                # and one more token, so the media lie inside the reused prefix
                ids = ids + out[:1] + [7]
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
