"""End-to-end decode speed with speculative decoding at controlled acceptance (issue 21, benchmark (b)).

Random weights give a real drafter no acceptance, so the drafts come from the oracle proposer
(ninfer.engine.speculative.OracleProposer, bench and tests only): it proposes the target's own greedy
continuation, recorded by a run without drafts, each draft replaced by a random token with probability
q, drawn per (request, output position). With k drafts a round then commits 1 + sum_{j=1..k} (1-q)^j tokens in
expectation (the acceptance length L); since the draws are fixed, q is found for each requested L by simulating the
run's rounds over its requests' positions (corruption_for), so acceptance_measured lands on L, not beside it.
Before s32 the draws were CRC-32 values, which cluster over consecutive positions: a requested 3.0 measured
3.5-3.65, a requested 3.5 3.70-3.74 (every result file carries acceptance_measured). Every run's output must equal
the run without drafts token for token (greedy at full shape, through the real engine: scheduler, verify graphs,
rollback).

At C > 1 a row's rounding depends on the decode batch's size (the bf16 GEMV of the lm_head and GDN's small
projections picks its configuration by the batch's rows; the speculative engine's NVFP4 GEMV, on tensor cores
from one row, does not), so a run whose rounds end requests at other steps than the plain run did can drift
from it (not batch-invariant, like peers' default kernels): its output then
differs and, the oracle's continuation no longer being the target's, acceptance_measured falls below
the target. `--settle N` then reruns up to N times, each time proposing the previous run's own output;
the oracle's corruption depends only on (request, position), so once a run's output equals the
continuation it was given its drafts followed the target and acceptance is the target's
(`drafts_followed_target`). `--reference verify` first runs with every draft rejected, whose batches over time are the
plain run's, and says whether that run's output equals the plain one (verify exactness at C > 1).

Prints one JSON line per (concurrency, acceptance length) with decode tok/s (sum over requests of
their generated tokens per decode second; with --repeat R the median of R runs) and the ratio to the
same engine without speculation (its proposer and draft controller detached, as a server without --spec;
drafter_idle_tok_s: the plain run with them attached and idle, the reference before s25).

    python bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 --concurrency 1 8 --drafts 3
    python bench/spec_e2e.py --dry-run   # tiny preset on the CPU: the harness itself
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def corruption_for(oracle, requests: list[str], length: float, k: int, tokens: int) -> float:
    """The oracle's corruption rate at which these requests' rounds of k drafts commit `length` tokens a round on
    average over `tokens` output positions each: its draws are fixed per (request, position), so the rounds are
    simulated (a round drafts the next k positions and commits up to the first corrupted one, plus the target's
    token) and the rate bisected. The closed form 1 + sum_j (1-q)^j holds only in expectation: one request's 256
    positions scatter by ~0.15 around it."""
    def per_round(q: float) -> float:
        oracle.corrupt = q
        done = rounds = 0
        for rid in requests:
            pos = 0
            while pos < tokens:
                rounds += 1
                good = 0
                while good < k and pos + good < tokens - 1 and oracle._replacement(rid, pos + good, 0) == 0:
                    good += 1
                pos += good + 1
            done += tokens
        return done / max(rounds, 1)

    lo, hi = 0.0, 1.0
    for _ in range(40):
        q = (lo + hi) / 2
        lo, hi = (q, hi) if per_round(q) > length else (lo, q)
    return (lo + hi) / 2


class OracleAfterMTP:
    """The MTP proposer's whole work each round (observe, propose), its drafts then replaced by the oracle's."""

    def __init__(self, mtp, oracle, free_samples: bool = True):
        self.mtp, self.oracle, self.free_samples = mtp, oracle, free_samples
        self.wants_prefill_hidden = True
        oracle.patch_ahead(mtp)  # rounds the engine queues before the last read back verify the oracle's drafts too

    def cache_spec(self, spec):
        return self.mtp.cache_spec(spec)

    def bind(self, runner):
        self.mtp.bind(runner)

    def forget(self, seq, retained=False):
        self.mtp.forget(seq, retained=retained)

    def observe(self, plan, output, committed):
        if self.oracle.continuations:  # the run without drafts pays nothing for the head
            self.mtp.observe(plan, output, committed)

    def observe_deferred(self):
        self.mtp.observe_deferred()

    def draft_ahead(self, plan, samples, rows=None):
        if self.oracle.continuations:
            self.mtp.draft_ahead(plan, samples, rows)

    def ahead_drafts(self, plan):
        return self.mtp.ahead_drafts(plan) if self.oracle.continuations else None

    def propose(self, works, budgets):
        if self.oracle.continuations:
            self.mtp.propose(works, budgets)
            self.oracle.propose(works, budgets)

    def predictions(self, plan):
        """The rows the head could predict (free acceptance samples), each with the oracle's first draft there."""
        import torch

        if not self.oracle.continuations or not self.free_samples:
            return []
        rows = [(seq, self.oracle.drafts(seq, 1)) for seq, _ in self.mtp.predictions(plan)]
        return [(seq, torch.tensor(first[0])) for seq, first in rows if first]


