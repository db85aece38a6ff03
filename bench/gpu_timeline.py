"""Where the GPU idles inside decode steps, and what the engine thread did meanwhile: a torch.profiler chrome
trace (CPU and CUDA activity) read back after a run.

The GPU's busy time is the union of its kernels, copies and sets; every gap between them of at least
`min_gap_us` is idle time. Each gap is charged to what the engine thread was doing at its middle: the
innermost engine phase (HostWork.phase, recorded as `phase:<name>` user annotations by `annotate_phases`)
and the innermost torch op or CUDA runtime call running then ("-" when the thread was in plain Python).
A step whose host work sits on the critical path shows up as idle GPU time under that phase and op.

    analyze(trace_json_path, engine_tid, steps) -> dict (per decode step, ms)
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import json

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def annotate_phases(work) -> None:
    """Make HostWork.phase also open a profiler range `phase:<name>` (bench only)."""
    import torch

    if getattr(work, "_annotated", False):
        return
    original = work.phase

    @contextlib.contextmanager
    def phase(name):
        with torch.profiler.record_function(f"phase:{name}"), original(name):
            yield

    work.phase = phase
    work._annotated = True


def _intervals(events):
    return sorted((e["ts"], e["ts"] + e.get("dur", 0), e) for e in events)


def _innermost(stack_events, t):
    """The shortest interval of `stack_events` (sorted (start, end, event)) that contains t, or None."""
    best = None
    i = bisect.bisect_right(stack_events, (t, float("inf")))
    for start, end, e in reversed(stack_events[max(0, i - 400):i]):
        if start <= t <= end and (best is None or end - start < best[1] - best[0]):
            best = (start, end, e)
    return best[2] if best else None


def analyze(path: str, engine_tid: int, steps: int, min_gap_us: float = 5.0, top: int = 14) -> dict:
    with open(path) as f:
        trace = json.load(f)
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    gpu = _intervals(e for e in events if e.get("cat") in GPU_CATS)
    if not gpu:
        return {"error": "no GPU activity in the trace"}
    thread = [e for e in events if e.get("tid") == engine_tid and e.get("cat") != "python_function"]
    phases = _intervals(e for e in thread if e.get("cat") == "user_annotation" and e["name"].startswith("phase:"))
    ops = _intervals(e for e in thread if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver"))
    # the window: the engine's phases (a run's first to last), else the GPU's span
    lo = phases[0][0] if phases else gpu[0][0]
    hi = max(end for _, end, _ in phases) if phases else max(end for _, end, _ in gpu)
    busy, gaps, cursor = 0.0, [], lo
    for start, end, e in gpu:
        if end <= lo or start >= hi:
            continue
        start, end = max(start, lo), min(end, hi)
        if start > cursor:
            if start - cursor >= min_gap_us:
                gaps.append((cursor, start, e["name"]))
        busy += max(0.0, end - max(start, cursor))
        cursor = max(cursor, end)
    if hi - cursor >= min_gap_us:
        gaps.append((cursor, hi, "(end)"))
    idle_by = collections.Counter()
    idle_n = collections.Counter()
    idle_phase = collections.Counter()
    for a, b, _ in gaps:
        mid = (a + b) / 2
        ph = _innermost(phases, mid)
        op = _innermost(ops, mid)
        label = f"{ph['name'][6:] if ph else '(between phases)'} | {op['name'][:48] if op else '-'}"
        idle_by[label] += b - a
        idle_n[label] += 1
        idle_phase[label.split(" | ")[0]] += b - a
    phase_ms = collections.Counter()
    for start, end, e in phases:
        phase_ms[e["name"][6:]] += end - start
    runtime = collections.Counter()
    for start, end, e in ops:
        if e.get("cat") == "cuda_runtime":
            runtime[e["name"]] += end - start
    per = 1e3 * max(steps, 1)
    return {
        "window_ms": round((hi - lo) / per, 3),
        "gpu_busy_ms": round(busy / per, 3),
        "gpu_idle_ms": round(sum(b - a for a, b, _ in gaps) / per, 3),
        "phase_ms": {k: round(v / per, 3) for k, v in phase_ms.most_common()},
        "idle_by_phase": {k: round(v / per, 3) for k, v in idle_phase.most_common()},
        "idle_by_phase_op": {k: [round(v / per, 3), round(idle_n[k] / max(steps, 1), 2)]
                             for k, v in idle_by.most_common(top)},
        "runtime_ms": {k: round(v / per, 3) for k, v in runtime.most_common(top)},
    }
