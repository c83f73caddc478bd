"""`load_sharded` inside a process group made by a real torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import tpviz
from tpviz.events import Done, Error, Memory, Phase, UnitDone, UnitStart, read_events_dir
from tpviz.plan import resolve_plan
from tpviz.runtime.sink import EventSink
from tpviz.tempdirs import LOCK

from .conftest import REPO

pytestmark = pytest.mark.slow


def _torchrun_load(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        "TMPDIR": str(tmp_path),  # torchrun keeps its own logs there and never removes them
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    script = str(REPO / "tests" / "torchrun_load.py")
    return subprocess.run(
        [*command, "--nproc-per-node", "2", script, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=REPO,
    )


def test_load_sharded_under_torchrun_writes_each_ranks_events(tmp_path, tiny):
    events_dir = tmp_path / "events"
    stale = tmp_path / "pymp-stale"  # as a killed rank leaves its temp dir: locked by no one
    stale.mkdir()
    (stale / LOCK).touch()
    run = _torchrun_load(tmp_path, str(tiny), str(events_dir))
    assert run.returncode == 0, run.stderr[-3000:]
    assert not stale.exists()
    output = json.loads(run.stdout.strip().splitlines()[-1])
    assert output["logits_shape"] == [1, 4, 1000]
    assert output["result"]["plan_matches_shards"]
    assert not output["dynamo_in_load"]  # no second-long import inside the load
    assert 0 < output["dtensor_params"] < output["params"]  # sharded ones; norms stay plain
    assert sorted(p.name for p in events_dir.iterdir()) == ["rank0.jsonl", "rank1.jsonl"]
    events = read_events_dir(events_dir)
    units = len(resolve_plan(tiny, 2).units())
    for rank in (0, 1):
        mine = [e for e in events if e.rank == rank]
        assert sum(isinstance(e, UnitStart) for e in mine) == units
        assert sum(isinstance(e, UnitDone) for e in mine) == units
        assert sum(isinstance(e, Memory) for e in mine) >= units
        (done,) = [e for e in mine if isinstance(e, Done)]
        assert done.result["param_bytes"] == done.result["planned_bytes"]


def test_a_rank_given_another_source_fails_them_all_instead_of_loading_rank_0s(
    tmp_path, tiny, tiny_tied
):
    """Every rank reads the plan's source: a rank given another one (another valid model, or
    one it cannot read while rank 0 resolves) would load rank 0's model without a word. Each
    still reaches the plan's broadcast (rank 0 would wait there until the timeout), and then
    every rank fails with the same line naming both sources."""
    events = tmp_path / "events"
    for other in (tiny_tied, tmp_path / "missing" / "model"):
        events.mkdir(exist_ok=True)
        (events / "rank3.jsonl").write_text("")  # an earlier, larger run's: removed
        run = _torchrun_load(tmp_path, str(tiny), str(events), str(other))
        assert run.returncode != 0
        said = f"rank 1: asked for source {other} (rank 0: {tiny})"
        assert said in run.stderr, run.stderr
        assert "every rank must ask for the same load" in run.stderr
        # each rank's file ends with why, so that a follower of the files sees the job end
        assert sorted(p.name for p in events.iterdir()) == ["rank0.jsonl", "rank1.jsonl"]
        last = {e.rank: e for e in read_events_dir(events)}
        assert all(isinstance(last[r], Error) and said in last[r].message for r in (0, 1))
    with pytest.raises(tpviz.LoadError, match="asked for source"):
        tpviz.LoadMonitor.from_events_dir(events, poll_seconds=0.05).wait(30)


def test_a_rank_asked_for_another_load_or_to_write_into_the_checkpoint_fails_them_all(
    tmp_path, tiny
):
    """Each rank checks what it was asked before loading; one rank's problem ends every rank
    with the same one-line error (a rank on another strategy would wait in collectives its
    peers never enter)."""
    inside = tiny / "events"
    run = _torchrun_load(tmp_path, str(tiny), str(inside))
    assert run.returncode != 0 and not inside.exists()
    assert "rank 0: events dir" in run.stderr and "would write into the checkpoint" in run.stderr
    run = _torchrun_load(tmp_path, str(tiny), str(tmp_path / "ev"), str(tiny), "rank0_broadcast")
    assert run.returncode != 0
    assert "rank 1: asked for strategy rank0_broadcast" in run.stderr
    assert "every rank must ask for the same load" in run.stderr
    # another load still writes this events dir (its rank 0 holds its file, as a sink does)
    busy = tmp_path / "busy"
    other = EventSink(0, events_dir=busy)
    other.emit(Phase(0, 1.0, name="loading"))
    run = _torchrun_load(tmp_path, str(tiny), str(busy))
    other.close()
    assert run.returncode != 0
    assert f"rank 0: events dir {busy}: rank0.jsonl is being written by another" in run.stderr
    assert [e.t for e in read_events_dir(busy) if e.rank == 0] == [1.0]  # left as it was


def test_a_plan_resolved_beforehand_is_loaded_only_for_what_it_was_resolved(tmp_path, tiny):
    """A ResolvedPlan is executed as it is: a dtype it was not resolved for is refused, and a
    rank given one resolved otherwise than rank 0's (rank 0's would load without a word)
    fails every rank."""
    events = str(tmp_path / "ev")
    run = _torchrun_load(tmp_path, str(tiny), events, "resolved", "", "bfloat16")
    assert run.returncode != 0
    assert "the plan was resolved for dtype float32, not bfloat16" in run.stderr, run.stderr
    run = _torchrun_load(tmp_path, str(tiny), events, "resolved", "bfloat16")
    assert run.returncode != 0
    assert "rank 1: asked for another plan than rank 0's" in run.stderr, run.stderr


def test_a_peer_that_exits_before_load_sharded_is_waited_for_only_the_timeout(tmp_path, tiny):
    """torchrun ends every rank when one fails, but not when one exits 0: the others would
    wait in the process group's rendezvous for torch's default 30 minutes."""
    run = _torchrun_load(tmp_path, str(tiny), str(tmp_path / "ev"), "exit")
    assert run.returncode != 0
    assert "rank 0: not every rank of 2 called load_sharded within 5.0 s" in run.stderr
    assert "one exited or failed before it" in run.stderr
