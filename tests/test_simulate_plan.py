"""`tpviz.simulate_plan` and `tpviz plan --simulate`: any resolved plan (shipped, written by
hand, in any layout) run on simulated ranks against the whole model before a load, so that
styles that do not compose are found without starting a rank: a forward that breaks names
the module it broke in, and silently wrong logits are caught by the comparison."""

from __future__ import annotations

import json

import pytest
from torch import nn

import tpviz
from tpviz import cli
from tpviz.models.demo import make_checkpoint

from .hf_tiny import TINY_DIMS, gemma4_with_vision, save_tiny

transformers = pytest.importorskip("transformers")

# o_proj colwise: attention hands it a rank's heads, and it expects every feature
UNCOMPOSED = {
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "colwise",
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """name -> checkpoint dir, built once on first use."""
    root = tmp_path_factory.mktemp("simulate")
    built = {}

    def get(name: str):
        if name not in built:
            if name == "llama":
                built[name] = make_checkpoint(root / name, "tiny")
            else:
                changes = dict(num_local_experts=4) if name == "mixtral" else {}
                config = transformers.AutoConfig.for_model(
                    name, **TINY_DIMS, pad_token_id=0, **changes
                )
                built[name] = save_tiny(config, root / name, seed=len(built))
        return built[name]

    return get


@pytest.mark.parametrize(
    "name, world_size, layout",
    [
        ("llama", 2, {}),
        ("llama", 8, {}),  # 4 key-value heads over 8 ranks: each replicated on two
        ("phi3", 2, {}),  # fused qkv and gate_up
        ("mixtral", 2, {"experts": "tp"}),
        ("mixtral", 2, {"experts": "ep"}),  # whole experts per rank, routes remapped
    ],
)
def test_shipped_plans_reproduce_the_whole_model_in_every_layout(
    checkpoint, name, world_size, layout
):
    plan = tpviz.resolve_plan(checkpoint(name), world_size, **layout)
    assert plan.errors == []
    if world_size == 8:
        assert plan.local_kv_groups  # the replication really is simulated
    simulation = tpviz.simulate_plan(plan)
    assert simulation.ok, simulation.line()
    assert 0 <= simulation.max_abs_diff <= simulation.tolerance
    assert simulation.world_size == world_size and simulation.reason is None


def test_styles_that_do_not_compose_fail_naming_the_module(checkpoint):
    plan = tpviz.resolve_plan(checkpoint("llama"), 2, UNCOMPOSED)
    assert plan.errors == []  # every style fits its own tensors: only running them tells
    simulation = tpviz.simulate_plan(plan)
    assert not simulation.ok and simulation.max_abs_diff is None
    assert "forward fails in model.layers.0.self_attn.o_proj" in simulation.reason
    assert simulation.reason in simulation.line() and "FAILED" in simulation.line()


def test_silently_wrong_logits_are_caught(checkpoint):
    # plain colwise on Phi-3's fused [gate; up] gives rank 0 all of gate: it runs, wrongly
    wrong = {
        "model.layers.*.mlp.gate_up_proj": "colwise",
        "model.layers.*.mlp.down_proj": "rowwise",
    }
    simulation = tpviz.simulate_plan(tpviz.resolve_plan(checkpoint("phi3"), 2, wrong))
    assert not simulation.ok and simulation.max_abs_diff > simulation.tolerance
    assert "logits differ from the whole model's" in simulation.reason


def test_cli_simulate_exits_by_the_verdict(checkpoint, tmp_path, capsys):
    source = str(checkpoint("llama"))
    assert cli.main(["plan", source, "--simulate"]) == 0
    out, err = capsys.readouterr()
    assert "simulated 2 ranks" in err and err.strip().endswith(": ok") and "q_proj" in out
    bad = tmp_path / "uncomposed.json"
    bad.write_text(json.dumps(UNCOMPOSED))
    assert cli.main(["plan", source, "--plan", str(bad), "--simulate", "--json"]) == 1
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert data["world_size"] == 2  # stdout is the plan JSON, as without it
    assert "FAILED" in err and "self_attn.o_proj" in err and "Traceback" not in err
    # with the verdict, as --json promises on failure: its errors, and the simulation itself
    assert [e["code"] for e in data["errors"]] == ["SimulationFailed"]
    assert data["simulation"]["ok"] is False and "o_proj" in data["simulation"]["reason"]
    assert cli.main(["plan", source, "--simulate", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["simulation"]["ok"] is True
    assert cli.main(["plan", source, "--world-size", "3", "--simulate"]) == 2  # plan errors
    assert "simulated" not in capsys.readouterr().err
    assert cli.main(["plan", source, "--suggest", "--simulate"]) == 2
    assert "drop --simulate" in capsys.readouterr().err


def test_a_plan_resolved_from_a_module_is_refused():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="checkpoint or config directory"):
        tpviz.simulate_plan(tpviz.resolve_plan(model, 2, {}))


def test_a_config_whose_own_forward_fails_is_named_as_the_cause(tmp_path, capsys):
    # more experts per token than experts: the model itself cannot run, whatever the plan
    config = transformers.AutoConfig.for_model(
        "mixtral", **TINY_DIMS, pad_token_id=0, num_local_experts=2, num_experts_per_tok=4
    )
    config.save_pretrained(tmp_path)
    assert cli.main(["plan", str(tmp_path), "--simulate"]) == 2
    err = capsys.readouterr().err
    assert "the whole model's forward fails" in err and "check the config" in err
    assert len(err.strip().splitlines()) == 1


def test_a_sharded_weight_read_outside_its_module_fails_as_on_real_ranks(tmp_path):
    # real ranks hold the cut embedding as a DTensor, and Gemma 4's own forward indexes it
    # (its pad row) and mixes that with plain tensors: they fail there, so must simulated ranks
    gemma4_with_vision().save_pretrained(tmp_path)
    plan = tpviz.resolve_plan(tmp_path, 2)
    assert not plan.errors
    embedding = "model.language_model.embed_tokens"
    assert plan.module_styles[embedding] == "embedding_rowwise"
    simulation = tpviz.simulate_plan(plan)
    assert not simulation.ok
    assert f"reads {embedding}.weight outside its module's forward" in simulation.reason
    assert f"keep {embedding} whole" in simulation.reason
    suggestion = tpviz.suggest_plan(tmp_path, 2)
    assert suggestion.resolved.tensor(f"{embedding}.weight").placement == "replicate"
    assert suggestion.resolved.tensor(f"{embedding}_per_layer.weight").placement != "replicate"
    assert tpviz.simulate_plan(suggestion.resolved).ok