class StepLog:
    """The engine thread's phase times (HostWork.phase) step by step, each step marked decode-only or not (a
    prefill chunk, context copies): `round_ms` averages the decode-only steps, where `step_ms` spreads every
    step's time (a request's eager prefill too) over the decode steps. (s13's per-round table used step_ms:
    with drafts there are ~3.4x fewer decode steps, so each carried ~3.4x more of the prefill's host time.)"""

    PHASES = ("engine_boundary", "program_submit", "device_wait", "engine_commit_output")

    def __init__(self, engine):
        self.steps: list[dict] = []
        work, step = engine.work, engine._step
        original = work.phase

        @contextlib.contextmanager
        def phase(name):
            if name == "engine_boundary":  # every loop turn opens with it, idle ones too
                self.steps.append({"decode": False})
            record, start = self.steps[-1] if self.steps else {}, time.perf_counter()
            try:
                with original(name):
                    yield
            finally:
                record[name] = record.get(name, 0.0) + time.perf_counter() - start

        def traced(plan, launched=None):
            if self.steps:
                self.steps[-1]["decode"] = bool(plan.decode) and plan.prefill is None and not plan.before
            return step(plan, launched)

        work.phase, engine._step = phase, traced

    def round_ms(self, since: int) -> dict:
        rounds = [r for r in self.steps[since:] if r["decode"]]
        out = {k: 1e3 * sum(r.get(k, 0.0) for r in rounds) / max(len(rounds), 1) for k in self.PHASES}
        out["total"] = sum(out.values())
        return {"steps": len(rounds), **{k: round(v, 3) for k, v in out.items()}}


class HostLog:
    """--host-breakdown: the engine loop's parts (scheduling, the proposer's halves, launch, the device wait, commit,
    rollback, ...), each wrapped in a timer, as microseconds per decode-only step: where a round's host time goes.
    Parts nest (`propose` and `launch` run inside the step; `observe_deferred` also inside `propose`), so they do
    not add up to the round. A step runs from one `_step` call to the next (a round queued during the step before
    is not scheduled: s39); steps whose plan holds a prefill chunk are left out (s27: counted in, the prompt's
    eager prefill and its MTP observe put ~3.4 ms of launch and ~0.3 ms of observe into every decode step's
    share)."""

    PARTS = {"step": (None, "_step"), "queue_next": (None, "_queue_next_round"),
             "launch_next": ("runner", "launch_next_round"), "schedule": ("scheduler", "schedule"),
             "propose": (None, "_propose"), "launch": ("runner", "launch"),
             "observe_deferred": ("proposer", "observe_deferred"), "collect": ("runner", "collect"),
             "commit": (None, "_commit"), "rollback": ("runner", "rollback"), "update": ("scheduler", "update"),
             "observe": ("proposer", "observe"), "finish": (None, "_finish"), "draft_ahead": ("proposer", "draft_ahead"),
             "predicted": (None, "_predicted"), "free_samples": (None, "_sample"),
             # inside `launch` (s38): the verify forward's inputs and replay, its sampler, the hidden rows' copy
             "verify": ("runner", "verify"), "sample": ("runner", "sample"), "keep_hidden": ("runner", "_keep_hidden")}

    def __init__(self, engine, enabled: bool):
        self.seconds: dict[str, float] = {}  # decode-only steps' totals
        self.steps = 0  # decode-only steps counted
        self._step: dict[str, float] = {}  # the step in progress
        self._decode_only = False
        self.enabled = enabled
        for name, (owner, attr) in self.PARTS.items() if enabled else ():
            target = engine if owner is None else getattr(engine, owner)
            if target is not None and hasattr(target, attr):
                setattr(target, attr, self._timed(name, getattr(target, attr)))
        import torch

        if enabled and torch.cuda.is_available():  # every CUDA graph replay (verify, sampler, the head's): host time
            torch.cuda.CUDAGraph.replay = self._timed("graph_replay", torch.cuda.CUDAGraph.replay)

    def _close_step(self) -> None:
        if self._decode_only:
            for k, v in self._step.items():
                self.seconds[k] = self.seconds.get(k, 0.0) + v
            self.steps += 1
        self._step = {}

    def _timed(self, name: str, fn):
        def timed(*args, **kwargs):
            if name == "step":
                self._close_step()
                plan = args[0]
                self._decode_only = plan.prefill is None and bool(plan.decode)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._step[name] = self._step.get(name, 0.0) + time.perf_counter() - start
        return timed

    def take(self) -> dict:
        """Microseconds per decode-only step since the last take (the step in progress is closed first), and
        how many steps that is."""
        self._close_step()
        out = {k: round(1e6 * v / max(self.steps, 1), 1) for k, v in self.seconds.items()}
        out["steps"] = self.steps
        self.seconds, self.steps, self._decode_only = {}, 0, False
        return out


