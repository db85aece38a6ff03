"""The GPU benchmark's CPU dry run (`bench/gpu_decode.py --quick`): tiny shapes, both weight formats
(and NVFP4 with its lm_head quantized), greedy and sampled decode, so the script the device sessions
depend on keeps running between them. Figures are not checked: speed is measured on the device, never
asserted in tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_decode_quick_runs_both_weight_formats():
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_decode.py"), "--quick", "--decode-only", "--concurrency", "1", "2",
           "--skip-transformers", "--weights", "bf16", "nvfp4", "--no-long", "--sampled"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert not [r for r in records if r["kind"] == "error"], records
    decode = {(r["weights"], r["concurrency"]) for r in records if r["kind"] == "ninfer_decode"}
    assert decode == {("bf16", 1), ("bf16", 2), ("nvfp4", 1), ("nvfp4", 2)}
    modes = {r["sampling"] for r in records if r["kind"] == "ninfer_decode"}
    assert modes == {"greedy", "sampled", "sampled_eager_sampler"}
    summary = next(r for r in records if r["kind"] == "summary")
    assert set(summary["formats"]) == {"bf16", "nvfp4"}
    # the goals are stated for qwen3.6-27b: on the tiny quick shape they are computed but marked so
    assert summary["goals"]["applies"] is False
    assert summary["goals"]["would_be"]["nvfp4_b1_ge_3x_bf16"]["value"] is not None


def test_gpu_engine_quick_reports_both_sampling_modes():
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_engine.py"), "--quick", "--concurrency", "1", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    decode = [r for r in records if r["kind"] == "engine_decode"]
    assert {(r["sampling"], r["concurrency"]) for r in decode} == {(m, c) for m in ("greedy", "sampled") for c in (1, 2)}
    assert all(r["window_tokens"] > 0 and r["tok_s"] > 0 for r in decode), decode


def test_gpu_decode_quick_nvfp4_lm_head_is_recorded():
    """--nvfp4-lm-head: the NVFP4 model's head is quantized too, and the JSON says so."""
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_decode.py"), "--quick", "--decode-only", "--concurrency", "1",
           "--skip-transformers", "--weights", "nvfp4", "--nvfp4-lm-head", "--no-long"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert not [r for r in records if r["kind"] == "error"], records
    kinds = {r["kind"]: r for r in records}
    assert kinds["env"]["nvfp4_lm_head"] and kinds["summary"]["nvfp4_lm_head"]
    assert kinds["ninfer_setup"]["lm_head"] == "nvfp4" and kinds["ninfer_decode"]["weights"] == "nvfp4"
    bad = subprocess.run(cmd[:-3] + ["bf16", "--nvfp4-lm-head"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert bad.returncode == 2 and "--nvfp4-lm-head needs nvfp4 in --weights" in bad.stderr


def test_spec_verify_dry_run_reports_every_concurrency_and_draft_count():
    cmd = [sys.executable, str(ROOT / "bench" / "spec_verify.py"), "--dry-run"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    rows = {(r["concurrency"], r["drafts"]) for r in records if r["kind"] == "spec_verify"}
    assert rows == {(c, k) for c in (1, 2) for k in (1, 3)}
    summary = next(r for r in records if r["kind"] == "summary")
    assert set(summary["ratios"]) == {"C1_k1", "C1_k3", "C2_k1", "C2_k3"}


def test_vision_ttft_dry_run_reuses_the_prefix_with_its_media():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "vision_ttft.py"), "--dry-run"], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    ttft = {(r["media"], r["attempt"]): r for r in records if r["kind"] == "vision_ttft"}
    assert set(ttft) == {(m, a) for m in ("image", "video") for a in ("cold", "reused")}
    for media in ("image", "video"):
        assert ttft[(media, "cold")]["cached_tokens"] == 0
        assert ttft[(media, "reused")]["cached_tokens"] == ttft[(media, "reused")]["prompt_tokens"] - 1


def _records(script: str, *args: str) -> list[dict]:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--dry-run", *args], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_spec_e2e_dry_run_keeps_outputs_equal_at_every_acceptance_length():
    """bench/spec_e2e.py (issue 21 benchmark (b)): the oracle drafter at set acceptance lengths, MTP head drafting
    too; every run's output equals the run without drafts (the benchmark's own check). --host-breakdown times the
    loop's parts over decode-only steps (its prefill steps left out)."""
    records = _records("spec_e2e.py", "--with-mtp", "--draft-head", "64", "--reference", "verify", "--host-breakdown")
    assert next(r for r in records if r["kind"] == "spec_e2e_setup")["draft_head"] == 64
    summary = next(r for r in records if r["kind"] == "summary")
    assert set(summary["results"]) == {f"C{c}_L{a}" for c in (1, 2) for a in (1.5, 2.5, 3.5)}
    assert summary["all_outputs_equal"]
    measured = [r["acceptance_measured"] for r in records if r.get("acceptance_target")]
    assert measured and all(m >= 1.0 for m in measured)
    drafted = [r for r in records if r.get("acceptance_target")]
    assert all(0 < r["host_us"]["steps"] <= r["decode_steps"] and r["host_us"]["commit"] > 0 for r in drafted)


def test_spec_e2e_dry_run_measures_each_queueing_mode_in_one_process():
    """--overlap-modes: each acceptance's run with queued verify rounds off, on and timed by the engine, interleaved,
    a line and summary entry each, outputs equal; only the runs allowed to queue do."""
    records = _records("spec_e2e.py", "--with-mtp", "--overlap-modes", "off", "on", "timed")
    runs = [r for r in records if r.get("acceptance_target")]
    assert {r["overlap_mode"] for r in runs} == {"off", "on", "timed"}
    assert all(r["queued_rounds"] == 0 for r in runs if r["overlap_mode"] == "off")
    assert any(r["queued_rounds"] > 0 for r in runs if r["overlap_mode"] == "on")
    summary = next(r for r in records if r["kind"] == "summary")
    assert {k.rsplit("_", 1)[1] for k in summary["results"]} == {"off", "on", "timed"} and summary["all_outputs_equal"]


def test_spec_phase_times_dry_run_times_the_drafting_calls():
    """bench/spec_phase_times.py: spec_e2e with timers around the step launches, verify forwards and MTP head
    passes; its last line names each timed call with its count."""
    records = _records("spec_phase_times.py", "--with-mtp", "--adaptive", "--concurrency", "2", "--acceptance", "1.5")
    assert next(r for r in records if r["kind"] == "summary")["all_outputs_equal"]
    ms = records[-1]["ms"]
    assert records[-1]["kind"] == "phase_times" and ms["propose"]["n"] > 0
    assert any(k.startswith("verify_") for k in ms) and any(k.startswith("launch_2d") for k in ms)


def test_verify_exactness_dry_run_compares_every_batch():
    records = _records("verify_exactness.py")
    rows = [r for r in records if r["kind"] == "verify_exactness"]
    assert [r["batch"] for r in rows] == [1, 2] and all(r["same_argmax"] for r in rows)


def test_gc_pause_dry_run_freezes_start_up_objects():
    """bench/gc_pause.py: an engine's start-up objects are counted and frozen out of the collector's scans (the
    Engine replica's freeze_startup_objects); the pause figures themselves are the benchmark's, not asserted."""
    (record,) = _records("gc_pause.py")
    assert record["kind"] == "gc_pause" and record["tracked_objects"] > 10_000
    assert record["frozen"] >= record["tracked_objects"] * 0.9


def test_read_ceiling_readers_see_every_weight_byte_once():
    """bench/read_ceiling.py's readers (the mma GEMV's loads without the mma, and a flat stream) under the
    interpreter: the XOR of what they read is the XOR of the weight, so their timings on the device are of
    every byte."""
    from bench.read_ceiling import check

    assert check("cpu") == {"rows": True, "flat": True}
