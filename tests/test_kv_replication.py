"""Key-value heads replicated over the ranks that use them when the world size exceeds their
count: the placement `shard(D, groups=G)`, its plan, forecast, reads, forward and drawing."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import tpviz
from tpviz.chunks import shard_blocks
from tpviz.models import FIXED_PROMPT
from tpviz.plan import ResolvedPlan
from tpviz.strategies import STRATEGIES
from tpviz.strategies.counting import Counting
from tpviz.strategies.executor import plan_units
from tpviz.widgets import figures

from .conftest import write_config
from .hf_tiny import TINY_DIMS
from .test_plan import LLAMA_70B

K_PROJ = "model.layers.0.self_attn.k_proj.weight"
KV_ENTRIES = ("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")


@pytest.mark.parametrize("rows, groups, world_size", [(64, 4, 8), (10, 4, 8), (7, 2, 6)])
def test_groups_cut_as_torch_chunk_each_chunk_held_by_consecutive_ranks(rows, groups, world_size):
    whole = torch.arange(rows * 3).reshape(rows, 3)
    chunks = torch.chunk(whole, groups)
    share = world_size // groups
    for rank, blocks in enumerate(shard_blocks([rows, 3], 0, world_size, groups=groups)):
        want = chunks[rank // share] if rank // share < len(chunks) else whole[:0]
        got = [whole[b.offset[0] : b.offset[0] + b.shape[0]] for b in blocks]
        assert torch.equal(torch.cat(got) if got else whole[:0], want)


def _kv(plan: ResolvedPlan) -> list:
    return [t for t in plan.params if t.name.endswith(KV_ENTRIES)]


def test_demo_at_eight_ranks_replicates_its_four_kv_heads(tiny):
    plan = tpviz.resolve_plan(tiny, 8)
    assert not plan.errors
    kv = _kv(plan)
    assert len(kv) == 4 and all(t.placement == "shard(0, groups=4)" for t in kv)
    k = plan.tensor(K_PROJ)
    head = k.global_shape[0] // 4
    for shard in k.ranks:  # ranks 2g and 2g+1 hold head g
        assert [(b.offset[0], b.shape[0]) for b in shard.blocks] == [(shard.rank // 2 * head, head)]
    assert plan.local_kv_groups == {f"model.layers.{i}.self_attn": 1 for i in range(2)}
    extra = sum(sum(r.bytes for r in t.ranks) - t.nbytes for t in kv)
    (warning,) = [w for w in plan.warnings if w.code == "kv_heads_replicated"]
    assert f"({extra} bytes)" in warning.message and "2 consecutive ranks" in warning.message
    assert plan.per_rank_bytes == [sum(t.ranks[r].bytes for t in plan.params) for r in range(8)]
    again = ResolvedPlan.from_json(plan.to_json())
    assert again.tensor(K_PROJ).groups == 4 and again.local_kv_groups == plan.local_kv_groups


def test_without_replication_or_at_sizes_it_cannot_help_heads_are_refused(tiny):
    off = tpviz.resolve_plan(tiny, 8, kv_replication=False)
    assert {e.code for e in off.errors} == {"head_alignment"}
    message = off.errors[0].message
    assert "(this world size works with key-value replication, the default)" in message
    assert message.endswith("world sizes that work: 1, 2, 4")
    assert not _kv(off)[0].groups
    for size in (6, 12, 16):  # not a multiple of the 4 KV heads, or past the 8 query heads
        plan = tpviz.resolve_plan(tiny, size)
        assert {e.code for e in plan.errors} == {"head_alignment"}
        assert all(e.message.endswith("world sizes that work: 1, 2, 4, 8") for e in plan.errors)


@pytest.fixture(scope="module")
def llama70b(tmp_path_factory):
    return write_config(tmp_path_factory.mktemp("kv") / "llama70b", **LLAMA_70B)


@pytest.mark.parametrize("world_size, share", [(16, 2), (32, 4)])
def test_cli_plan_of_llama_70b_shows_the_replication_and_its_bytes(
    llama70b, cli, world_size, share
):
    done = cli("plan", str(llama70b), "--world-size", str(world_size), "--json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    kv = [p for p in plan["params"] if p["name"].endswith(KV_ENTRIES)]
    assert len(kv) == 160 and {p["placement"] for p in kv} == {"shard(0, groups=8)"}
    k = next(p for p in kv if p["name"] == K_PROJ)
    assert [r["shape"] for r in k["ranks"]] == [[128, 8192]] * world_size  # one head each
    extra = sum(sum(r["bytes"] for r in p["ranks"]) - 128 * 8 * 8192 * 2 for p in kv)
    assert extra == 160 * (share - 1) * 1024 * 8192 * 2
    (warning,) = [w for w in plan["warnings"] if w["code"] == "kv_heads_replicated"]
    assert f"({extra} bytes)" in warning["message"]
    assert len(plan["local_kv_groups"]) == 80
    assert set(plan["local_kv_groups"].values()) == {64 // world_size}
    text = cli("plan", str(llama70b), "--world-size", str(world_size))
    assert "warning [kv_heads_replicated]" in text.stdout and "shard(0, groups=8)" in text.stdout


def test_cli_no_kv_replication_and_sizes_that_cannot_work_exit_2(tiny, cli):
    done = cli("plan", str(tiny), "--world-size", "8", "--no-kv-replication")
    assert done.returncode == 2 and "key-value heads cannot be split over 8 ranks" in done.stderr
    done = cli("plan", str(tiny), "--world-size", "6", "--json")
    assert done.returncode == 2 and "world sizes that work: 1, 2, 4, 8" in done.stderr
    assert {e["code"] for e in json.loads(done.stdout)["errors"]} == {"head_alignment"}


def test_plan_view_past_the_kv_heads_draws_the_ranks_that_share_a_head(tiny):
    view = tpviz.PlanView(tpviz.resolve_plan(tiny, 4))
    view.world_size.value = 8
    assert not view.plan.errors and "kv_heads_replicated" in view.issues.value
    view.select(K_PROJ)
    blocks = [t for t in view.block_figure.data if t.meta["kind"] == "block"]
    assert len(blocks) == 8
    head = view.plan.tensor(K_PROJ).global_shape[0] // 4
    for d in blocks:
        rank = d.meta["rank"]
        pair = [rank // 2 * 2, rank // 2 * 2 + 1]
        assert d.meta["sharing"] == pair and f"same chunk as rank {pair[1 - rank % 2]}" in d.name
        xs = [x for x in d.x if x is not None]
        ys = [y for y in d.y if y is not None]
        # the head's rows, the rank's stripe of the columns (half each)
        assert (min(ys), max(ys)) == (rank // 2 * head, rank // 2 * head + head)
        assert (min(xs), max(xs)) == (rank % 2 * 64, rank % 2 * 64 + 64)
    assert "held whole by 2 ranks" in view.block_figure.layout.title.text
    fresh = figures.representative_tensor(view.plan.params)
    assert fresh.groups == 4
    # a plan resolved without replication keeps that choice when the view resolves it again
    strict = tpviz.PlanView(tpviz.resolve_plan(tiny, 4, kv_replication=False))
    strict.world_size.value = 8
    assert [e.code for e in strict.plan.errors] == ["head_alignment"]


def rank_tensors(model: torch.nn.Module, names: list[str]) -> dict:
    """This rank's local tensors of `names`, and each attention's `num_key_value_groups`."""
    from tpviz.models.adapter import local_of

    state = dict(model.named_parameters())
    groups = {
        n: m.num_key_value_groups
        for n, m in model.named_modules()
        if isinstance(getattr(m, "num_key_value_groups", None), int)
    }
    return {"tensors": {n: local_of(state[n]).detach().clone() for n in names}, "groups": groups}


@pytest.mark.slow
def test_demo_loads_at_eight_ranks_each_reading_its_groups_head(tiny):
    plan = tpviz.resolve_plan(tiny, 8)
    with tpviz.launch(tiny, 8, plan, verify=True, force=True) as job:
        result = job.wait(300)
        held = job.call(rank_tensors, [K_PROJ])
        # random init on the same ranks: the copies of each shared head must agree
        with job.reload(init="random") as drawn:
            random_check = drawn.wait(300).init_check
    assert random_check["ok"] and random_check["replicated_consistent"]
    assert result.verify["ok"] and result.verify["max_abs_diff"] <= 1e-4
    assert result.plan_matches_shards
    assert [r.param_bytes for r in result.ranks] == plan.per_rank_bytes
    assert [r.peak_tensor_bytes for r in result.ranks] == plan.forecast["sliced"]["peak_bytes"]
    index = json.loads((tiny / "model.safetensors.index.json").read_text())
    with safe_open(str(tiny / index["weight_map"][K_PROJ]), "pt") as f:
        k = f.get_tensor(K_PROJ)
    for rank, got in enumerate(held):
        assert torch.equal(got["tensors"][K_PROJ], k.chunk(4)[rank // 2])


@pytest.fixture(scope="module")
def llama_two_kv_heads(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY_DIMS, "num_key_value_heads": 2})
    model = transformers.LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("kv") / "llama-2kv"
    model.save_pretrained(path)
    with torch.no_grad():
        logits = model.eval()(torch.tensor(FIXED_PROMPT) % 1003).logits
    return path, logits


@pytest.mark.slow
def test_transformers_llama_with_two_kv_heads_matches_at_four_ranks(llama_two_kv_heads):
    path, reference = llama_two_kv_heads
    plan = tpviz.resolve_plan(path, 4, model="hf")
    assert not plan.errors and plan.tensor(K_PROJ).placement == "shard(0, groups=2)"
    with tpviz.launch(path, 4, plan, strategy="rank0_broadcast", force=True) as job:
        result = job.wait(300)
        logits = job.forward(torch.tensor(FIXED_PROMPT) % 1003)
        held = job.call(rank_tensors, [K_PROJ])
    assert (logits - reference).abs().max().item() <= 1e-4
    assert result.plan_matches_shards
    assert [r.param_bytes for r in result.ranks] == plan.per_rank_bytes
    forecast = plan.forecast["rank0_broadcast"]
    assert [r.peak_tensor_bytes for r in result.ranks] == forecast["peak_bytes"]
    assert [r.bytes_sent + r.bytes_received for r in result.ranks] == forecast["traffic_bytes"]
    # each rank's 2 query heads use its one key-value head: transformers repeats it twice
    assert all(set(h["groups"].values()) == {2} for h in held)


def test_random_init_draws_each_shared_head_once_for_the_ranks_holding_it(tiny):
    plan = tpviz.resolve_plan(tiny, 8)
    units = plan_units(plan)

    class Seeds(Counting):  # the counting executor, noting the seed each unit is drawn with
        def init_module(self, module: str, seed: int) -> None:
            self.seeds[module] = seed

    seeds = []
    for rank in range(8):
        x = Seeds(plan, rank, "cpu", "random", units)
        x.seeds = {}
        STRATEGIES["sliced"](x)
        seeds.append(x.seeds)
    k, q = "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.q_proj"
    assert [s[k] for s in seeds[::2]] == [s[k] for s in seeds[1::2]]  # ranks 2g, 2g+1 agree
    assert len({s[k] for s in seeds}) == 4 and len({s[q] for s in seeds}) == 8
