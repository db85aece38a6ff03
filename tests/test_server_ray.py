"""One real Ray Serve run from a YAML config: chat, stream, cancel by disconnect, clean shutdown, and ninfer's
edge in Serve's proxy (fresh x-request-ids, keepalive on accepted connections).

The config is configs/tiny.yaml with the scripted artifact and a free port, started with
`serve run` in its own process group (stopped with SIGTERM, as an operator would) and its own
Ray temp dir, so the engine can be inspected through its deployment handle without touching
any other Ray instance on the machine.
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from process_helpers import processes_mentioning
from server_fixtures import MODEL, free_port, scripted_artifact, wait_until

from ninfer.server.proxy_edge import PROXY_CALLBACK, PROXY_CALLBACK_ENV

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = """
import json, ray, time
from ray import serve
ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
engine = serve.get_deployment_handle("Engine", app_name="ninfer")
deadline = time.monotonic() + 20
while True:
    snap = engine.snapshot.remote().result()
    if snap["running"] == snap["held_requests"] == 0 or time.monotonic() > deadline:
        break
    time.sleep(0.2)
print(json.dumps({k: snap[k] for k in ("running", "held_requests", "kv_pages_used", "requests")}))
"""


def serve_config(artifact: Path, port: int) -> dict:
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg["http_options"]["port"] = port
    args = cfg["applications"][0]["args"]
    # no retained prefixes, so a cancelled request must leave the KV pool empty
    args.update(artifact=str(artifact), max_context=4096, no_prefix_reuse=True, vision=True)
    args.pop("dtype", None)  # the scripted model has no linears for the config's int8 weights
    return cfg


@pytest.mark.ray
@pytest.mark.slow
def test_serve_run_from_yaml_end_to_end(artifacts_dir, qwen_tokenizer):
    serve_bin = Path(sys.executable).parent / "serve"
    if not serve_bin.exists():
        pytest.skip("Ray Serve CLI not installed")
    work = Path(tempfile.mkdtemp(prefix="nr", dir="/tmp"))  # short: Ray's unix socket paths must fit
    port = free_port()
    config = work / "serve.yaml"
    config.write_text(yaml.safe_dump(serve_config(scripted_artifact(artifacts_dir, qwen_tokenizer), port)))
    env = {**os.environ, "RAY_TMPDIR": str(work), "RAY_USAGE_STATS_ENABLED": "0",
           PROXY_CALLBACK_ENV: PROXY_CALLBACK}  # as `make serve` starts it
    log = open(work / "serve.log", "wb")
    proc = subprocess.Popen([str(serve_bin), "run", str(config)], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        assert wait_until(healthy, timeout=150, interval=1), (work / "serve.log").read_text()[-3000:]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "ALPHA"}]

        # the proxy's edge (ninfer.server.proxy_edge): a client-sent x-request-id is replaced by a fresh one
        ids = []
        for _ in range(2):
            raw = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": messages}, timeout=60,
                             headers={"x-request-id": "chosen-by-client"})
            assert raw.status_code == 200 and len(raw.headers.get_list("x-request-id")) == 1
            assert raw.json()["choices"][0]["message"]["content"] == "The answer is 4."
            ids.append(raw.headers["x-request-id"])
        assert len(set(ids)) == 2 and "chosen-by-client" not in ids, ids
        _assert_proxy_connections_keepalive(port)

        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                     stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "The answer is 4."
        assert chunks[-1].usage.completion_tokens > 0

        # media through the MediaPreprocessor deployment: an image is prepared there and its pads counted
        text_only = {"model": MODEL, "messages": [{"role": "user", "content": "Describe it."}]}
        with_image = {"model": MODEL, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _png_base64(64, 32)}},
            {"type": "text", "text": "Describe it."}]}]}
        counts = [httpx.post(url + "/v1/messages/count_tokens", json=body, timeout=60) for body in (text_only, with_image)]
        assert [c.status_code for c in counts] == [200, 200], [c.text for c in counts]
        # the image adds its pads (as ninfer.media prepares it here, in the test) between vision start and end
        pads = _pads_of(_png_base64(64, 32))
        assert counts[1].json()["input_tokens"] - counts[0].json()["input_tokens"] == pads + 2
        bad = httpx.post(url + "/v1/messages/count_tokens", timeout=60, json={"model": MODEL, "messages": [
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": base64.b64encode(b"not a png").decode()}}]}]})
        error = bad.json()["error"]  # Anthropic's shape: the field first, no code (contract: invalid media is a 400)
        assert bad.status_code == 400 and error["type"] == "invalid_request_error", bad.text
        assert error["message"].startswith("messages[0].content[0].source"), bad.text

        long_request = {"model": MODEL, "messages": [{"role": "user", "content": "LONG"}], "stream": True,
                        "max_tokens": 2500}
        with httpx.Client(timeout=60) as http, http.stream("POST", url + "/v1/chat/completions",
                                                           json=long_request) as r:
            lines = r.iter_lines()
            for _ in range(8):
                next(lines)
        # the connection is closed mid-stream: Serve cancels the router call, which cancels the engine's
        snap = subprocess.run([sys.executable, "-c", SNAPSHOT], env=env, capture_output=True, text=True, timeout=90)
        state = json.loads(snap.stdout.strip().splitlines()[-1])
        assert state["running"] == 0 and state["kv_pages_used"] == 0, state
        assert state["held_requests"] == 0, state  # every router call released its lifetime slot
        assert state["requests"].get("cancelled", 0) >= 1, state
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            log.close()
    assert proc.returncode is not None
    # Serve's HTTP proxy and this cluster's GCS and raylet (their command lines name its temp dir) stop too
    assert wait_until(lambda: not healthy() and not processes_mentioning(str(work)), timeout=30)
    shutil.rmtree(work, ignore_errors=True)


def _assert_proxy_connections_keepalive(port: int) -> None:
    """The proxy's end of an open keep-alive connection runs a keepalive timer (contract, "Endpoints"); the
    exact option values are read back in process by test_server_http."""
    if shutil.which("ss") is None:
        return  # iproute2's ss is the only window into another process's socket timers here
    with httpx.Client(timeout=30) as http:
        assert http.get(f"http://127.0.0.1:{port}/health").status_code == 200
        shown = subprocess.run(["ss", "-tnoH", "state", "established", f"( sport = :{port} )"],
                               capture_output=True, text=True, timeout=10).stdout
    assert "keepalive" in shown, shown


def _png_base64(width: int, height: int) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _pads_of(png_base64: str) -> int:
    from ninfer.media.preprocessor import MediaPreprocessor
    from ninfer.media.types import MediaItem

    prep = MediaPreprocessor(threads=1)
    try:
        batch = prep.prepare([MediaItem("image", "data:image/png;base64," + png_base64)], hold=False)
        return batch.items[0].num_tokens
    finally:
        prep.close()
