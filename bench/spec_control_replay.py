"""Replay the adaptive draft controller (ninfer.engine.spec_control) against step times recorded on a device.

A model, not a measurement: it weighs a change to the controller's rules on the CPU before device time is
spent on it. Step costs come from one `bench/spec_e2e.py --adaptive` record (its `control.times_ms`, the
engine's own table per batch size and verify width, and `probe_ms`); a (batch, width) the record lacks
costs the plain step of that batch size times the width's ratio at the nearest batch size that has it.
Requests arrive one a step (the engine admits one prefill chunk a step) and each wants `--tokens` tokens;
each draft stands with probability p, independently (the oracle drafter's corruption), p solved from the
acceptance length L = 1 + p + ... + p^k at k = --drafts. The controller first sees the widths of
`--preload` batch size measured and `--warm` rounds of an earlier request at the same acceptance
(spec_e2e runs C=1 before C=8 in one engine). Prints one JSON line per
acceptance length: the speed against plain decoding of the same arrivals (mean and worst over seeds) and
the controller's choices.

    python bench/spec_control_replay.py --log bench/results/2026-12-04-h200-s18/e2e_c1_c8_c1_call5.log
    python bench/spec_control_replay.py --log ... --control /tmp/old_spec_control.py   # another rule set
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def load_table(log: Path, concurrency: int) -> tuple[dict[tuple[int, int], float], dict[int, float]]:
    """(batch, width) -> ms and batch -> probe ms from the log's last adaptive record at this concurrency."""
    found = None
    for line in log.read_text().splitlines():
        rec = json.loads(line) if line.startswith("{") else {}
        if rec.get("concurrency") == concurrency and "control" in rec:
            found = rec["control"]
    if found is None:
        raise SystemExit(f"{log}: no --adaptive record at concurrency {concurrency}")
    times = {tuple(int(v) for v in key.split("x")): ms for key, ms in found["times_ms"].items()}
    return times, {int(b): ms for b, ms in found.get("probe_ms", {}).items()}


class Costs:
    def __init__(self, times: dict[tuple[int, int], float], probes: dict[int, float]):
        self.times, self.probes = times, probes

    def plain(self, batch: int) -> float:
        return self.times.get((batch, 1)) or min(((abs(b - batch), t) for (b, w), t in self.times.items() if w == 1))[1]

    def ms(self, batch: int, width: int, probe: bool) -> float:
        if probe and batch in self.probes:
            return self.probes[batch]
        if (batch, width) in self.times:
            return self.times[(batch, width)]
        near = min(b for b, w in self.times if w == width and (b, 1) in self.times and
                   abs(b - batch) == min(abs(c - batch) for c, v in self.times if v == width and (c, 1) in self.times))
        return self.plain(batch) * self.times[(near, width)] / self.times[(near, 1)]


def acceptance_p(length: float, drafts: int) -> float:
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** j for j in range(drafts + 1)) < length else (lo, mid)
    return lo


def replay(control, costs: Costs, *, p: float, concurrency: int, tokens: int, drafts: int, preload: int | None,
           warm: int, seed: int) -> tuple[float, Counter]:
    """Seconds to decode the arrivals with the controller choosing each step's drafts, and its choices."""
    rng = random.Random(seed)
    c = control.DraftController(drafts)
    for _ in range(warm):  # an earlier request's rounds at this acceptance: the engine's prior for fresh ones
        accepted = 0
        while accepted < drafts and rng.random() < p:
            accepted += 1
        c.round("earlier", drafts, accepted)
    c.forget("earlier")
    if preload is not None:
        for (b, w), ms in costs.times.items():
            if b == preload:
                c.step_time(b, w, ms / 1000)
                c.step_time(b, w, ms / 1000)
    left, waiting, seconds, chosen = {}, [f"r{i}" for i in range(concurrency)], 0.0, Counter()
    while waiting or left:
        if waiting:
            left[waiting.pop(0)] = tokens
        ids = list(left)
        k = c.drafts(len(ids), ids)
        probe = getattr(c, "_probing", False)
        step = costs.ms(len(ids), k + 1, probe) / 1000
        c.step_time(len(ids), k + 1, step)
        seconds += step
        chosen[f"B{len(ids)}_k{k}{'_probe' if probe else ''}"] += 1
        for r in ids:
            accepted = 0
            while accepted < k and rng.random() < p:
                accepted += 1
            if k:
                c.round(r, k, accepted)
            left[r] -= min(accepted + 1, left[r])
            if not left[r]:
                del left[r]
                c.forget(r)
    return seconds, chosen


def plain_seconds(costs: Costs, concurrency: int, tokens: int) -> float:
    left, waiting, seconds = [], list(range(concurrency)), 0.0
    while waiting or left:
        if waiting:
            waiting.pop(0)
            left.append(tokens)
        seconds += costs.plain(len(left)) / 1000
        left = [n - 1 for n in left if n > 1]
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", type=Path, required=True, help="a spec_e2e --adaptive log (JSON lines)")
    parser.add_argument("--control", type=Path, help="a spec_control.py to replay instead of ninfer's")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--acceptance", type=float, nargs="+", default=[1.5, 2.5, 3.5])
    parser.add_argument("--drafts", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--preload", type=int, default=1, help="batch size whose recorded widths the controller knows "
                        "at the start (-1: none)")
    parser.add_argument("--warm", type=int, default=0, help="rounds of an earlier request at the same acceptance "
                        "before the arrivals (spec_e2e's runs share one engine)")
    parser.add_argument("--seeds", type=int, default=40)
    args = parser.parse_args(argv)
    if args.control:
        spec = importlib.util.spec_from_file_location("replayed_spec_control", args.control)
        control = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = control  # dataclasses look their module up
        spec.loader.exec_module(control)
    else:
        from ninfer.engine import spec_control as control
    costs = Costs(*load_table(args.log, args.concurrency))
    base = plain_seconds(costs, args.concurrency, args.tokens)
    for length in args.acceptance:
        p = acceptance_p(length, args.drafts)
        runs = [replay(control, costs, p=p, concurrency=args.concurrency, tokens=args.tokens, drafts=args.drafts,
                       preload=None if args.preload < 0 else args.preload, warm=args.warm, seed=s) for s in range(args.seeds)]
        ratios = [base / s for s, _ in runs]
        chosen = sum((c for _, c in runs), Counter())
        print(json.dumps({"kind": "spec_control_replay", "control": str(args.control or "ninfer"),
                          "concurrency": args.concurrency, "acceptance": length, "p": round(p, 3), "warm": args.warm,
                          "ratio_mean": round(sum(ratios) / len(ratios), 3), "ratio_worst": round(min(ratios), 3),
                          "choices_per_run": {k: round(v / args.seeds, 2) for k, v in sorted(chosen.items())}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
