"""sliced, rank0_broadcast and replicated: same shards, same logits, different memory."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import tpviz
from tpviz.checkpoint import BlockReader, Checkpoint
from tpviz.launcher import LoadJob
from tpviz.models import get_adapter, read_config
from tpviz.models.adapter import local_of
from tpviz.plan import ResolvedPlan, TensorPlan, resolve_plan
from tpviz.runtime.executor import LoadContext
from tpviz.runtime.loader import LoadOptions
from tpviz.runtime.parallelize import lookup
from tpviz.runtime.reference import FullModel, plan_skeleton
from tpviz.strategies import STRATEGIES, Executor, Ledger, Strategy, forecast
from tpviz.strategies.counting import Counting
from tpviz.strategies.executor import plan_units


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


# --- the forecast is the strategy's own steps, counted ------------------------------------------


def unit_at_a_time(x: Executor) -> None:
    """A strategy written for this test only: every rank makes one unit's whole tensors,
    keeps its parts and drops the rest. No forecast code exists for it."""
    for index, total, module, tensors in x.units():
        with x.unit(index, total, module, tensors):
            fulls = x.full_tensors(module, tensors)
            for t, full in zip(tensors, fulls):
                x.install(t, x.fill(x.shard(t), full, t, x.rank))
            for t, full in zip(tensors, fulls):
                x.free_full(t, full)


def test_a_new_strategy_is_forecast_from_its_steps_alone(tiny, monkeypatch):
    monkeypatch.setitem(STRATEGIES, "unit_at_a_time", unit_at_a_time)
    plan = resolve_plan(tiny, 2)
    fc = forecast(plan, "unit_at_a_time")
    computed = [
        sum(t.ranks[r].bytes for t in plan.params if t.origin == "computed") for r in (0, 1)
    ]
    for rank in (0, 1):  # what the steps above hold at most: kept shards, then one unit whole
        held, peak = computed[rank], 0
        for _, unit in plan.units():
            whole = sum(t.source_nbytes() for t in unit)
            peak = max(peak, held + whole + sum(t.ranks[rank].bytes for t in unit))
            held += sum(t.ranks[rank].bytes for t in unit)
        assert fc.peak_bytes[rank] == peak
        assert held == plan.per_rank_bytes[rank]  # computed buffers included
    assert fc.sent_bytes == fc.received_bytes == [0, 0]
    with pytest.raises(ValueError, match="unknown strategy 'sliced2'.*unit_at_a_time"):
        forecast(plan, "sliced2")


class Traced:
    """An executor that delegates to another and records each operation a strategy calls:
    what it was given and returned (a tensor as its bytes, a tensor plan as its name) and the
    ledger after it. Run over the real executor and the counting one, the records must agree."""

    def __init__(self, inner: Executor):
        self.inner = inner
        self.trace: list[tuple] = []

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if name in ("units", "unit") or not callable(attr):
            return attr

        def operation(*args):
            out = attr(*args)
            seen = (name, [_seen(a) for a in args], _seen(out), self.inner.ledger.current)
            self.trace.append(seen)
            return out

        return operation


def _seen(value):
    if isinstance(value, TensorPlan):
        return value.name
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list):
        return [_seen(v) for v in value]
    return value


def real_context(plan: ResolvedPlan, rank: int, init: str, mesh: DeviceMesh) -> LoadContext:
    """The runtime's executor for `rank` of the process group of `mesh`, as the loader
    prepares it (without forward hooks or events)."""
    config = read_config(plan.source)
    adapter = get_adapter(config, plan.model, plan.source)
    model = plan_skeleton(plan, adapter, config, torch.device("cpu"))
    ledger = Ledger()
    for t in plan.params:
        if t.origin == "computed":
            ledger.alloc(local_of(lookup(model, t.name)).nbytes)
    cpu = torch.device("cpu")
    ctx = LoadContext(model, plan, adapter, rank, cpu, cpu, ledger, lambda e: None, lambda: None)
    ctx.mesh = mesh
    ctx.init = init  # seed 0, as the counting executor has
    ctx.make_reference = lambda: FullModel(plan, adapter, config, ctx.seed)
    if init == "checkpoint":
        ctx.checkpoint = Checkpoint.open(plan.source)
    return ctx


WRITTEN: dict[str, Strategy] = {**STRATEGIES, "unit_at_a_time": unit_at_a_time}
RUNS = [(name, init) for name in WRITTEN for init in ("checkpoint", "random")]


def traces_on_rank(plan: ResolvedPlan, rank: int) -> list[tuple[list, int]]:
    """(trace, ledger peak) of each of `RUNS` on this rank, run by the real executor."""
    out, mesh = [], init_device_mesh("cpu", (plan.world_size,))
    for name, init in RUNS:
        ctx = real_context(plan, rank, init, mesh)
        traced = Traced(ctx)
        with BlockReader() as ctx.reader:
            WRITTEN[name](traced)
        out.append((traced.trace, ctx.ledger.peak))
    return out


def counted(plan: ResolvedPlan, rank: int, name: str, init: str) -> tuple[list, int]:
    """(trace, ledger peak) of strategy `name` on `rank`, run by the counting executor."""
    counting = Counting(plan, rank, "cpu", init, plan_units(plan))
    traced = Traced(counting)
    WRITTEN[name](traced)
    return traced.trace, counting.ledger.peak


@pytest.mark.parametrize("dtype", [None, "bfloat16"])  # bfloat16: reads staged through buffers
def test_the_runtime_and_the_forecast_see_the_same_steps(tiny, tmp_path, monkeypatch, dtype):
    plan = resolve_plan(tiny, 1, dtype=dtype)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdv", rank=0, world_size=1)
    try:
        real = traces_on_rank(plan, 0)
    finally:
        dist.destroy_process_group()
    for (name, init), (trace, peak) in zip(RUNS, real):
        assert (trace, peak) == counted(plan, 0, name, init), (name, init)
        if name in STRATEGIES:
            assert peak == forecast(plan, name, "cpu", init).peak_bytes[0]


def _rank_main(plan: ResolvedPlan, rank: int, rendezvous: str, queue) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=plan.world_size)
    try:
        queue.put((rank, traces_on_rank(plan, rank)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_every_rank_sees_the_steps_it_was_forecast_with_sends_and_views(uneven3, tmp_path):
    plan = resolve_plan(uneven3, 3)  # uneven parts: some sent as views, some through copies
    spawn = mp.get_context("spawn")
    queue = spawn.Queue()
    rendezvous = f"file://{tmp_path}/rdv"
    procs = [spawn.Process(target=_rank_main, args=(plan, r, rendezvous, queue)) for r in range(3)]
    try:
        for p in procs:
            p.start()
        real = dict(queue.get(timeout=300) for _ in procs)
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
    finally:  # a rank that failed leaves the others waiting in a collective
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    for rank in range(3):
        for (name, init), got in zip(RUNS, real[rank]):
            assert got == counted(plan, rank, name, init), (name, init, rank)
    rank0_broadcast = real[0][RUNS.index(("rank0_broadcast", "checkpoint"))][0]
    assert {"view", "part", "send", "broadcast"} <= {step[0] for step in rank0_broadcast}