class DraftLog:
    """With --adaptive: how many drafts the controller chose at each batch size (k: steps), the free samples it
    took (drafts checked against plain steps' tokens), and its step-time table (ms by "batch x width") and
    engine-wide acceptance when a run ends: why a run drafted or not."""

    def __init__(self, engine):
        control = engine.drafts_control
        self.enabled = control is not None
        self.control, self.hist, self._samples = control, {}, 0
        if control is None:
            return
        original = control.drafts

        def drafts(batch, request_ids):
            k = original(batch, request_ids)
            key = f"B{batch}_k{k}"
            self.hist[key] = self.hist.get(key, 0) + 1
            return k

        control.drafts = drafts

    def take(self) -> dict:
        samples, self._samples = self.control.samples - self._samples, self.control.samples
        out = {"chosen": dict(sorted(self.hist.items())), "engine_p": round(self.control._engine.p, 3),
               "free_samples": samples,
               "times_ms": {f"{b}x{w}": round(t * 1e3, 2) for (b, w), t in sorted(self.control._times.items())},
               "probe_ms": {f"{b}": round(t * 1e3, 2) for b, t in sorted(self.control._probe_times.items())}}
        self.hist = {}
        return out


@contextlib.contextmanager
def without_drafter(engine):
    """The engine as one started without --spec runs its decode steps: no proposer (no hidden states kept, no head's
    observe) and no draft controller deciding each step. Before s25 the reference was the same engine with its
    drafter idle (no continuations), which paid for those per step too and so flattered every ratio."""
    saved = engine.proposer, engine.drafts_control
    engine.proposer = engine.drafts_control = None
    try:
        yield
    finally:
        engine.proposer, engine.drafts_control = saved


def step_ms(before: dict, after: dict, steps: int) -> dict:
    """The engine thread's wall time per decode step, by host phase and blocking device wait (HostWork):
    every step's time (prefill steps too) over the decode steps (StepLog.round_ms: decode-only steps)."""
    out = {k: (after["host_work_seconds"][k] - v) * 1e3 / max(steps, 1) for k, v in before["host_work_seconds"].items()}
    out["device_wait"] = (after["device_wait_seconds"] - before["device_wait_seconds"]) * 1e3 / max(steps, 1)
    return {k: round(v, 3) for k, v in out.items()}


