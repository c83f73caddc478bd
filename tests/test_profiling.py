"""Profiled loads open in TensorBoard's PyTorch profiler plugin (torch-tb-profiler)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import tpviz
from tpviz.plan import resolve_plan


@pytest.fixture(scope="module")
def profiled(tmp_path_factory, tiny):
    profile_dir = tmp_path_factory.mktemp("profiles") / "tiny-sliced"
    with tpviz.launch(tiny, 2, profile_dir=profile_dir, profile_forward=True) as job:
        result = job.wait(180)
    return profile_dir, result


@pytest.mark.slow
def test_one_trace_per_rank_with_a_range_per_module(profiled, tiny):
    profile_dir, result = profiled
    traces = sorted(profile_dir.glob("*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank0", "rank1"]
    units = [m for m, _ in tpviz.resolve_plan(tiny, 2).units()]
    for trace in traces:
        names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
        assert {f"tpviz.load/{m}" for m in units} <= names
        assert {"tpviz.phase/loading", "tpviz.phase/forward", "tpviz.read"} <= names


@pytest.mark.slow
def test_result_summarises_the_traces(profiled):
    _, result = profiled
    assert result["profile"]["dir"].endswith("tiny-sliced")
    for summary in result["profile"]["ranks"]:
        assert len(summary["slowest_units"]) == 5
        times = [u["seconds"] for u in summary["slowest_units"]]
        assert times == sorted(times, reverse=True) and times[0] > 0
        assert 0 < summary["read_seconds"] <= summary["unit_seconds"]
        assert summary["collective_seconds"] == 0  # sliced loads without collectives


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


@pytest.mark.slow
def test_tensorboard_lists_the_run_with_a_worker_per_rank(profiled, tmp_path):
    profile_dir, _ = profiled
    tensorboard = shutil.which("tensorboard", path=str(Path(sys.executable).parent))
    port = _free_port()
    proc = subprocess.Popen(
        [
            tensorboard,
            "--logdir",
            str(profile_dir.parent),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "TMPDIR": str(tmp_path)},  # where it writes .tensorboard-info
    )
    base = f"http://127.0.0.1:{port}/data/plugin/pytorch_profiler"
    try:
        runs = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                runs = _get(f"{base}/runs")["runs"]
            except OSError:
                pass
            if runs:
                break
            time.sleep(0.5)
        assert runs == ["tiny-sliced"]
        assert "Memory" in _get(f"{base}/views?run=tiny-sliced")
        assert _get(f"{base}/workers?run=tiny-sliced&view=Overview") == ["rank0", "rank1"]
    finally:
        proc.terminate()
        proc.wait(20)


def test_profiling_off_puts_no_profiler_in_the_load_path():
    from tpviz.profiling import no_span
    from tpviz.runtime.executor import LoadContext

    assert LoadContext.__dataclass_fields__["span"].default is no_span


@pytest.mark.slow
def test_cli_profile_shows_the_summary_and_keeps_kineto_quiet(tmp_path, tiny, capfd):
    from tpviz.cli import main

    # the ranks inherit this process's fd 2, which capfd reads: kineto writes there from C++
    assert main(["load", str(tiny), "--profile", str(tmp_path / "prof")]) == 0
    out, err = capfd.readouterr()
    assert "USDT" not in err and "profiler_start" not in err and "STAGE:" not in err
    header = next(line for line in out.splitlines() if line.startswith("rank  read s"))
    assert "collective s" in header and "slowest modules" in header
    table = out.split(header)[1].split("profile traces:")[0].splitlines()[2:]
    rows = [row for row in table if row[:1].isdigit()]
    assert [row.split()[0] for row in rows] == ["0", "1"]
    modules = {module for module, _ in resolve_plan(tiny, 2).units()}
    for row in rows:
        read, copy, collective = map(float, row.split()[1:4])
        assert read > 0 and collective == 0 and row.split()[4] in modules
    assert len(table) == 6  # the 3 slowest modules of each rank
