"""`tpviz load` and `tpviz demo` as a user runs them."""

from __future__ import annotations

import gc
import json
import re
import time

import psutil
import pytest

import tpviz
from tpviz.events import read_events_dir


@pytest.mark.slow
def test_load_json_with_events_dir_and_a_plan_file(tmp_path, tiny, cli):
    plan = tmp_path / "plan.json"
    plan.write_text(
        json.dumps(
            {
                "tp_plan": {"lm_head": "colwise_gather_output"},
                "base_model_tp_plan": {
                    "layers.*.mlp.up_proj": "colwise",
                    "layers.*.mlp.gate_proj": "colwise",
                    "layers.*.mlp.down_proj": "rowwise",
                },
            }
        )
    )
    events = tmp_path / "events"
    result = cli(
        "load",
        str(tiny),
        "--world-size",
        "2",
        "--plan",
        str(plan),
        "--dtype",
        "bfloat16",
        "--verify",
        "--events",
        str(events),
        "--json",
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["dtype"] == "bfloat16" and data["verify"]["ok"] and data["plan_matches_shards"]
    assert data["verify"]["tolerance"] == 5e-2
    assert sorted(p.name for p in events.iterdir()) == ["rank0.jsonl", "rank1.jsonl"]
    assert {e.type for e in read_events_dir(events)} >= {
        "phase",
        "unit_start",
        "unit_done",
        "memory",
        "done",
    }


@pytest.mark.slow
def test_load_human_output_and_a_failing_load_exits_1(tmp_path, tiny, cli):
    result = cli("load", str(tiny), "--world-size", "2", "--strategy", "rank0_broadcast")
    assert result.returncode == 0, result.stderr
    assert "rank0_broadcast on 2 cpu rank(s)" in result.stdout
    assert "peak RSS +" in result.stdout and "mmap" in result.stdout
    assert "rank 1: loaded" in result.stderr  # progress, shown as lines off a terminal
    timed_out = cli("load", str(tiny), "--world-size", "2", "--timeout", "0.001", "--json")
    assert timed_out.returncode == 1
    assert "timeout" in json.loads(timed_out.stdout)["errors"][0]["message"]


def test_invalid_load_input_exits_2_before_anything_starts(tiny, cli):
    result = cli("load", str(tiny), "--world-size", "3")
    assert result.returncode == 2
    assert "heads" in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_demo_makes_plans_loads_and_verifies(tmp_path, cli):
    result = cli("demo", "--preset", "tiny", env={"TPVIZ_CACHE": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "demo-tiny" / "config.json").exists()
    assert "embedding_rowwise" in result.stdout  # the plan table
    assert "verify: max |logits - reference|" in result.stdout and ": ok" in result.stdout
    again = cli("demo", "--preset", "tiny", "--json", env={"TPVIZ_CACHE": str(tmp_path)})
    assert again.returncode == 0 and json.loads(again.stdout)["verify"]["ok"]


@pytest.mark.slow
def test_an_abandoned_job_is_shut_down_when_collected(tiny):
    job = tpviz.launch(tiny, 2)
    job.wait(120)
    pids = [p.pid for p in job._procs]
    del job
    gc.collect()
    deadline = time.monotonic() + 10
    while (
        any(
            psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
            for p in pids
        )
        and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert not any(
        psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids
    )


def test_options_that_cannot_take_effect_are_refused_before_launch(tiny, cli):
    done = cli("load", str(tiny), "--seed", "3")  # loads the checkpoint: no seed to use
    assert done.returncode == 2 and "--seed seeds --init random" in done.stderr
    done = cli("load", str(tiny), "--profile-forward")
    assert done.returncode == 2
    assert (
        "profile_forward profiles into profile_dir" in done.stderr
        and "--profile DIR" in done.stderr
    )
    seeds = "seed must be an integer from -2**63 to 2**64 - 1"
    for kwargs, wrong in [
        ({"dtype": 5}, "dtype must be a name such as 'bfloat16' or a torch.dtype, not 5"),
        ({"verify": "no"}, "verify must be True or False, not 'no'"),
        ({"kv_replication": 1}, "kv_replication must be True or False, not 1"),
        ({"profile_forward": "x"}, "profile_forward must be True or False, not 'x'"),
        ({"init": "random", "seed": "x"}, f"{seeds}, not 'x'"),
        ({"init": "random", "seed": 2**70}, f"{seeds}, not {2**70}"),
        ({"heartbeat_timeout": None}, "heartbeat_timeout must be a positive, finite number"),
        ({"events_dir": 5}, "events_dir must be a directory's path (str or os.PathLike), not 5"),
        ({"model": 5}, "model must be a name (auto, builtin, hf, hf-remote-code or PKG.MOD:FN)"),
    ]:
        with pytest.raises(ValueError, match=re.escape(wrong)):
            tpviz.launch(tiny, 2, **kwargs)
    for hz in ("fast", 1e-300, float("nan"), -1):
        with pytest.raises(ValueError, match="memory_hz must be 0 .* or from 0.1 to 1000.0"):
            tpviz.launch(tiny, 2, memory_hz=hz)
    for strategies, wrong in [(("sliced", "bogus"), "unknown strategy 'bogus'"), ("sliced", "")]:
        with pytest.raises(ValueError, match=wrong or "a non-empty tuple of strategy names"):
            tpviz.compare(tiny, 2, strategies=strategies)  # before any rank starts
