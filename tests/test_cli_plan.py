"""`tpviz make-checkpoint` and `tpviz plan` as a user runs them."""

from __future__ import annotations

import json
import os
import re
import stat

import pytest

from tpviz.cli import main
from tpviz.format import human_bytes

from .conftest import REPO, run_cli, write_config
from .test_plan import LLAMA_70B


def test_make_checkpoint_then_plan_json(tmp_path, cli):
    out = tmp_path / "ck"
    made = cli(
        "make-checkpoint",
        str(out),
        "--preset",
        "tiny",
        "--vocab",
        "1001",
        "--max-shard-size",
        "400000",
        "--json",
    )
    assert made.returncode == 0, made.stderr
    assert "model.safetensors.index.json" in json.loads(made.stdout)["files"]
    shown = cli("plan", str(out), "--world-size", "2", "--json")
    assert shown.returncode == 0, shown.stderr
    plan = json.loads(shown.stdout)
    assert plan["world_size"] == 2 and plan["dtype"] == "float32" and not plan["errors"]
    lm_head = next(p for p in plan["params"] if p["name"] == "lm_head.weight")
    assert [r["shape"] for r in lm_head["ranks"]] == [[501, 128], [500, 128]]
    assert set(plan["forecast"]) == {"sliced", "rank0_broadcast", "replicated"}


def test_make_checkpoint_says_mib_and_writes_files_with_the_umask_mode(tmp_path, capsys):
    old = os.umask(0o027)
    try:
        assert main(["make-checkpoint", str(tmp_path / "ck"), "--max-shard-size", "600000"]) == 0
    finally:
        os.umask(old)
    out = capsys.readouterr().out
    assert re.search(r"\(2\.4 MiB\)", out) and " MB" not in out
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "ck").iterdir()}
    assert len(modes) > 3 and set(modes.values()) == {0o640}, modes


def test_plan_table_for_a_70b_config_adds_up(tmp_path, capsys):
    source = write_config(tmp_path / "llama70b", **LLAMA_70B)
    assert main(["plan", str(source), "--world-size", "8"]) == 0
    text = capsys.readouterr().out
    assert "per rank: ranks 0-7: 16.4 GiB" in text
    # ranks holding the same are folded: the table does not widen with the world size
    assert max(len(line) for line in text.split("\n\n")[0].splitlines()) <= 120
    assert main(["plan", str(source), "--world-size", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    replicated = sum(
        p["ranks"][0]["bytes"] for p in data["params"] if p["placement"] == "replicate"
    )
    assert sum(data["per_rank_bytes"]) == data["total_bytes"] + 7 * replicated
    assert data["per_rank_bytes"] == [
        sum(p["ranks"][r]["bytes"] for p in data["params"]) for r in range(8)
    ]
    # a folded row's bytes are the row's total: 80 tensors' shards, not one
    up = [p for p in data["params"] if p["name"].endswith("mlp.up_proj.weight")]
    row = next(line for line in text.splitlines() if "mlp.up_proj.weight x80" in line)
    assert len(up) == 80 and "row folded xN: all N tensors together" in text
    assert row.endswith(human_bytes(sum(p["ranks"][0]["bytes"] for p in up)))


def test_ranks_that_differ_are_shown_apart(uneven3, capsys):
    assert main(["plan", str(uneven3), "--world-size", "3", "--full"]) == 0
    row = next(
        x for x in capsys.readouterr().out.splitlines() if x.startswith("model.embed_tokens")
    )
    assert "ranks 0-1: 334×96, rank 2: 333×96" in row


def test_plan_errors_keep_stdout_and_give_stderr_one_line_and_exit_2(tiny, capsys):
    assert main(["plan", str(tiny), "--world-size", "3", "--json"]) == 2
    out, err = capsys.readouterr()
    errors = json.loads(out)["errors"]
    assert len(errors) == 2 and {e["code"] for e in errors} == {"head_alignment"}
    assert (
        len(err.strip().splitlines()) == 1 and "heads" in err and "; and 1 more plan error" in err
    )
    assert main(["plan", str(tiny), "--world-size", "3"]) == 2
    out, err = capsys.readouterr()
    assert "error [head_alignment]" in out and len(err.strip().splitlines()) == 1
    # a command that stops on the plan lists it whole in its JSON, one line on stderr
    assert main(["load", str(tiny), "--world-size", "3", "--json"]) == 2
    out, err = capsys.readouterr()
    assert json.loads(out)["errors"] == errors and len(err.strip().splitlines()) == 1


def test_bad_input_is_one_line_on_stderr_and_exit_2(tmp_path, tiny, capsys):
    assert main(["plan", str(tmp_path / "nope"), "--world-size", "2"]) == 2
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and "nope" in err and out == ""
    bad_plan = tmp_path / "plan.json"
    bad_plan.write_text("{not json")
    assert main(["plan", str(tiny), "--plan", str(bad_plan), "--json"]) == 2
    out, err = capsys.readouterr()
    assert "plan.json" in err and len(err.strip().splitlines()) == 1
    assert json.loads(out)["errors"]


def test_rows_with_an_unusable_style_are_marked_in_error(tmp_path, tiny, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text(
        json.dumps({"layers.*.mlp.up_proj": "colwize", "layers.*.mlp.down_proj": "gather"})
    )
    assert main(["plan", str(tiny), "--plan", str(plan)]) == 2
    out, err = capsys.readouterr()
    rows = {line.split()[0]: line.split()[2] for line in out.splitlines() if "_proj.weight" in line}
    assert rows["model.layers.*.mlp.up_proj.weight"] == "colwize"
    assert rows["model.layers.*.mlp.down_proj.weight"] == "gather"
    assert "colwize (error)" in out and "gather (error)" in out
    assert "layers.*.mlp.up_proj" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow  # a fresh interpreter: `python -m tpviz` reaches main
def test_module_entry_point_runs():
    assert run_cli("--help").returncode == 0


@pytest.mark.slow  # a fresh interpreter, whose stdout's reader leaves early
def test_a_reader_that_stops_early_gets_no_traceback(tmp_path):
    """`tpviz plan ... | head`: the rest has no reader; the CLI stops as a pipe's writer does
    (exit 128 + SIGPIPE), without a traceback. The output (a 70B plan's, 80 layers a row per
    tensor, about 1 MB as JSON) is far more than a pipe holds, so it is still being written."""
    import subprocess
    import sys

    source = write_config(tmp_path / "llama70b", **LLAMA_70B)
    command = [sys.executable, "-m", "tpviz", "plan", str(source), "--full", "--json"]
    plan = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    plan.stdout.read(10)
    plan.stdout.close()
    _, err = plan.communicate(timeout=120)
    assert plan.returncode == 141 and b"Traceback" not in err, err
