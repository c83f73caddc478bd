"""Signals to the CLI and abandoned jobs: a clean stop, no traceback, nothing left in $TMPDIR."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tpviz.events import Error, read_events_dir
from tpviz.processes import Ranks
from tpviz.tempdirs import LOCK, remove_stale_workdirs

from .conftest import REPO

BOUND = 60  # seconds: a generous liveness bound


class Cli:
    """`python -m tpviz load` with its own $TMPDIR; stderr collected by a reader thread."""

    def __init__(self, tmpdir, source, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tpviz", "load", str(source), *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "TMPDIR": str(tmpdir)},
            cwd=REPO,
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:  # ends when the CLI and every rank closed stderr
            self.lines.append(line)

    def stderr(self) -> str:
        self.reader.join(BOUND)
        assert not self.reader.is_alive(), "a rank still holds stderr open"
        return "".join(self.lines)


def assert_empty_soon(directory) -> None:
    """Ranks end asynchronously: poll, with a bound."""
    deadline = time.monotonic() + BOUND
    while os.listdir(directory) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert os.listdir(directory) == []


def freeze_ranks(proc: subprocess.Popen) -> list:
    """Stop the CLI's two ranks (children of its forkserver) as soon as both exist, so that
    what comes next finds the load running however fast it would have been (a tiny load can
    end between two of the CLI's status lines, so no line marks it as running); returns them."""
    import psutil

    deadline = time.monotonic() + BOUND
    while time.monotonic() < deadline:
        try:
            found = psutil.Process(proc.pid).children(recursive=True)
            ranks = [p for p in found if p.ppid() != proc.pid]
        except psutil.NoSuchProcess:  # one ended while being listed: look again
            continue
        if len(ranks) == 2:
            for p in ranks:
                p.suspend()
            return ranks
        time.sleep(0.002)
    raise AssertionError(f"the CLI's 2 ranks did not start within {BOUND} s")


@pytest.mark.slow
@pytest.mark.parametrize(
    "signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=["SIGTERM", "SIGHUP", "SIGINT"]
)
def test_stop_signals_cancel_cleanly_and_leave_nothing(tmp_path, tiny, signum):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    cli = Cli(tmpdir, tiny, "--events", str(tmp_path / "events"))
    freeze_ranks(cli.proc)
    cli.proc.send_signal(signum)
    assert cli.proc.wait(BOUND) == 128 + signum
    err = cli.stderr()
    assert "Traceback" not in err and "Exception in thread" not in err, err
    assert f"interrupted ({signal.Signals(signum).name})" in err
    assert_empty_soon(tmpdir)
    # the ranks it ended wrote nothing of it: the launcher ended their events files
    events = read_events_dir(tmp_path / "events")
    for rank in (0, 1):
        last = [e for e in events if e.rank == rank][-1]
        assert isinstance(last, Error) and last.message.startswith("the job ended: "), last


@pytest.mark.slow
def test_ranks_of_a_killed_cli_exit_quietly_and_the_next_start_removes_its_dir(tmp_path, tiny):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    cli = Cli(tmpdir, tiny)
    ranks = freeze_ranks(cli.proc)
    cli.proc.kill()
    cli.proc.wait(BOUND)
    for p in ranks:  # now they find their CLI gone
        p.resume()
    err = cli.stderr()  # every rank has exited (each held stderr)
    assert "Traceback" not in err and "Exception in thread" not in err, err
    # what is left is locked by the dead CLI: its ranks' dir and multiprocessing's (the
    # forkserver's socket), both provably stale
    left = os.listdir(tmpdir)
    assert left and all((tmpdir / n / LOCK).exists() for n in left), left
    again = Cli(tmpdir, tiny)
    assert again.proc.wait(300) == 0, again.stderr()
    assert_empty_soon(tmpdir)


ABANDON = textwrap.dedent("""
    import sys, tpviz
    if __name__ == "__main__":
        job = tpviz.launch(sys.argv[1], 2)
        if sys.argv[2] == "loaded":
            job.wait(120)
            job.forward([[1, 2, 3]])  # tensors over pipes: multiprocessing's pymp-* dirs
        print("leaving", flush=True)  # without shutdown: the interpreter exits at once
""")


@pytest.mark.slow
@pytest.mark.parametrize("when", ["starting", "loaded"])
def test_a_job_abandoned_at_interpreter_exit_leaves_nothing(tmp_path, tiny, when):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    script = tmp_path / "abandon.py"
    script.write_text(ABANDON)
    done = subprocess.run(
        [sys.executable, str(script), str(tiny), when],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TMPDIR": str(tmpdir)},
        cwd=REPO,
    )
    assert done.returncode == 0 and "leaving" in done.stdout, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert_empty_soon(tmpdir)


def test_only_provably_stale_temp_dirs_are_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read $TMPDIR
    stale = tmp_path / "tpviz-999999-stale"  # its owner died: the lock is free
    stale.mkdir()
    (stale / LOCK).touch()
    (stale / "rendezvous").touch()
    unlocked = tmp_path / "tpviz-foreign"  # no lock file: nothing proves it stale
    unlocked.mkdir()
    never_locked = tmp_path / "tpviz-999999-x"  # its maker died before it took the lock
    never_locked.mkdir()
    maker_alive = tmp_path / f"tpviz-{os.getpid()}-x"  # its maker is about to lock it
    maker_alive.mkdir()
    not_empty = tmp_path / "tpviz-999999-y"  # a lock file is made first: this is not ours
    not_empty.mkdir()
    (not_empty / "data").touch()
    stale_mp = tmp_path / "pymp-stale"  # a killed launcher's forkserver socket dir
    stale_mp.mkdir()
    (stale_mp / LOCK).touch()
    (stale_mp / "listener-x").touch()
    foreign_mp = tmp_path / "pymp-foreign"  # another program's multiprocessing: not ours
    foreign_mp.mkdir()
    live = Ranks()  # holds its lock for as long as it lives
    try:
        remove_stale_workdirs()
        kept = [unlocked.name, foreign_mp.name, maker_alive.name, not_empty.name]
        assert sorted(os.listdir(tmp_path)) == sorted([*kept, os.path.basename(live.workdir)])
    finally:
        live.close()
    assert sorted(os.listdir(tmp_path)) == sorted(kept)


def test_a_transformers_model_leaves_no_torch_cache_dir_in_tmpdir(tiny, tmp_path):
    """transformers' model classes import torch._dynamo, which makes its cache dir in $TMPDIR
    as it is imported: the CLI keeps it in a directory of its own, removed at exit."""
    tmpdir = tmp_path / "tmp"
    done = _cli_in_own_tmpdir(tmpdir, "plan", str(tiny), "--model", "hf")
    assert done.returncode == 0, done.stderr
    assert not list(tmpdir.iterdir())


@pytest.mark.parametrize(
    "code", ["tpviz.resolve_plan(sys.argv[1], 2)", "tpviz.Dashboard(sys.argv[1])"]
)
def test_planning_a_transformers_model_from_python_leaves_nothing_in_tmpdir(tmp_path, code):
    """A notebook that only plans (resolve_plan, PlanView, Dashboard) imports transformers'
    model classes, and so torch._dynamo, too."""
    transformers = pytest.importorskip("transformers")
    from .hf_tiny import TINY_DIMS

    transformers.AutoConfig.for_model("qwen2", **TINY_DIMS).save_pretrained(tmp_path / "qwen2")
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    done = subprocess.run(
        [sys.executable, "-c", f"import sys, tpviz; {code}", str(tmp_path / "qwen2")],
        capture_output=True,
        text=True,
        timeout=BOUND * 2,
        env={**env, "TMPDIR": str(tmpdir), "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    assert not list(tmpdir.iterdir())


@pytest.mark.slow
def test_a_python_launch_of_a_transformers_model_leaves_nothing_in_tmpdir(tiny, tmp_path):
    """The same from Python: launch() resolves the transformers model in the caller's process
    (importing torch._dynamo), and its forward runs DTensor on the ranks."""
    script = tmp_path / "load.py"
    script.write_text(
        "import sys, tpviz\n"
        "if __name__ == '__main__':\n"
        "    with tpviz.launch(sys.argv[1], 2, model='hf', verify=True) as job:\n"
        "        assert job.wait(120)['verify']['ok']\n"
    )
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    done = subprocess.run(
        [sys.executable, str(script), str(tiny)],
        capture_output=True,
        text=True,
        timeout=BOUND * 2,
        env={**env, "TMPDIR": str(tmpdir), "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    assert not list(tmpdir.iterdir())


@pytest.mark.slow
def test_a_command_failing_before_its_ranks_start_leaves_no_server_and_nothing(tiny, tmp_path):
    """The rank server (started as the CLI starts, importing transformers for this model) is
    ended with the CLI: still importing, it would outlive it and make its torch cache dir
    again in the CLI's temp dir after that was removed."""
    source = tmp_path / "too-deep"
    source.mkdir()
    config = json.loads((tiny / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 100_000}))
    tmpdir = tmp_path / "tmp"
    done = _cli_in_own_tmpdir(tmpdir, "load", str(source), "--model", "hf")
    assert done.returncode == 2 and "num_hidden_layers" in done.stderr, done.stderr
    assert _processes_started_in(tmpdir) == []  # the server included: its TMPDIR is below
    assert not list(tmpdir.iterdir())


def _cli_in_own_tmpdir(tmpdir, *args: str) -> subprocess.CompletedProcess:
    """`python -m tpviz ARGS` run to its end with $TMPDIR at `tmpdir` (made here) and torch's
    cache dir left for the CLI to choose."""
    tmpdir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    return subprocess.run(
        [sys.executable, "-m", "tpviz", *args],
        capture_output=True,
        text=True,
        timeout=BOUND * 2,
        env={**env, "TMPDIR": str(tmpdir)},
        cwd=REPO,
    )


def _processes_started_in(tmpdir) -> list[int]:
    """Live processes whose environment puts $TMPDIR at or below `tmpdir`."""
    prefix = f"TMPDIR={tmpdir}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # ended meanwhile, or not ours
            continue
        if any(entry.startswith(prefix) for entry in environ):
            found.append(int(pid))
    return found
