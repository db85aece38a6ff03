"""The notebooks under notebooks/ run top to bottom (nbclient) against the tests' scripted model.

Each notebook reads its parameters from NINFER_* environment variables, which the kernel inherits;
the stored notebooks carry no outputs. The Ray notebook starts its own local Ray (ray.init in the
kernel, like a user's) in a short temp dir of its own, as tests/test_server_ray.py does for `serve run`:
a kernel is a separate process, so it cannot join a Ray instance held by this test process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from pathlib import Path

import nbformat
import pytest
from process_helpers import processes_mentioning
from server_fixtures import free_port, scripted_artifact, start_server, wait_until

nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


def execute(name: str, timeout: int) -> nbformat.NotebookNode:
    book = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbclient.NotebookClient(book, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    return book


def stdout_of(book: nbformat.NotebookNode) -> str:
    return "".join(out.get("text", "") for cell in book.cells if cell.cell_type == "code"
                   for out in cell.get("outputs", []) if out.get("name") == "stdout")


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_notebooks_are_stored_without_outputs(path):
    book = nbformat.read(path, as_version=4)
    nbformat.validate(book)
    code = [cell for cell in book.cells if cell.cell_type == "code"]
    assert code and all(not cell.outputs and cell.execution_count is None for cell in code)


@pytest.mark.slow
def test_metrics_notebook_plots_ttft_and_throughput(artifacts_dir, qwen_tokenizer, tmp_path, monkeypatch):
    log = tmp_path / "requests.jsonl"
    server = start_server(scripted_artifact(artifacts_dir, qwen_tokenizer), qwen_tokenizer,
                          request_log_jsonl=str(log))
    plot = tmp_path / "plot.png"
    try:
        for key, value in {"NINFER_URL": server.url, "NINFER_REQUEST_LOG": str(log), "NINFER_PLOT": str(plot),
                           "NINFER_PROMPTS": json.dumps(["ALPHA", "COUNT", "LONG"]), "NINFER_MAX_TOKENS": "40",
                           "MPLBACKEND": "Agg"}.items():
            monkeypatch.setenv(key, value)
        out = stdout_of(execute("metrics_plot.ipynb", timeout=120))
    finally:
        server.stop()
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert "requests with a first token: 3.0" in out and "3 requests in the log" in out, out


@pytest.mark.ray
@pytest.mark.slow
def test_ray_notebook_streams_from_the_engine_handle_and_counts_through_the_router(
        artifacts_dir, qwen_tokenizer, monkeypatch):
    work = Path(tempfile.mkdtemp(prefix="nb", dir="/tmp"))  # short: Ray's unix socket paths must fit
    for key, value in {"NINFER_ARTIFACT": str(scripted_artifact(artifacts_dir, qwen_tokenizer)),
                       "NINFER_PROMPT": "ALPHA", "NINFER_MAX_TOKENS": "40", "NINFER_PORT": str(free_port()),
                       "RAY_TMPDIR": str(work), "RAY_USAGE_STATS_ENABLED": "0"}.items():
        monkeypatch.setenv(key, value)
    try:
        out = stdout_of(execute("ray_serve_handles.ipynb", timeout=150))
    finally:
        # a kernel that died mid-notebook leaves its local Ray behind: its processes name the temp dir
        for pid in processes_mentioning(str(work)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_until(lambda: not processes_mentioning(str(work)), timeout=20)
        shutil.rmtree(work, ignore_errors=True)
    assert "engine ready: True" in out, out
    assert "[answer] The answer is 4." in out and "finish: stop" in out, out
    assert "(handle)" in out and "(HTTP)" in out, out
