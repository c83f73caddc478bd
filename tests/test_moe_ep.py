"""Mixture-of-experts models under expert parallelism (`experts="ep"`): whole experts per rank
(`grouped_gemm`, placement shard(0) along the expert dim), the router replicated, each rank
running only its own experts and the outputs all-reduced (`ep_dispatch_experts`); attention and
the rest keep the TP plan. Also DeepSeek-V3 (MLA, shared experts, dense first layers) and
gpt-oss (biases, attention sinks, transposed experts) under both layouts.

Checkpoints are made with transformers' own classes and `save_pretrained` in several files
(one tensor per expert where the class saves them so)."""

from __future__ import annotations

import json

import pytest
import torch

import tpviz
from tpviz.format import human_bytes
from tpviz.keymap import pieces
from tpviz.launcher import load_next
from tpviz.models import FIXED_PROMPT

from .moe_configs import DEEPSEEK_V3, MIXTRAL_8X7B, config_dir
from .test_moe import (
    EXPERTS,
    EXPERTS_TP,
    MODELS,
    TP_PLANS,
    config_of,
    save_models,
    transformers_logits,
)

transformers = pytest.importorskip("transformers")

MORE_MODELS = {  # name: (model_type, config), beside test_moe's
    "deepseek_v3": (
        "deepseek_v3",
        dict(
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=4,
            n_shared_experts=1,
            first_k_dense_replace=1,  # layer 0 is a dense MLP, layer 1 a MoE block
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            n_group=1,
            topk_group=1,
            num_key_value_heads=4,
        ),
    ),
    "gpt_oss": (
        "gpt_oss",
        dict(
            intermediate_size=48,
            num_local_experts=4,
            head_dim=16,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
}
ALL = {**MODELS, **MORE_MODELS}
# the TP plans: transformers 5.25's for these classes, with the experts cut as 5.24 cut them
# (DeepSeek-V3's); gpt-oss's plan has no expert keys, so tpviz derives them from its experts
# module (transposed, gate and up interleaved, biases)
TP = {
    **TP_PLANS,
    "deepseek_v3": {
        "layers.*.self_attn.q_b_proj": "colwise",
        "layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj",
        "layers.*.self_attn.kv_b_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        **{f"layers.*.mlp.shared_experts.{p}": "colwise" for p in ("gate_proj", "up_proj")},
        "layers.*.mlp.shared_experts.down_proj": "rowwise",
        **{f"layers.*.mlp.{p}": "colwise" for p in ("gate_proj", "up_proj")},
        "layers.*.mlp.down_proj": "rowwise",
        **EXPERTS_TP,
    },
    "gpt_oss": {
        **{f"layers.*.self_attn.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj")},
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.self_attn.sinks": "local_rowwise",
    },
}
MOE_LAYER = {"deepseek_v3": 1}  # the first layer with experts (DeepSeek's layer 0 is dense)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """name -> checkpoint directory, written by the model class in several files."""
    return save_models(tmp_path_factory.mktemp("moe_ep"), ALL)


def experts_of(name: str) -> str:
    return EXPERTS.format(MOE_LAYER.get(name, 0))


# --- plans (no processes) -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_ep_gives_every_rank_whole_experts_and_keeps_the_tp_plan_elsewhere(moe, name):
    tp = tpviz.resolve_plan(moe[name], 2, TP[name])
    ep = tpviz.resolve_plan(moe[name], 2, TP[name], experts="ep")
    assert not ep.errors, ep.errors
    assert (tp.experts, ep.experts) == ("tp", "ep")
    assert ep.module_styles[experts_of(name)] == "ep_dispatch_experts"
    assert "moe_tp_experts" not in ep.patterns.values()  # the TP plan's expert keys replaced
    experts = [t for t in ep.params if t.module == experts_of(name)]
    assert experts and all(t.style == "grouped_gemm" for t in experts)
    for t in experts:  # shard(0): experts 0-1 on rank 0, 2-3 on rank 1, every other dim whole
        assert t.placement == "shard(0)"
        assert [r.blocks[0].offset[0] for r in t.ranks] == [0, 2]
        assert [r.shape for r in t.ranks] == [[2, *t.global_shape[1:]]] * 2
    for t in ep.params:  # everything else exactly as under TP
        if t.module != experts_of(name) and ".experts" not in t.module:
            held = tp.tensor(t.name)
            assert (t.style, t.placement, t.ranks) == (held.style, held.placement, held.ranks)
    block = experts_of(name).rsplit(".", 1)[0]
    router = [t for t in ep.params if t.module in (f"{block}.gate", f"{block}.router")]
    assert router and all(t.placement == "replicate" for t in router)
    assert ep.per_rank_bytes == [sum(t.ranks[r].bytes for t in ep.params) for r in range(2)]


def test_each_rank_reads_only_its_own_experts_checkpoint_tensors(moe):
    plan = tpviz.resolve_plan(moe["mixtral"], 2, experts="ep")
    gate_up = plan.tensor(f"{EXPERTS.format(0)}.gate_up_proj")
    assert len(gate_up.checkpoint_keys) == 8  # w1 and w3 of four experts, stacked and joined
    for rank, mine in enumerate(({"experts.0.", "experts.1."}, {"experts.2.", "experts.3."})):
        shard = gate_up.ranks[rank]
        read = {
            gate_up.sources[p.source].key
            for p in pieces(gate_up.sources, shard.blocks, 0, shard.shape)
        }
        assert len(read) == 4 and all(any(m in key for m in mine) for key in read)


def test_an_expert_count_the_world_size_does_not_divide_is_refused(tmp_path, cli):
    """Six experts over four ranks (torch.chunk: 2, 2, 2, 0) are refused before launch, with
    the world sizes that hold whole experts evenly and cut no head (4 heads: not 3 or 6)."""
    config = config_of("mixtral")
    config.num_local_experts, config.num_key_value_heads = 6, 4
    config.save_pretrained(tmp_path)  # config-only: planned without weights
    plan = tpviz.resolve_plan(tmp_path, 4, experts="ep")
    assert {e.code for e in plan.errors} == {"uneven_experts"}
    assert plan.errors[0].name == EXPERTS.format(0)
    assert "6 experts" in plan.errors[0].message
    assert plan.errors[0].message.endswith("world sizes that work: 1, 2")
    result = cli("plan", str(tmp_path), "--world-size", "4", "--experts", "ep")
    assert result.returncode == 2 and "world sizes that work: 1, 2;" in result.stderr
    assert "Traceback" not in result.stderr
    assert cli("plan", str(tmp_path), "--world-size", "4").returncode == 0  # TP: every expert cut
    with pytest.raises(tpviz.PlanError, match="world sizes that work"):
        tpviz.launch(tmp_path, 4, experts="ep", init="random")


def test_the_layout_is_in_the_plan_json_and_checked_against_a_resolved_plan(moe, cli):
    result = cli("plan", str(moe["olmoe"]), "--experts", "ep", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["experts"] == "ep"
    placed = {p["name"]: p["placement"] for p in data["params"]}
    assert placed[f"{EXPERTS.format(0)}.down_proj"] == "shard(0)"
    plan = tpviz.ResolvedPlan.from_json(result.stdout)
    assert plan.experts == "ep" and tpviz.resolve_plan(moe["olmoe"], 2, plan) is plan
    with pytest.raises(ValueError, match="resolved for experts ep, not tp"):
        tpviz.resolve_plan(moe["olmoe"], 2, plan, experts="tp")
    with pytest.raises(ValueError, match="experts must be one of tp, ep"):
        tpviz.resolve_plan(moe["olmoe"], 2, experts="expert")


def test_ep_on_a_dense_model_warns_and_changes_nothing(tiny):
    plan = tpviz.resolve_plan(tiny, 2, experts="ep")
    assert not plan.errors and "no_experts" in {w.code for w in plan.warnings}
    assert plan.per_rank_bytes == tpviz.resolve_plan(tiny, 2).per_rank_bytes


def test_transformers_ep_plan_runs_as_given_and_half_of_it_is_refused(moe):
    ep_plan = {  # transformers' base_model_ep_plan for Mixtral, given as a plan
        "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "layers.*.mlp.experts.down_proj": "grouped_gemm",
        "layers.*.mlp.experts": "ep_dispatch_experts",
    }
    plan = tpviz.resolve_plan(moe["mixtral"], 2, ep_plan)
    assert not plan.errors and plan.tensor(f"{EXPERTS.format(0)}.down_proj").placement == (
        "shard(0)"
    )
    for half in (
        {k: v for k, v in ep_plan.items() if v == "grouped_gemm"},
        {"layers.*.mlp.experts": "ep_dispatch_experts"},
    ):
        errors = tpviz.resolve_plan(moe["mixtral"], 2, half).errors
        assert {e.code for e in errors} == {"incomplete_expert_parallel"}
        assert EXPERTS.format(0) in errors[0].message and "--experts ep" in errors[0].message


def test_transposed_interleaved_experts_are_cut_along_their_own_feature_dims(moe):
    """gpt-oss stores experts (experts, in, out) with gate and up interleaved: a plain cut of
    the output features keeps (gate, up) pairs whole; the output bias stays whole and rank 0
    alone adds it to the partial sum."""
    plan = tpviz.resolve_plan(moe["gpt_oss"], 2)
    assert not plan.errors, plan.errors
    experts = EXPERTS.format(0)
    assert plan.module_styles[experts] == "moe_tp_experts"
    n, hidden, fused = plan.tensor(f"{experts}.gate_up_proj").global_shape
    placed = {
        t.name.rpartition(".")[2]: (t.style, t.placement, [r.shape for r in t.ranks])
        for t in plan.params
        if t.module == experts
    }
    assert placed == {
        "gate_up_proj": ("colwise", "shard(2)", [[n, hidden, fused // 2]] * 2),
        "gate_up_proj_bias": ("colwise", "shard(1)", [[n, fused // 2]] * 2),
        "down_proj": ("rowwise", "shard(1)", [[n, fused // 4, hidden]] * 2),
        "down_proj_bias": ("moe_tp_experts", "replicate", [[n, hidden]] * 2),
    }


# --- seen per rank: the PlanView's experts x ranks grid and the Dashboard's layout control ----


def _grid(plan, module):
    from tpviz.widgets import figures

    (heat,) = figures.experts_grid_figure(plan, module).data
    return dict(zip(heat.y, zip(heat.z, heat.text)))


def test_the_experts_grid_shows_who_holds_which_expert(moe):
    from tpviz.widgets import figures

    module = EXPERTS.format(0)
    tp = tpviz.resolve_plan(moe["qwen2_moe"], 2, TP["qwen2_moe"])
    ep = tpviz.resolve_plan(moe["qwen2_moe"], 2, TP["qwen2_moe"], experts="ep")
    assert figures.experts_modules(ep) == [EXPERTS.format(i) for i in range(2)]
    per_expert = sum(t.nbytes for t in ep.params if t.module == module) // 4
    grid = _grid(ep, module)
    for expert in range(4):  # whole experts: 0 and 1 on rank 0, 2 and 3 on rank 1
        share, text = grid[f"expert {expert}"]
        assert list(share) == ([1, 0] if expert < 2 else [0, 1])
        assert human_bytes(per_expert) in text and "—" in text
    grid = _grid(tp, module)
    for expert in range(4):  # a half of every expert on each rank
        share, text = grid[f"expert {expert}"]
        assert list(share) == [0.5, 0.5] and list(text) == [human_bytes(per_expert // 2)] * 2
    # the router and the shared expert, beside the experts, as the plan places them
    assert list(grid["gate (replicate)"][0]) == [1, 1]
    shared = next(label for label in grid if label.startswith("shared_expert ("))
    assert sum(grid[shared][0]) == pytest.approx(2)  # replicated: whole on both ranks
    view = tpviz.PlanView(ep)
    assert view.experts_box.layout.display != "none"
    assert view.experts_figure.data[0].meta["experts"] == "ep"
    bars = {bar.name for bar in view.bytes_figure.data if bar.type == "bar"}
    assert "grouped_gemm" in bars  # per-rank bytes by style include the expert styles
    assert list(view.experts_layer.options) == [EXPERTS.format(i) for i in range(2)]
    view.experts_layer.value = EXPERTS.format(1)  # another MoE layer's grid
    assert view.experts_figure.data[0].meta["module"] == EXPERTS.format(1)
    view.set_plan(tp)  # the picked layer stays
    assert view.experts_figure.data[0].meta == {"module": EXPERTS.format(1), "experts": "tp"}
    assert "packed_colwise" in {bar.name for bar in view.bytes_figure.data if bar.type == "bar"}


def test_the_dashboard_switches_the_experts_layout(moe, tiny, tmp_path):
    dash = tpviz.Dashboard(moe["mixtral"], cache=tmp_path)
    assert dash.plan.experts == "tp"
    dash.experts.value = "ep"
    assert dash.plan.experts == "ep" and not dash.plan.errors
    assert dash.plan.module_styles[EXPERTS.format(0)] == "ep_dispatch_experts"
    assert json.loads(dash.plan_editor.value)["model.layers.*.mlp.experts"] == "ep_dispatch_experts"
    dash.plan_view.world_size.value = 4  # resolved again under the same layout
    assert dash.plan.world_size == 4 and dash.plan.experts == "ep"
    dash.source.value = str(tiny)  # a dense model: the grid is hidden
    assert dash.plan_view.experts_box.layout.display == "none"
    dash.shutdown()


# --- loads and forwards (spawned process groups) --------------------------------------------


def _load_and_compare(source, plan, **kwargs) -> dict:
    expected = transformers_logits(source)
    with tpviz.launch(source, plan.world_size, plan, **kwargs) as job:
        result = job.wait(240)
        logits = job.forward(torch.tensor(FIXED_PROMPT) % 1003)
    assert result["plan_matches_shards"]
    for rank, held in enumerate(result["ranks"]):
        assert held["param_bytes"] == plan.per_rank_bytes[rank]
        assert held["peak_tensor_bytes"] == held["forecast_peak_bytes"]
    assert (logits.float() - expected).abs().max().item() <= 1e-4
    return result


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, experts, world_size",
    [
        *((name, "ep", 2) for name in ALL),
        ("deepseek_v3", "tp", 2),  # the others' TP loads are in test_moe.py
        ("gpt_oss", "tp", 2),
        ("qwen3_moe", "ep", 4),  # one expert per rank
    ],
)
def test_moe_logits_match_transformers(moe, name, experts, world_size):
    plan = tpviz.resolve_plan(moe[name], world_size, TP[name], experts=experts)
    assert not plan.errors, plan.errors
    _load_and_compare(moe[name], plan)


# MoE families beyond the six above, under their own plans: no expert keys in any of them
# (transformers 5.25), so every experts module is cut with keys tpviz derives from structure
OTHER_FAMILIES = {
    "granitemoe": ("granitemoe", dict(intermediate_size=48, num_local_experts=4)),
    "phimoe": ("phimoe", dict(intermediate_size=48, num_local_experts=4)),
    "glm4_moe": (
        "glm4_moe",
        dict(
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=4,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            num_key_value_heads=4,
            head_dim=16,
        ),
    ),
    "hunyuan_v1_moe": ("hunyuan_v1_moe", dict(intermediate_size=48, num_experts=4, head_dim=16)),
}


@pytest.mark.slow
def test_other_moe_families_load_under_both_layouts_with_their_own_plans(tmp_path):
    sources = save_models(tmp_path, OTHER_FAMILIES)
    job = None
    try:
        for name, source in sources.items():
            expected = transformers_logits(source)
            for experts, style in (("tp", "moe_tp_experts"), ("ep", "ep_dispatch_experts")):
                plan = tpviz.resolve_plan(source, 2, experts=experts)
                assert not plan.errors, (name, plan.errors)
                assert style in plan.module_styles.values(), (name, experts)
                job = load_next(job, source, 2, plan)  # warm ranks after the first
                result = job.wait(240)
                assert result["plan_matches_shards"], (name, experts)
                held = [r["param_bytes"] for r in result["ranks"]]
                assert held == plan.per_rank_bytes, (name, experts)
                logits = job.forward(torch.tensor(FIXED_PROMPT) % 1003)
                assert (logits.float() - expected).abs().max().item() <= 1e-4, (name, experts)
    finally:
        if job is not None:
            job.shutdown()


ERGO = {  # its experts normalise each expert's output with a per-expert RMSNorm scale
    "ergo": (
        "ergo",
        dict(
            moe_intermediate_size=32,
            num_experts=4,
            head_dim=16,
            first_dense_intermediate_size=96,  # layer 0 dense, layer 1 sparse
            shared_intermediate_size=64,
        ),
    )
}


@pytest.fixture(scope="module")
def ergo(tmp_path_factory):
    return save_models(tmp_path_factory.mktemp("ergo"), ERGO)["ergo"]


def test_experts_normalising_each_output_stay_whole_under_tp_and_split_by_expert_under_ep(ergo):
    """A rank cutting Ergo's experts along their features holds a term of each expert's
    output, which its per-expert norm must not see: under `tp` the experts stay whole (with a
    warning), a plan cutting them is refused; under `ep` the norm's per-expert scales go with
    their experts. Simulated ranks match the whole model either way."""
    experts = EXPERTS.format(1)
    tp = tpviz.resolve_plan(ergo, 2)
    assert experts not in tp.module_styles
    assert tp.tensor(f"{experts}.up_proj").placement == "replicate"
    assert "experts_kept_whole" in [w.code for w in tp.warnings]
    ep = tpviz.resolve_plan(ergo, 2, experts="ep")
    assert not ep.errors, ep.errors
    norm = ep.tensor(f"{experts}.post_expert_norm.weight")
    assert (norm.style, norm.placement) == ("grouped_gemm", "shard(0)")
    cut = {k: v for k, v in EXPERTS_TP.items() if "gate_up" not in k}
    cut["layers.*.mlp.experts.up_proj"] = "colwise"  # Ergo's experts have no gate
    assert [e.code for e in tpviz.resolve_plan(ergo, 2, cut).errors] == ["inconsistent_experts"]
    assert tpviz.simulate_plan(tp).ok and tpviz.simulate_plan(ep).ok


@pytest.mark.slow
def test_experts_normalising_each_output_match_transformers_under_both_layouts(ergo):
    expected = transformers_logits(ergo)
    job = None
    try:
        for experts in ("tp", "ep"):
            plan = tpviz.resolve_plan(ergo, 2, experts=experts)
            job = load_next(job, ergo, 2, plan)
            result = job.wait(240)
            assert result["plan_matches_shards"], experts
            logits = job.forward(torch.tensor(FIXED_PROMPT) % 1003)
            assert (logits.float() - expected).abs().max().item() <= 1e-4, experts
    finally:
        if job is not None:
            job.shutdown()


@pytest.mark.slow
def test_compare_loads_a_moe_checkpoint_with_every_strategy_under_ep(moe, cli):
    result = cli("compare", str(moe["qwen2_moe"]), "--experts", "ep", "--verify", "--json")
    assert result.returncode == 0, result.stderr
    runs = json.loads(result.stdout)["strategies"]
    assert [r["strategy"] for r in runs] == ["sliced", "rank0_broadcast", "replicated"]
    for run in runs:
        assert run["plan_matches_shards"] and run["verify"]["ok"]
        assert all(r["peak_tensor_bytes"] == r["forecast_peak_bytes"] for r in run["ranks"])


# --- planning at scale from config.json alone ---------------------------------------------------

SCALE = {"mixtral_8x7b": MIXTRAL_8X7B, "deepseek_v3_671b": DEEPSEEK_V3}


def routed_expert_bytes(config: dict) -> int:
    """bf16 bytes of every routed expert's three projections, from the config's numbers."""
    experts = config.get("n_routed_experts") or config["num_local_experts"]
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    layers = config["num_hidden_layers"] - config.get("first_k_dense_replace", 0)
    return layers * experts * 3 * config["hidden_size"] * inter * 2


@pytest.mark.parametrize("name", SCALE)
def test_real_moe_configs_plan_at_world_size_8_under_both_layouts(tmp_path, cli, name):
    """The models' own plans (the experts' TP keys derived), as a user would plan them."""
    config = SCALE[name]
    source = config_dir(tmp_path / name, config)
    tp = tpviz.resolve_plan(source, 8)
    result = cli("plan", str(source), "--world-size", "8", "--experts", "ep", "--json")
    assert result.returncode == 0, result.stderr
    ep = tpviz.ResolvedPlan.from_json(result.stdout)
    assert not tp.errors and not ep.errors
    assert tp.total_bytes == ep.total_bytes
    routed = routed_expert_bytes(config)
    for plan, style in ((tp, "moe_tp_experts"), (ep, "ep_dispatch_experts")):
        experts = [t for t in plan.params if plan.module_styles.get(t.module) == style]
        assert sum(t.nbytes for t in experts) == routed
        for rank in range(8):  # an eighth of every expert, or an eighth of the experts
            assert sum(t.ranks[rank].bytes for t in experts) == routed // 8
        # every tensor's ranks add up to it: once each when cut, on every rank when replicated
        for t in plan.params:
            held = sum(r.bytes for r in t.ranks)
            assert held == (t.nbytes * 8 if t.placement == "replicate" else t.nbytes), t.name
        assert plan.per_rank_bytes == [sum(t.ranks[r].bytes for t in plan.params) for r in range(8)]
    # the layouts differ only in the experts
    assert [e - t for e, t in zip(ep.per_rank_bytes, tp.per_rank_bytes)] == [0] * 8
