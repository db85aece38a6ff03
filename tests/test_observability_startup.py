"""Startup checks for --request-log-jsonl, argv redaction, the stderr record format, and the
throughput record's idle rule: the parts of observability that need no running server."""

from __future__ import annotations

import io
import json
import logging

import pytest
from server_fixtures import scripted_artifact

from ninfer.cli import main
from ninfer.config import ServerConfig
from ninfer.server.oplog import RecordFormatter, configure_logging
from ninfer.server.request_log import (
    ARGV_ENV,
    REDACTED,
    RequestLog,
    RequestLogError,
    config_argv,
    redact_argv,
    server_argv,
)
from ninfer.server.startup import check_implemented
from ninfer.server.stats import throughput_line

KEY = "sk-PLANTED-startup-55aa"


@pytest.fixture(scope="module")
def artifact(artifacts_dir, qwen_tokenizer):
    return scripted_artifact(artifacts_dir, qwen_tokenizer)


def test_bad_log_paths_abort_startup(artifact, tmp_path):
    missing = tmp_path / "no-such-folder" / "log.jsonl"
    with pytest.raises(RequestLogError, match="does not exist"):
        check_implemented(ServerConfig(artifact=str(artifact), request_log_jsonl=str(missing)))
    with pytest.raises(RequestLogError, match="model artifact"):
        check_implemented(ServerConfig(artifact=str(artifact), request_log_jsonl=str(artifact)))
    aliased = tmp_path / "alias.ninfer"
    aliased.symlink_to(artifact)
    with pytest.raises(RequestLogError, match="model artifact"):
        check_implemented(ServerConfig(artifact=str(artifact), request_log_jsonl=str(aliased)))
    with pytest.raises(RequestLogError, match="is a folder"):
        RequestLog(str(tmp_path), str(artifact))
    check_implemented(ServerConfig(artifact=str(artifact), request_log_jsonl=str(tmp_path / "ok.jsonl")))


def test_cli_reports_a_bad_log_path_before_ray_starts(artifact, tmp_path, capsys):
    assert main(["serve", str(artifact), "--request-log-jsonl", str(tmp_path / "none" / "log.jsonl")]) == 1
    assert "--request-log-jsonl" in capsys.readouterr().err


def test_log_appends_one_flushed_line_per_event(artifact, tmp_path):
    target = tmp_path / "campaign.jsonl"
    target.write_text('{"earlier": "block"}\n')
    first, second = RequestLog(str(target), str(artifact)), RequestLog(str(target), str(artifact))
    first.write("throughput", interval_seconds=0.1)
    assert len(target.read_text().splitlines()) == 2  # on disk before anything is closed
    second.write("throughput", interval_seconds=1 / 3)
    lines = [json.loads(x) for x in target.read_text().splitlines()]
    assert lines[0] == {"earlier": "block"}
    assert lines[1]["server_instance_id"] != lines[2]["server_instance_id"]
    assert lines[2]["interval_seconds"] == 1 / 3  # full precision survives
    assert [first.next_request_id(), first.next_request_id(), second.next_request_id()] == [1, 2, 1]
    first.close(), second.close()


def test_argv_never_carries_the_api_key(monkeypatch):
    argv = ["ninfer", "serve", "m.ninfer", "--api-key", KEY, "--port", "9", f"--api-key={KEY}", f"x{KEY}y"]
    redacted = redact_argv(argv, KEY)
    assert KEY not in " ".join(redacted)
    assert redacted[3:5] == ["--api-key", REDACTED] and redacted[7] == f"--api-key={REDACTED}"
    cfg = ServerConfig(artifact="m.ninfer", api_key=KEY, port=9, greedy=True)
    assert config_argv(cfg) == ["ninfer", "serve", "m.ninfer", "--port", "9", "--api-key", KEY, "--greedy"]
    monkeypatch.delenv(ARGV_ENV, raising=False)
    assert KEY not in json.dumps(server_argv(cfg))
    monkeypatch.setenv(ARGV_ENV, json.dumps(argv))  # what `ninfer serve` hands its Ray replicas
    assert KEY not in json.dumps(server_argv(cfg)) and server_argv(cfg)[:3] == ["ninfer", "serve", "m.ninfer"]


def test_records_are_single_lines_without_control_codes():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(RecordFormatter())
    logger = logging.getLogger("ninfer.test")
    parent = logging.getLogger("ninfer")
    level = parent.level
    parent.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        logger.info("request \x1b[31mred\x1b[0m id")
        try:
            raise RuntimeError("device\nlost")
        except RuntimeError:
            logger.exception("engine step failed")
    finally:
        logger.removeHandler(handler)
        parent.setLevel(level)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and "\x1b" not in stream.getvalue()
    assert lines[0].endswith("INFO request \\x1b[31mred\\x1b[0m id")
    assert lines[1].endswith("ERROR engine step failed (RuntimeError: device lost)")


def test_configure_logging_levels_and_idempotence():
    logger = logging.getLogger("ninfer")
    saved = (logger.level, list(logger.handlers))
    try:
        configure_logging("warning")
        configure_logging("off")
        assert sum(getattr(h, "_ninfer", False) for h in logger.handlers) == 1
        assert not logger.isEnabledFor(logging.CRITICAL)
        configure_logging("trace")
        assert logger.isEnabledFor(5) and logging.getLevelName(5) == "TRACE"
    finally:
        logger.setLevel(saved[0])
        logger.handlers[:] = saved[1]


def test_idle_intervals_are_omitted():
    idle = {"prefill_tokens": 0, "decode_tokens": 0, "replayed_tokens": 0, "decode_steps": 0, "running": 0,
            "waiting": 0, "paused": 0, "prefilling": 0, "decode_ready": 0, "kv_pages_used": 0, "kv_pages_capacity": 8,
            "prefix_captures": 0, "prefix_evictions": 0, "preemptions": 0, "snapshot_restores": 0,
            "replay_restores": 0, "context_transfer_bytes": {"main_kv_d2h": 0},
            "host_work_seconds": {"engine_boundary": 0.0}}
    assert throughput_line(idle, dict(idle), 5.0) is None
    waiting = {**idle, "waiting": 1}
    assert throughput_line(idle, waiting, 5.0).startswith("throughput: prefill 0.0 tok/s")
    spilled = {**idle, "context_transfer_bytes": {"main_kv_d2h": 4096}}
    assert throughput_line(idle, spilled, 5.0) is not None  # context work without tokens is not idle


def test_engine_replicas_freeze_start_up_objects_out_of_gc_scans():
    """deployments/engine.py calls freeze_startup_objects once the engine is ready: what start-up left alive,
    cycles included, moves to the collector's permanent generation, so a full collection while serving does not
    scan it (a 48-56 ms pause over the tiny Qwen engine's ~225k objects on the dev machine, inside a step)."""
    import gc

    from ninfer.server.startup import freeze_startup_objects

    class Node:
        pass

    alive = Node()
    alive.self = alive  # a cycle that stays reachable
    try:
        frozen = freeze_startup_objects()
        assert frozen == gc.get_freeze_count() > 0
        assert not any(o is alive for o in gc.get_objects())  # no generation the collector scans holds it
    finally:
        gc.unfreeze()
    assert any(o is alive for o in gc.get_objects())
