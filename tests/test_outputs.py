"""Output paths are checked before any rank starts; a write that fails during the run is
reported with its path beside the load result; token ids and rank counts are checked before
they reach ranks."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

import tpviz
from tpviz.capacity import RANK_PRIVATE_BYTES, host_shortfall
from tpviz.cli import main
from tpviz.events import Done, Phase, check_rank_files, read_events_dir
from tpviz.launcher import check_memory
from tpviz.outputs import OutputPathError, OutputWriteError, write_text
from tpviz.runtime.sink import EventSink
from tpviz.token_ids import check_token_ids

from .conftest import REPO, run_cli
from .test_failures import children, digest

GIB = 1024**3


def _a_file(tmp: Path) -> Path:
    (tmp / "a-file").write_text("not a directory")
    return tmp / "a-file"


def _link_to_checkpoint(tmp: Path, ckpt: Path) -> Path:
    (tmp / "report.html").symlink_to(next(ckpt.glob("*.safetensors")))
    return tmp / "report.html"


BAD_OUTPUTS = {
    "events at a file": ("--events", lambda tmp, ckpt: _a_file(tmp), "is a file"),
    "events under a file": ("--events", lambda tmp, ckpt: _a_file(tmp) / "sub", "is a file"),
    "profile at a file": ("--profile", lambda tmp, ckpt: _a_file(tmp), "is a file"),
    "events in the checkpoint": ("--events", lambda tmp, ckpt: ckpt, "checkpoint"),
    "profile in the checkpoint": ("--profile", lambda tmp, ckpt: ckpt / "t", "checkpoint"),
    "report over config.json": ("--report", lambda tmp, ckpt: ckpt / "config.json", "checkpoint"),
    "report over a weights file": (
        "--report",
        lambda tmp, ckpt: next(ckpt.glob("*.safetensors")),
        "checkpoint",
    ),
    "report linked to a weights file": ("--report", _link_to_checkpoint, "checkpoint"),
    "report at a directory": ("--report", lambda tmp, ckpt: tmp, "is a directory"),
    "report in a missing dir": ("--report", lambda tmp, ckpt: tmp / "no" / "r.html", "exist"),
    "report at a device": ("--report", lambda tmp, ckpt: Path("/dev/full"), "regular file"),
}


@pytest.mark.parametrize("case", BAD_OUTPUTS)
def test_a_bad_output_path_exits_2_before_any_rank_starts(case, tmp_path, tiny, capsys):
    flag, make, reason = BAD_OUTPUTS[case]
    path = make(tmp_path, tiny)
    before = digest(tiny)
    assert main(["load", str(tiny), flag, str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert str(path.absolute()) in err and reason in err
    assert children() == []
    assert digest(tiny) == before


def test_an_output_where_the_events_dir_keeps_a_ranks_file_is_refused(tmp_path, tiny, capsys):
    events = tmp_path / "events"
    for command, flag, path in [
        ("load", "--report", events / "rank1.jsonl"),
        ("load", "--profile", events / "rank0.jsonl"),
        ("compare", "--report", events / "sliced" / "rank0.jsonl"),  # a dir per strategy
        ("load", "--report", events),
    ]:
        assert main([command, str(tiny), "--events", str(events), flag, str(path)]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        what = "report" if flag == "--report" else "profile dir"
        assert line == (
            f"tpviz {command}: {what} {path} is where the events dir {events} keeps a rank's "
            f"events; give the {what} another path"
        )
    assert children() == [] and not events.exists()


def test_compare_checks_its_outputs_before_the_first_strategy(tmp_path, tiny, capsys):
    assert main(["compare", str(tiny), "--report", str(tmp_path), "--json"]) == 2
    assert "is a directory" in json.loads(capsys.readouterr().out)["errors"][0]["message"]
    assert main(["compare", str(tiny), "--events", str(_a_file(tmp_path))]) == 2
    assert children() == []


def test_launch_checks_its_output_dirs_too(tmp_path, tiny):
    with pytest.raises(OutputPathError, match="events dir .*a-file is a file"):
        tpviz.launch(tiny, 2, events_dir=_a_file(tmp_path))
    with pytest.raises(ValueError, match="profile dir .* would write into the checkpoint"):
        tpviz.launch(tiny, 2, profile_dir=tiny / "traces")
    assert children() == [] and not (tiny / "traces").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_an_unwritable_parent_is_refused(tmp_path, tiny, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert main(["load", str(tiny), "--report", str(locked / "r.html")]) == 2
    assert main(["load", str(tiny), "--events", str(locked / "events")]) == 2
    assert capsys.readouterr().err.count("not writable") == 2


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_a_directory_no_file_can_be_made_in_is_refused_even_for_root(tiny, capsys):
    """Permission bits do not tell (root passes them everywhere, /proc included): tpviz makes
    and removes a file to find out, before launch."""
    assert main(["load", str(tiny), "--report", "/proc/r.html"]) == 2
    assert main(["load", str(tiny), "--events", "/proc/events"]) == 2
    assert capsys.readouterr().err.count("/proc is not writable") == 2


def _limit_file_size(limit: int):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_failed_report_write_names_the_path_and_keeps_the_old_file(tmp_path):
    report = tmp_path / "report.html"
    report.write_text("the earlier report")
    restore = _limit_file_size(1000)  # a full disk, for this process only
    try:
        with pytest.raises(OutputWriteError, match=f"could not write {report}: File too large"):
            write_text(report, "x" * 5000)
    finally:
        restore()
    assert report.read_text() == "the earlier report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]


def test_an_events_file_on_a_full_disk_is_reported_not_raised(tmp_path):
    events = tmp_path / "events"
    events.mkdir()
    (events / "rank0.jsonl").symlink_to("/dev/full")  # every write: No space left on device
    sent: list = []
    sink = EventSink(0, sent.append, events)
    sink.emit(Phase(0, 1.0, name="starting"))
    sink.emit(Done(0, 2.0, result={"rank": 0}))
    sink.close()
    delivered = [e for batch in sent for e in batch.events]
    assert [e.type for e in delivered] == ["phase", "done"]  # the viewers still get them
    (error,) = delivered[1].result["output_errors"]
    assert error["path"] == str(events) and "rank0.jsonl: No space left" in error["message"]


@pytest.mark.parametrize("key", ["events_dir", "profile_dir"])
def test_an_empty_output_dir_is_refused_not_taken_for_none(tiny, key):
    with pytest.raises(ValueError, match=f"{key} must be a directory's path .*, not ''"):
        tpviz.launch(tiny, 2, **{key: ""})
    assert children() == []


def test_an_events_dir_another_running_load_writes_is_refused(tmp_path, tiny, capsys):
    """Each rank holds its events file's lock until its done: a second load into the same dir
    is refused before any rank starts, and a rank that meets a held file leaves it alone."""
    events = tmp_path / "events"
    running = EventSink(0, events_dir=events)  # what a running load's rank 0 holds
    running.emit(Phase(0, 1.0, name="loading"))
    assert main(["load", str(tiny), "--events", str(events), "--json"]) == 2
    (error,) = json.loads(capsys.readouterr().out)["errors"]
    assert error["message"] == (
        f"events dir {events}: rank0.jsonl is being written by another running load; "
        "give each load its own events dir"
    )
    assert children() == []
    late = EventSink(0, events_dir=events)  # one that got past the check meanwhile
    late.emit(Done(0, 2.0, result={"rank": 0}))
    assert "being written by another running load" in late.file_error["message"]
    assert [e.t for e in read_events_dir(events)] == [1.0]  # not emptied, not mixed
    running.emit(Done(0, 3.0, result={"rank": 0}))  # its file ends, and its lock goes
    check_rank_files(events)
    running.close()
    os.unlink(events / "rank0.jsonl")
    os.mkfifo(events / "rank0.jsonl")  # no one reads it: neither is waited on
    check_rank_files(events)
    fifo = EventSink(0, events_dir=events)
    assert "rank0.jsonl: No such device or address" in fifo.file_error["message"]
    (events / "rank3.jsonl").mkdir()  # no rank writes it, no load removes it, no follower reads it
    assert main(["load", str(tiny), "--events", str(events), "--json"]) == 2
    (error,) = json.loads(capsys.readouterr().out)["errors"]
    assert error["message"] == (
        f"events dir {events}: rank3.jsonl is a directory, where a rank writes its events; "
        "remove it or give another events dir"
    )


@pytest.mark.slow
def test_outputs_failing_during_a_load_keep_the_result(tmp_path, tiny):
    """A full disk (RLIMIT_FSIZE) for events, traces and the report: the load result is
    printed, each output is named on one line, exit 1, no traceback, nothing half-written."""
    report = tmp_path / "report.html"
    report.write_text("the earlier report")
    before = digest(tiny)
    cli = [sys.executable, "-m", "tpviz", "load", str(tiny), "--json", "--report", str(report)]
    cli += ["--events", str(tmp_path / "ev"), "--profile", str(tmp_path / "prof")]
    done = subprocess.run(
        cli,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (3000, 3000)),
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "__main__" not in done.stderr
    data = json.loads(done.stdout)
    assert data["plan_matches_shards"] and len(data["ranks"]) == 2
    assert {e["path"] for e in data["errors"]} == {
        str(tmp_path / "ev"),
        str(tmp_path / "prof"),
        str(report),
    }
    lines = [line for line in done.stderr.splitlines() if "could not write" in line]
    assert len(lines) == 3 and all(line.startswith("tpviz load: ") for line in lines)
    assert report.read_text() == "the earlier report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ev", "prof", "report.html"]
    assert list((tmp_path / "prof").iterdir()) == []  # no truncated trace left behind
    assert digest(tiny) == before


def test_token_ids_are_checked_against_the_vocabulary():
    for bad, named in (([[5, 999999]], "999999"), ([[5, -1]], "-1"), ([[1000]], "1000")):
        with pytest.raises(ValueError, match=f"token id {named} .*vocabulary size 1000"):
            check_token_ids(bad, 1000)
    for bad, says in (
        (torch.tensor([[1.5]]), "integers, not float32"),
        ([[True]], "integers, not bool"),
        ([], "empty"),
        ([[]], "empty"),
        ([[[1]]], "3-D"),
        ([[1, 2], [3]], "nested lists of ints"),
    ):
        with pytest.raises(ValueError, match=says):
            check_token_ids(bad, 1000)
    ids = check_token_ids(torch.tensor([0, 999], dtype=torch.int32), 1000)
    assert ids.dtype == torch.long and ids.tolist() == [[0, 999]]


def test_a_tmpdir_too_deep_for_the_rank_servers_socket_is_refused_in_one_line(tmp_path, tiny):
    deep = tmp_path / ("d" * (120 - len(str(tmp_path))))
    deep.mkdir()
    done = run_cli("load", str(tiny), env={"TMPDIR": str(deep)})
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(f"tpviz load: TMPDIR {deep} is too long for the rank server")
    assert done.stderr.endswith("107 at most); set TMPDIR to a shorter dir, such as /tmp\n")
    assert list(deep.iterdir()) == []


def test_a_rank_count_the_machine_cannot_run_is_refused_before_spawning(tmp_path, tiny, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"embed_tokens": "embedding_rowwise"}))  # valid at any size
    # 1000 here (2 cores, 24 GiB); more where 1000 ranks would fit, so that none is spawned
    world = str(max(1000, psutil.virtual_memory().available // RANK_PRIVATE_BYTES + 100))
    assert main(["load", str(tiny), "--world-size", world, "--plan", str(plan)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"for {world} ranks" in err and "At most about" in err and "--force" in err
    assert children() == []
    assert main(["plan", str(tiny), "--world-size", world, "--plan", str(plan), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["world_size"] == int(world)


def test_eight_ranks_on_two_cores_are_not_refused(tiny):
    plan = tpviz.resolve_plan(tiny, 8, {"embed_tokens": "embedding_rowwise"})
    check_memory(plan, "sliced", "cpu", "checkpoint")  # raises if refused


def test_rank_count_is_judged_on_memory_and_the_process_limit():
    fits = 8 * RANK_PRIVATE_BYTES + GIB
    assert host_shortfall(8, "sliced", [GIB // 8] * 8, fits, None) is None
    short = host_shortfall(8, "replicated", [GIB] * 8, fits, None)
    assert "for 8 ranks" in short and "sliced strategy" in short
    limited = host_shortfall(8, "sliced", [0] * 8, fits, task_slots=20)
    assert "process limit" in limited and "at most 3 ranks" in limited
