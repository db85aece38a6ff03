"""What streaming costs the serving processes: CPU seconds per streamed token by Ray process (engine replica,
router replica, HTTP proxy, the rest), SSE chunks a token, and the aggregate decode rate, at each concurrency.

  python bench/serve_overhead.py --launch configs/tiny.yaml --concurrency 1 8   # serve run, measure, stop
  python bench/serve_overhead.py --url http://127.0.0.1:8080 --concurrency 1    # a server already up

Each round sends C streaming Chat Completions at once (greedy, --max-tokens each, short prompts with fresh
nonces); the processes' CPU times (psutil, user + system) are read before and after the round. Every token
crosses two Ray hops (engine replica -> router replica -> proxy) and one HTTP write: their cost per token is what
event batching (ninfer.engine.emitter, engine_client.engine_event_batches) takes down where a step commits
several tokens of one request (speculative rounds) or the engine runs ahead of its consumer. One JSON line per
concurrency (median round of --repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.http_decode import _launch, _stop, _wait_ready  # noqa: E402

ROLES = (("engine", "ServeReplica:ninfer:Engine"), ("router", "ServeReplica:ninfer:Router"), ("proxy", "ProxyActor"))


def _cpu_by_role(exclude: int) -> dict[str, float]:
    """CPU seconds so far of every process of this machine's Ray cluster, summed by role."""
    out = {role: 0.0 for role, _ in ROLES} | {"other": 0.0}
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.info["pid"] == exclude:
            continue
        line = " ".join(p.info["cmdline"] or [])
        if "ray" not in line and "serve" not in line:
            continue
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        role = next((r for r, marker in ROLES if marker in line), "other")
        out[role] += t.user + t.system
    return out


def _one(client: httpx.Client, url: str, model: str, nonce: int, max_tokens: int) -> tuple[int, int, float, float]:
    """(completion tokens, SSE data events with content, first and last content time) of one streamed request."""
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"[{nonce}] Write a long story about a dragon who bakes bread."}]}
    chunks, first, last, usage = 0, None, None, None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            if chunk.get("choices") and (chunk["choices"][0].get("delta") or {}).get("content"):
                chunks += 1
                last = time.perf_counter()
                first = first or last
    return usage["completion_tokens"], chunks, first, last


def round_(client, url, model, concurrency: int, max_tokens: int, nonce: int) -> dict:
    me = os.getpid()
    before = _cpu_by_role(me)
    with ThreadPoolExecutor(concurrency) as pool:
        runs = list(pool.map(lambda i: _one(client, url, model, nonce + i, max_tokens), range(concurrency)))
    after = _cpu_by_role(me)
    tokens = sum(r[0] for r in runs)
    span = max(r[3] for r in runs) - min(r[2] for r in runs)
    per_token = {role: round(1e3 * (after[role] - before[role]) / tokens, 3) for role in after}
    return {"tokens": tokens, "decode_tok_s": tokens / span, "sse_events_per_token": sum(r[1] for r in runs) / tokens,
            "cpu_ms_per_token": per_token}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--launch", metavar="CONFIG", help="serve run this Serve config, measure, then stop it")
    where.add_argument("--url", help="a server already running")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config arg (--launch)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    args = ap.parse_args()

    proc, url = None, args.url
    work = tempfile.mkdtemp(prefix="serve_overhead_")
    if args.launch:
        proc, url, _ = _launch(args.launch, args.set, work)
    try:
        with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0),
                          limits=httpx.Limits(max_connections=max(args.concurrency))) as client:
            model = _wait_ready(client, url, proc, args.ready_timeout)
            nonce = int(time.time() * 1000)
            round_(client, url, model, 1, 16, nonce)  # warm-up
            for c in args.concurrency:
                rounds = []
                for _ in range(args.repeats):
                    nonce += c
                    rounds.append(round_(client, url, model, c, args.max_tokens, nonce))
                mid = sorted(rounds, key=lambda r: r["decode_tok_s"])[len(rounds) // 2]
                print(json.dumps({"concurrency": c, **mid, "decode_tok_s_runs": [r["decode_tok_s"] for r in rounds],
                                  "max_tokens": args.max_tokens, "config": args.launch, "overrides": args.set,
                                  "command": " ".join(sys.argv)}), flush=True)
    finally:
        _stop(proc, work)


if __name__ == "__main__":
    main()
