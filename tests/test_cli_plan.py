"""`tpviz make-checkpoint` and `tpviz plan` as a user runs them."""

from __future__ import annotations

import json

import pytest

from .conftest import run_cli, write_config
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


def test_plan_table_for_a_70b_config_adds_up(tmp_path, cli):
    source = write_config(tmp_path / "llama70b", **LLAMA_70B)
    text = cli("plan", str(source), "--world-size", "8")
    assert text.returncode == 0, text.stderr
    assert "model.layers.*.mlp.up_proj.weight x80" in text.stdout
    assert "per rank: rank 0:" in text.stdout and "rank 7:" in text.stdout
    data = json.loads(cli("plan", str(source), "--world-size", "8", "--json").stdout)
    replicated = sum(
        p["ranks"][0]["bytes"] for p in data["params"] if p["placement"] == "replicate"
    )
    assert sum(data["per_rank_bytes"]) == data["total_bytes"] + 7 * replicated
    assert data["per_rank_bytes"] == [
        sum(p["ranks"][r]["bytes"] for p in data["params"]) for r in range(8)
    ]


def test_plan_with_errors_exits_2_and_lists_them(tiny, cli):
    result = cli("plan", str(tiny), "--world-size", "3", "--json")
    assert result.returncode == 2
    errors = json.loads(result.stdout)["errors"]
    assert {e["code"] for e in errors} == {"head_alignment"}
    human = cli("plan", str(tiny), "--world-size", "3")
    assert human.returncode == 2 and "error [head_alignment]" in human.stdout


def test_bad_input_is_one_line_on_stderr_and_exit_2(tmp_path, tiny, cli):
    missing = cli("plan", str(tmp_path / "nope"), "--world-size", "2")
    assert missing.returncode == 2
    assert len(missing.stderr.strip().splitlines()) == 1 and "nope" in missing.stderr
    bad_plan = tmp_path / "plan.json"
    bad_plan.write_text("{not json")
    result = cli("plan", str(tiny), "--plan", str(bad_plan), "--json")
    assert result.returncode == 2 and "plan.json" in result.stderr
    assert json.loads(result.stdout)["errors"]


def test_unknown_style_in_a_plan_file(tmp_path, tiny, cli):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"layers.*.mlp.up_proj": "colwize"}))
    result = cli("plan", str(tiny), "--plan", str(plan))
    assert result.returncode == 2
    assert "colwise" in result.stdout and "layers.*.mlp.up_proj" in result.stdout


@pytest.mark.slow  # a fresh interpreter: `python -m tpviz` reaches main
def test_module_entry_point_runs():
    assert run_cli("--help").returncode == 0