def draft_head(trunk, num_tokens: int):
    """A proposal head of the first num_tokens tokens' lm_head rows (None: score on the whole lm_head)."""
    if not num_tokens:
        return None
    from ninfer.models.draft_head import DraftHead, build_draft_head_tensors

    if trunk.lm_head is None:
        head = trunk.embed_tokens.weight
    elif hasattr(trunk.lm_head, "weight"):
        head = trunk.lm_head.weight
    else:  # an NVFP4 lm_head (--nvfp4-lm-head): the shortlist's rows dequantized, as a converter would take them
        from ninfer.quant.nvfp4 import dequantize_nvfp4

        lm = trunk.lm_head
        head = dequantize_nvfp4(lm.weight_packed[:num_tokens], lm.weight_scale[:num_tokens],
                                lm.weight_row_scale[:num_tokens], trunk.embed_tokens.weight.dtype)
    tensors = build_draft_head_tensors(head, list(range(num_tokens)))
    out = DraftHead(num_tokens, head.shape[1], dtype=head.dtype, device=head.device)
    out.load_state_dict({k: v.to(head.device) for k, v in tensors.items()})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3.6-27b")
    p.add_argument("--weights", choices=["bf16", "nvfp4"], default="bf16")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--drafts", type=int, default=3)
    p.add_argument("--acceptance", type=float, nargs="+", default=[1.5, 2.5, 3.5])
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--kv-capacity", type=int, default=65536,
                   help="KV cache tokens at least (as a served engine's: attention's split count follows capacity; "
                        "s31: before this, C=1 ran 1-2 splits where a server runs 64)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--reference", choices=["decode", "verify"], default="decode",
                   help="the continuation the oracle proposes and outputs are compared with: plain decoding's, "
                        "or the verify forwards' own (a run whose drafts are all wrong; its rows then take the "
                        "same matmul shapes as every later run)")
    p.add_argument("--repeat", type=int, default=1, metavar="R",
                   help="time each plain and speculative run R times and report the medians (run-to-run noise "
                        "at C=8 was ~4 %%)")
    p.add_argument("--settle", type=int, default=0,
                   help="at C > 1, up to this many reruns with the previous run's output as the oracle's "
                        "continuation, until a run's output is the continuation it was given (controlled acceptance)")
    p.add_argument("--with-mtp", action="store_true",
                   help="run a random MTP head's drafting every round too (its cost), then verify the oracle's")
    p.add_argument("--draft-head", type=int, default=0, metavar="N",
                   help="with --with-mtp: the MTP head scores its drafts on a proposal head of the first N "
                        "tokens' lm_head rows (--lm-head-draft), not the whole lm_head")
    p.add_argument("--nvfp4-draft-head", action="store_true",
                   help="score drafts on an NVFP4 copy of the proposal head (DraftHead.quantize_nvfp4_)")
    p.add_argument("--nvfp4-mtp", action="store_true",
                   help="with --with-mtp: the head's decoder-layer linears in NVFP4 (what drafting in 4-bit would save)")
    p.add_argument("--nvfp4-lm-head", action="store_true",
                   help="with --weights nvfp4: the target's lm_head in NVFP4 too (an artifact converted with --nvfp4-lm-head)")
    p.add_argument("--adaptive", action="store_true",
                   help="per step, only as many drafts as pay for their verification (EngineSettings.adaptive_drafts, "
                        "the server's default); without it every round drafts --drafts tokens")
    p.add_argument("--no-free-samples", action="store_true",
                   help="with --with-mtp --adaptive: no free acceptance samples (DraftController.sample), as before s24")
    p.add_argument("--overlap-modes", nargs="+", choices=["off", "on", "timed"],
                   help="with --with-mtp: each acceptance's run once per mode, interleaved in this process (queued "
                        "verify rounds never, always, or timed by the engine as on CUDA by default); a spec_e2e line "
                        "and summary entry each (s38: a round's host time differed ~2x from one process to the next)")
    p.add_argument("--host-breakdown", action="store_true",
                   help="time the engine loop's parts (HostLog) and print them per decode step as host_us")
    p.add_argument("--fast-verify", action="store_true",
                   help="verify rows as one matmul pass (EngineSettings.exact_verify=False)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="profile the last run of each concurrency (torch.profiler, every thread) and print its "
                        "N ops of most host time (self CPU) and of most device time")
    p.add_argument("--timeline", action="store_true",
                   help="profile the last run of each concurrency with CPU and CUDA activity (no stack sampler) and "
                        "print where the GPU idles per decode step, by engine phase and host op (bench/gpu_timeline.py)")
    p.add_argument("--trace-dir", default=None, help="with --timeline: keep each gzipped chrome trace here")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="every request greedy with this presence penalty (s28: penalized rows draft; the full "
                        "sampler runs and each verify position counts the drafts before it)")
    p.add_argument("--dry-run", action="store_true", help="tiny preset on the CPU, short outputs")
    args = p.parse_args()
    if args.dry_run:
        args.shape, args.concurrency, args.prompt_len, args.max_tokens = "tiny-qwen3.6", [1, 2], 12, 12

    import torch

    from ninfer.artifact.presets import instantiate_mtp
    from ninfer.engine.engine import EngineSettings, overlap_chooser
    from ninfer.engine.loader import engine_from_preset
    from ninfer.engine.mtp_proposer import MTPProposer
    from ninfer.engine.speculative import OracleProposer
    from ninfer.engine.types import EngineRequest, FinishEvent, SamplingParams, TokenEvent
    from ninfer.server.gc_freeze import freeze_startup_objects

    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    lanes = max(args.concurrency)
    context = args.prompt_len + args.max_tokens + 64
    # KV for every lane at once: with one sequence's worth (kv_capacity=None), "C = 8" ran the requests one
    # after another (s13 / s14's C = 8 figures were C = 1 eight times)
    settings = EngineSettings(max_context=context, max_concurrency=lanes,
                              draft_tokens=args.drafts, prefix_reuse=False,
                              kv_capacity=max(lanes * context, args.kv_capacity),
                              exact_verify=not args.fast_verify, adaptive_drafts=args.adaptive)
    oracle = OracleProposer({}, vocab=1000, seed=1)
    proposer = oracle
    if args.with_mtp:  # a random MTP head drafts first (its full cost), then the oracle's drafts replace them
        def proposer(trunk):
            dtype = trunk.embed_tokens.weight.dtype
            head = instantiate_mtp(trunk, device, dtype, kv_layer=trunk.cache_spec().num_attn_layers,
                                   fuse=not args.nvfp4_mtp)
            if args.nvfp4_mtp:
                from ninfer.models import prepare_for_inference_
                from ninfer.quant.nvfp4 import quantize_model_

                quantize_model_(head)
                prepare_for_inference_(head)
            short = draft_head(trunk, args.draft_head)
            if short is not None and args.nvfp4_draft_head:
                short.quantize_nvfp4_()
            return OracleAfterMTP(MTPProposer(head, short), oracle, free_samples=not args.no_free_samples)
    engine = engine_from_preset(args.shape, settings, device=device, weights=args.weights, proposer=proposer,
                                nvfp4_lm_head=args.nvfp4_lm_head)
    steplog = StepLog(engine)
    choices = DraftLog(engine)
    hostlog = HostLog(engine, args.host_breakdown)
    sampling = SamplingParams(temperature=0.0, presence_penalty=args.presence_penalty, frequency_penalty=0.0)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20000) for _ in range(args.prompt_len)] for _ in range(lanes)]

    def profiled(c: int, label: str):
        """run(c) with the engine thread's stack sampled (bench/stack_sampler.py) and, on CUDA, the device's
        kernels profiled: prints the top --profile entries of each."""
        from bench.stack_sampler import StackSampler

        kernels = None
        with StackSampler(engine._thread) as sampler:
            if device.type == "cuda":
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CUDA]) as kernels:
                    result = run(c)
            else:
                result = run(c)
        steps = max(result[2]["decode_steps"], 1)
        emit(kind="profile", concurrency=c, run=label, engine_thread=sampler.top(args.profile))
        if kernels is not None:
            top = sorted(kernels.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)[:args.profile]
            emit(kind="profile", concurrency=c, run=label, device_us_per_step={
                e.key[:60]: [round(e.self_device_time_total / steps, 1), round(e.count / steps, 2)] for e in top})
        return result

    def timelined(c: int, label: str):
        """run(c) under torch.profiler (CPU and CUDA activity, engine phases annotated): prints where the GPU
        idles per decode step and what the engine thread did meanwhile (bench/gpu_timeline.py)."""
        import gzip
        import os
        import shutil
        import tempfile

        from torch.profiler import ProfilerActivity, profile

        from bench.gpu_timeline import analyze, annotate_phases

        annotate_phases(engine.work)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        try:  # the engine thread's ops too (torch >= 2.8); else only its CUDA activity
            from torch._C._profiler import _ExperimentalConfig

            extra = {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
        except (ImportError, TypeError):
            extra = {}
        with profile(activities=activities, **extra) as prof:
            result = run(c)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            emit(kind="timeline", concurrency=c, run=label,
                 **analyze(path, engine._thread.native_id, result[2]["decode_steps"]))
            if args.trace_dir:
                os.makedirs(args.trace_dir, exist_ok=True)
                with open(path, "rb") as src, gzip.open(os.path.join(args.trace_dir, f"trace_c{c}_{label}.json.gz"),
                                                         "wb") as dst:
                    shutil.copyfileobj(src, dst)
        return result

    if args.timeline:
        profiled = timelined  # noqa: F811

    mtp = engine.proposer.mtp if args.with_mtp else None  # kept: a run without speculation detaches the proposer

    def run(c: int) -> tuple[list[list[int]], float, dict]:
        """c requests at once; their outputs, summed decode tok/s and the engine's speculative counts."""
        import queue

        before = {k: getattr(engine.counters, k) for k in ("spec_rounds", "spec_drafted_tokens",
                                                          "spec_accepted_tokens", "decode_steps")}
        work_before, log_before = engine.work.snapshot(), len(steplog.steps)
        ahead_before = mtp.ahead_rounds if mtp is not None else 0
        queued_before = engine.queued_rounds
        hostlog.take()  # what ran before (another run's tail) is not this run's
        events = [queue.SimpleQueue() for _ in range(c)]
        for i in range(c):
            engine.submit(EngineRequest(f"r{i}", prompts[i], sampling=sampling, max_tokens=args.max_tokens),
                          events[i].put)
        outs, rate = [], 0.0
        for q in events:
            ids = []
            while True:
                ev = q.get(timeout=600)
                if isinstance(ev, Exception):
                    raise ev
                if isinstance(ev, TokenEvent):
                    ids += ev.token_ids
                if isinstance(ev, FinishEvent):
                    rate += ev.timings.as_dict()["predicted_per_second"]
                    break
            outs.append(ids)
        counts = {k: getattr(engine.counters, k) - v for k, v in before.items()}
        counts["step_ms"] = step_ms(work_before, engine.work.snapshot(), counts["decode_steps"])
        counts["round_ms"] = steplog.round_ms(log_before)
        if mtp is not None:  # rows whose drafts the head queued behind the verify (MTPProposer.draft_ahead)
            counts["ahead_rows"] = mtp.ahead_rounds - ahead_before
            counts["queued_rounds"] = engine.queued_rounds - queued_before  # queued before the last read back
        if engine.overlap_choice is not None:  # queueing timed both ways: what it chose per batch size
            counts["overlap_chosen"] = {str(b): on for b, on in sorted(engine.overlap_choice.decided().items())}
            counts["overlap_cycle_ms"] = {str(b): {("on" if on else "off"): round(1e3 * t, 3) for on, t in m.items()}
                                          for b, m in sorted(engine.overlap_choice.medians().items())}
        if hostlog.enabled:
            counts["host_us"] = hostlog.take()
        if choices.enabled:
            counts["control"] = choices.take()
        return outs, rate, counts

    emit(kind="spec_e2e_setup", shape=args.shape, weights=args.weights, device=str(device), drafts=args.drafts,
         exact_verify=settings.exact_verify, with_mtp=args.with_mtp, draft_head=args.draft_head,
         nvfp4_mtp=args.nvfp4_mtp, nvfp4_draft_head=args.nvfp4_draft_head, nvfp4_lm_head=args.nvfp4_lm_head,
         adaptive=args.adaptive, reference=args.reference,
         overlap_rounds="timed" if engine.overlap_choice is not None else engine.overlap,
         free_samples=args.with_mtp and args.adaptive and not args.no_free_samples,
         graph_status=engine.runner.graph_status, nvfp4_gemv=engine.runner.nvfp4_status,
         **({"mtp_graphs": len(engine.proposer.mtp._graphs), "mtp_capture_s": round(engine.proposer.mtp.capture_seconds, 3),
             "mtp_drafts_ahead": engine.proposer.mtp.drafts_ahead}
            if args.with_mtp else {}))
    modes = args.overlap_modes or [None]
    chooser = engine.overlap_choice or overlap_chooser()

    def set_overlap(mode: str | None) -> None:
        """--overlap-modes: queue verify rounds never, always, or as the engine's timed choice says (one chooser kept
        across runs, as a serving engine keeps it); None leaves the engine as it started."""
        if mode is not None:
            engine.overlap, engine.overlap_choice = mode != "off", chooser if mode == "timed" else None

    summary = {}
    try:
        run(1)  # warm-up (first replays, allocator)
        freeze_startup_objects()  # as the Engine replica does once ready (no full-collection pauses over start-up's)
        for c in args.concurrency:
            oracle.continuations = {}
            attached_rate = run(c)[1]  # the drafter idle (before s25 this was the reference)
            with without_drafter(engine):  # no speculation: what a server without --spec runs
                base, base_rate, base_counts = profiled(c, "plain") if args.profile or args.timeline else run(c)
                base_rate = median([base_rate] + [run(c)[1] for _ in range(args.repeat - 1)])
            emit(kind="spec_e2e", concurrency=c, acceptance_target=None, decode_tok_s=base_rate, ratio=1.0,
                 drafter_idle_tok_s=attached_rate, step_ms=base_counts["step_ms"], round_ms=base_counts["round_ms"])
            if args.reference == "verify":  # the continuation as verify forwards compute it: every draft wrong
                oracle.continuations = {f"r{i}": [0] * args.max_tokens for i in range(c)}
                oracle.corrupt = 0.0
                plain = base
                base, _, _ = run(c)
                # every draft rejected: one token a row a step, so the batch over time is the plain run's; equal
                # outputs say verify rows compute what decode rows do at every batch size the run passed through
                emit(kind="spec_e2e_all_rejected", concurrency=c, output_equals_no_speculation=base == plain)
            for warm, length, mode in [(True, args.acceptance[0], m) for m in modes] + [
                    (False, a, m) for a in args.acceptance for m in modes]:
                set_overlap(mode)
                oracle.continuations = {f"r{i}": ids for i, ids in enumerate(base)}
                oracle.corrupt = corruption_for(oracle, [f"r{i}" for i in range(c)], length, args.drafts,
                                                args.max_tokens)
                last = length == args.acceptance[-1] and not warm
                outs, rate, counts = profiled(c, f"L{length}") if (args.profile or args.timeline) and last else run(c)
                if warm:  # discarded: first verify shapes, the drafter's first kernels and chain-graph capture
                    continue
                settled = outs == base
                for _ in range(0 if settled else args.settle):  # follow the target's drift (docstring)
                    oracle.continuations = {f"r{i}": ids for i, ids in enumerate(outs)}
                    outs, rate, counts = run(c)
                    settled = outs == [oracle.continuations[f"r{i}"] for i in range(c)]
                    if settled:
                        break
                rate = median([rate] + [run(c)[1] for _ in range(args.repeat - 1)])  # same drafts: same output
                measured = 1 + counts["spec_accepted_tokens"] / max(counts["spec_rounds"], 1)
                same = outs == base
                emit(kind="spec_e2e", concurrency=c, acceptance_target=length, acceptance_measured=measured,
                     corrupt=oracle.corrupt, decode_tok_s=rate, ratio=rate / base_rate if base_rate else None,
                     output_equals_no_speculation=same, drafts_followed_target=settled,
                     **({"overlap_mode": mode} if mode else {}), **counts)
                key = f"C{c}_L{length}" + (f"_{mode}" if mode else "")
                summary[key] = {"tok_s": round(rate, 1), "ratio": round(rate / base_rate, 3) if base_rate else None,
                                "equal": same}
    finally:
        engine.shutdown()
    emit(kind="summary", shape=args.shape, weights=args.weights, drafts=args.drafts, results=summary,
         all_outputs_equal=all(v["equal"] for v in summary.values()))


if __name__ == "__main__":
    main()
