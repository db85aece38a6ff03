"""Single-stream decode tok/s through the HTTP server (streaming Chat Completions), per prompt length.

  python bench/http_decode.py --launch configs/tiny.yaml --prompt-len 128 1000 3000 6000   # serve run, measure, stop
  python bench/http_decode.py --url http://127.0.0.1:8080 --prompt-len 128                # a server already up
  python bench/http_decode.py --launch configs/tiny.yaml --set dtype=fp32 ...              # override config args

One JSON line per prompt length: the client's decode rate, (completion tokens - 1) over the time from the
first to the last content chunk (what a streaming client sees: engine, Ray handle, router, SSE), the
median of --repeats requests, and the server's own `timings.predicted_per_second` beside it. Prompts are
a numbered filler text of about --prompt-len tokens (the reported prompt_tokens is exact) ending in a
request for a long story, so greedy decoding runs to --max-tokens (SmolLM2); each request starts with a
fresh nonce, so no prefix is reused. --launch starts `serve run` as `make serve` does (in its own process
group, stopped with SIGTERM at the end); --set key=value overrides the config's application args.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TASK = "\n\nIgnore the notes. Write a long story about a dragon who learns to bake bread. Make it at least 500 words."


def _filler_line(i: int) -> str:
    return f"Note {i}: on day {i} the baker sold {i % 17 + 3} loaves and {i % 5} cakes.\n"


class Prompts:
    """User messages whose chat prompt is about N tokens: the artifact's tokenizer sizes the filler, and the
    template's own tokens (measured once against the server's prompt_tokens) are subtracted."""

    def __init__(self, artifact: str):
        from ninfer.artifact.container import Artifact
        from ninfer.tokenizer import Tokenizer

        self.tok = Tokenizer.from_json_str(Artifact(artifact).tokenizer_json)
        self.overhead = 0

    def count(self, text: str) -> int:
        return len(self.tok.encode(text))

    def message(self, tokens: int, nonce: int) -> str:
        head = f"[{nonce}] Read these notes.\n"
        budget = max(0, tokens - self.overhead - self.count(head) - self.count(TASK))
        lines, used, i = [], 0, 1
        while used < budget:
            line = _filler_line(i)
            lines.append(line)
            used += self.count(line)
            i += 1
        body = "".join(lines)
        if used > budget:  # trim the last line's tokens
            ids = self.tok.encode(body)[:budget]
            body = self.tok.decode(ids)
        return head + body + TASK


def _stream(client: httpx.Client, url: str, model: str, content: str, max_tokens: int) -> dict:
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": max_tokens,
            "temperature": 0, "messages": [{"role": "user", "content": content}]}
    t0 = time.perf_counter()
    first = last = None
    usage, timings = None, None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk.get("choices") and (chunk["choices"][0].get("delta") or {}).get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
    tokens = usage["completion_tokens"]
    span = (last - first) if first is not None else 0.0
    return {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": tokens, "ttft_s": (first or t0) - t0,
            "decode_tokens_per_s": (tokens - 1) / span if span > 0 and tokens > 1 else 0.0,
            "server_predicted_per_s": (timings or {}).get("predicted_per_second")}


def measure(client, url, model, prompts: Prompts, length: int, args, nonce: list[int]) -> dict:
    runs = []
    for _ in range(args.repeats):
        nonce[0] += 1
        runs.append(_stream(client, url, model, prompts.message(length, nonce[0]), args.max_tokens))
    rates = [r["decode_tokens_per_s"] for r in runs]
    return {"prompt_len": length, "prompt_tokens": runs[0]["prompt_tokens"],
            "completion_tokens": [r["completion_tokens"] for r in runs],
            "decode_tokens_per_s": statistics.median(rates), "decode_tokens_per_s_runs": rates,
            "server_predicted_per_s": statistics.median(r["server_predicted_per_s"] or 0.0 for r in runs),
            "ttft_s": statistics.median(r["ttft_s"] for r in runs)}


def _launch(config: str, overrides: list[str], work: str) -> tuple[subprocess.Popen, str, str]:
    """serve run the config (args overridden, written to `work`) in its own process group, its stderr to
    work/serve.log; returns the process, its URL and the artifact."""
    cfg = yaml.safe_load(Path(config).read_text())
    app_args = cfg["applications"][0]["args"]
    for item in overrides:
        key, _, value = item.partition("=")
        app_args[key] = yaml.safe_load(value)
    path = os.path.join(work, "serve.yaml")
    Path(path).write_text(yaml.safe_dump(cfg))
    http = cfg.get("http_options", {})
    url = f"http://{http.get('host', '127.0.0.1')}:{http.get('port', 8000)}"
    serve = Path(sys.executable).parent / "serve"
    proc = subprocess.Popen([str(serve), "run", path], cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "serve.log"), "w"))
    return proc, url, app_args["artifact"]


def _stop(proc: subprocess.Popen | None, work: str) -> None:
    """Stop a `_launch`ed server's process group (SIGTERM, then SIGKILL after 60 s) and say where its log is."""
    if proc is None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    print(f"server log: {work}/serve.log", file=sys.stderr)


def _wait_ready(client: httpx.Client, url: str, proc: subprocess.Popen | None, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"serve run exited ({proc.returncode}); see its serve.log")
        try:
            if client.get(f"{url}/health").status_code == 200:
                return client.get(f"{url}/v1/models").json()["data"][0]["id"]
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--launch", metavar="CONFIG", help="serve run this Serve config, measure, then stop it")
    where.add_argument("--url", help="a server already running")
    ap.add_argument("--artifact", default="models/smollm2-135m-instruct.ninfer", help="for sizing prompts (--url)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config arg (--launch)")
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[128, 1000, 3000, 6000])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    args = ap.parse_args()

    proc, artifact, url = None, args.artifact, args.url
    work = tempfile.mkdtemp(prefix="http_decode_")
    if args.launch:
        proc, url, artifact = _launch(args.launch, args.set, work)
    try:
        with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
            model = _wait_ready(client, url, proc, args.ready_timeout)
            prompts = Prompts(artifact)
            probe = "hi"  # the template's tokens: the server's prompt count less the message's own
            prompts.overhead = _stream(client, url, model, probe, 2)["prompt_tokens"] - prompts.count(probe)
            nonce = [int(time.time())]
            nonce[0] += 1  # warm-up, not reported
            _stream(client, url, model, prompts.message(min(args.prompt_len), nonce[0]), args.max_tokens)
            for length in args.prompt_len:
                result = measure(client, url, model, prompts, length, args, nonce)
                result.update({"max_tokens": args.max_tokens, "url": url, "config": args.launch,
                               "overrides": args.set, "command": " ".join(sys.argv)})
                print(json.dumps(result), flush=True)
    finally:
        _stop(proc, work)


if __name__ == "__main__":
    main()
