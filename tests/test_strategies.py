"""sliced, rank0_broadcast and replicated: same shards, same logits, different memory."""

from __future__ import annotations

import pytest
import torch

import tpviz
from tpviz.launcher import LoadJob
from tpviz.plan import resolve_plan
from tpviz.runtime.loader import LoadOptions

STRATEGIES = ("sliced", "rank0_broadcast", "replicated")


def _load_all(source, world_size):
    plan = resolve_plan(source, world_size)
    out = {}
    for strategy in STRATEGIES:
        with tpviz.launch(source, world_size, plan, strategy=strategy, verify=True) as job:
            result = job.wait(180)
            state = job.call("tests.helpers:local_state")
        out[strategy] = (result, state)
    return plan, out


@pytest.fixture(scope="module", params=[2, 3])
def loads(request, tiny, uneven3):
    source = tiny if request.param == 2 else uneven3
    return _load_all(source, request.param)


@pytest.mark.slow
def test_every_strategy_gives_bit_identical_shards(loads):
    plan, out = loads
    _, reference = out["sliced"]
    for strategy in ("rank0_broadcast", "replicated"):
        _, state = out[strategy]
        for rank in range(plan.world_size):
            assert state[rank].keys() == reference[rank].keys()
            for name, tensor in reference[rank].items():
                assert torch.equal(state[rank][name], tensor), (strategy, rank, name)


@pytest.mark.slow
def test_every_strategy_matches_the_reference_logits(loads):
    plan, out = loads
    for strategy, (result, _) in out.items():
        assert result["strategy"] == strategy
        assert result["verify"]["ok"] and result["verify"]["max_abs_diff"] <= 1e-4
        assert result["plan_matches_shards"]
        assert [r["param_bytes"] for r in result["ranks"]] == plan.per_rank_bytes


@pytest.mark.slow
def test_accounting_has_each_strategys_shape(loads):
    plan, out = loads
    whole = sum(t.source_nbytes() for t in plan.params if t.origin == "checkpoint")
    shards = plan.per_rank_bytes
    for strategy, (result, _) in out.items():
        for r in result["ranks"]:
            assert r["peak_tensor_bytes"] == r["forecast_peak_bytes"], (strategy, r["rank"])
            assert r["bytes_sent"] == r["forecast_bytes_sent"]
            assert r["bytes_received"] == r["forecast_bytes_received"]
    sliced = out["sliced"][0]["ranks"]
    assert [r["peak_tensor_bytes"] for r in sliced] == shards  # f32 on CPU: no staging
    replicated = out["replicated"][0]["ranks"]
    assert all(r["peak_tensor_bytes"] >= whole for r in replicated)
    rank0 = out["rank0_broadcast"][0]["ranks"]
    assert rank0[0]["peak_tensor_bytes"] > max(r["peak_tensor_bytes"] for r in rank0[1:])
    largest_unit = max(sum(t.source_nbytes() for t in unit) for _, unit in plan.units())
    assert rank0[0]["peak_tensor_bytes"] <= shards[0] + largest_unit + max(
        t.ranks[1].bytes for t in plan.params
    )
    assert rank0[0]["bytes_sent"] == sum(r["bytes_received"] for r in rank0[1:]) > 0
    assert all(r["bytes_sent"] == r["bytes_received"] == 0 for r in sliced + replicated)


@pytest.mark.slow
def test_random_init_is_one_consistent_model(config_only):
    checks = {}
    for strategy in STRATEGIES:
        with tpviz.launch(
            config_only, 2, strategy=strategy, init="random", seed=11, verify=True
        ) as job:
            result = job.wait(180)
            checks[strategy] = result
    for strategy in ("replicated", "rank0_broadcast"):
        check = checks[strategy]["init_check"]
        assert check["ok"] and check["replicated_consistent"] and check["matches_single_process"]
        assert checks[strategy]["verify"]["ok"]
    sliced = checks["sliced"]["init_check"]
    assert sliced["replicated_consistent"] and sliced["matches_single_process"] is None
    assert "cannot" in sliced["note"]
    for result in checks.values():
        for r in result["ranks"]:
            assert r["peak_tensor_bytes"] == r["forecast_peak_bytes"]
            assert r["bytes_sent"] == r["forecast_bytes_sent"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy, skewed", [("replicated", 1), ("rank0_broadcast", 0)])
def test_a_diverged_seed_on_one_rank_is_caught_naming_the_tensor(config_only, strategy, skewed):
    # LoadOptions.seed_skew shifts one rank's seed: reached here, not through launch()
    options = LoadOptions(strategy, "random", 11, seed_skew={skewed: 1})
    with LoadJob(resolve_plan(config_only, 2), options) as job:
        check = job.wait(180)["init_check"]
    assert not check["ok"] and check["matches_single_process"] is False
    assert "model.layers.0.self_attn.q_proj.weight" in check["mismatched"]


def test_config_only_source_needs_random_init(config_only):
    with pytest.raises(ValueError, match="--init random"):
        tpviz.launch(config_only, 2)


@pytest.mark.slow
def test_cli_load_random_init_and_compare(tmp_path, config_only, tiny, cli):
    import json

    result = cli(
        "load",
        str(config_only),
        "--init",
        "random",
        "--seed",
        "3",
        "--strategy",
        "replicated",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["init_check"]["matches_single_process"]
    compared = cli("compare", str(tiny), "--world-size", "2", "--json")
    assert compared.returncode == 0, compared.stderr
    entries = json.loads(compared.stdout)["strategies"]
    assert [e["strategy"] for e in entries] == list(STRATEGIES)
    assert entries[0]["ratio_to_sliced"] == {"load_seconds": 1.0, "peak_rss_bytes": 1.0}
    assert all("ratio_to_sliced" in r for e in entries for r in e["ranks"])
    from tpviz.report import compare_table

    text = compare_table(entries)
    for word in ("rank0_broadcast", "replicated", "x sliced (RSS)"):
        assert word in text
