"""Mixture-of-experts models under tensor parallelism: every rank holds its slice of every
expert (`packed_colwise` / `rowwise` on the stacked expert tensors, cut along the intermediate
features as transformers cuts them) and the experts' partial outputs are all-reduced
(`moe_tp_experts`). Checkpoints are made with transformers' own classes: save_pretrained
writes one tensor per expert; one is written already stacked."""

from __future__ import annotations

import json

import pytest
import torch

import tpviz
from tpviz.models import FIXED_PROMPT

from .hf_tiny import TINY_DIMS

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402  (after the skip: comes with transformers)

TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}
DIMS = dict(TINY_DIMS, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
MODELS = {  # name: (model_type, config overrides)
    "mixtral": ("mixtral", dict(intermediate_size=96, num_local_experts=4)),
    "qwen2_moe": (
        "qwen2_moe",
        # 44 wide: 22 float32 (88 bytes) per rank at 2 ranks, rows torch's grouped_mm refuses
        dict(num_experts=4, moe_intermediate_size=44, shared_expert_intermediate_size=64),
    ),
    "olmoe": ("olmoe", dict(intermediate_size=48, num_experts=4)),
    "qwen3_moe": (
        "qwen3_moe",
        dict(num_experts=4, moe_intermediate_size=48, head_dim=16, num_key_value_heads=4),
    ),
}
EXPERTS = "model.layers.{}.mlp.experts"
ATTENTION = {f"layers.*.self_attn.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj")}
EXPERTS_TP = {
    "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
    "layers.*.mlp.experts.down_proj": "rowwise",
    "layers.*.mlp.experts": "moe_tp_experts",
}
# The MoE TP plans transformers 5.24 ships in these models' configs. transformers 5.25
# deprecated `moe_tp_experts` and dropped the expert keys from its configs (experts default to
# expert parallelism there); tpviz derives the same keys from structure when a plan leaves the
# experts unplaced. The tests pass these plans themselves: the same on every version.
TP_PLANS = {
    "mixtral": {**ATTENTION, "layers.*.self_attn.o_proj": "rowwise", **EXPERTS_TP},
    "qwen2_moe": {
        **ATTENTION,
        "layers.*.self_attn.o_proj": "rowwise",
        **EXPERTS_TP,
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    },
    "olmoe": {
        **{k: "colwise_gather_output" for k in ATTENTION},
        "layers.*.self_attn.o_proj": "rowwise_split_input",
        **EXPERTS_TP,
    },
    "qwen3_moe": {
        **ATTENTION,
        "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.o_proj": "rowwise",
        **EXPERTS_TP,
    },
}
TP_PLANS["qwen3_moe_stacked"] = TP_PLANS["qwen3_moe"]


def config_of(name: str, models: dict = MODELS):
    model_type, overrides = models[name]
    return transformers.AutoConfig.for_model(
        model_type, **{**DIMS, "num_experts_per_tok": 2, **overrides}
    )


def save_models(root, models: dict = MODELS) -> dict:
    """name -> checkpoint directory, written by the model class in several files. Tensors the
    class initialises to zeros (biases) get random values: a bias added once per rank instead
    of once must change the logits."""
    out = {}
    for i, name in enumerate(models):
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(config_of(name, models))
        with torch.no_grad():
            for param in model.parameters():
                if not param.any():
                    param.normal_(std=0.1)
        model.save_pretrained(root / name, max_shard_size="300KB")
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """name -> checkpoint directory, saved per expert in several files; `qwen3_moe_stacked`
    holds the same weights as `qwen3_moe` under the stacked names the model class uses."""
    root = tmp_path_factory.mktemp("moe")
    out = save_models(root)
    stacked = root / "qwen3_moe_stacked"
    model = transformers.AutoModelForCausalLM.from_pretrained(out["qwen3_moe"])
    model.config.save_pretrained(stacked)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, stacked / "model.safetensors", metadata={"format": "pt"})
    out["qwen3_moe_stacked"] = stacked
    return out


def transformers_logits(source, dtype: str = "float32") -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        source, dtype=getattr(torch, dtype)
    ).eval()
    with torch.no_grad():
        return model(torch.tensor(FIXED_PROMPT) % 1003).logits.float()


# --- plans (no processes) -----------------------------------------------------------------------


@pytest.mark.parametrize("name", [*MODELS, "qwen3_moe_stacked"])
def test_moe_plans_cut_every_expert_along_its_intermediate_features(moe, name):
    plan = tpviz.resolve_plan(moe[name], 2, TP_PLANS[name])
    assert not plan.errors, plan.errors
    experts = EXPERTS.format(0)
    assert plan.module_styles[experts] == "moe_tp_experts"
    gate_up = plan.tensor(f"{experts}.gate_up_proj")  # (experts, 2 * intermediate, hidden)
    down = plan.tensor(f"{experts}.down_proj")  # (experts, hidden, intermediate)
    assert (gate_up.style, gate_up.placement) == ("packed_colwise", "shard(1)")
    assert (down.style, down.placement) == ("rowwise", "shard(2)")
    experts_n, inter, hidden = down.global_shape[0], down.global_shape[2], down.global_shape[1]
    assert [r.shape for r in gate_up.ranks] == [[experts_n, inter, hidden]] * 2
    # one block of the gate part and one of the up part, every expert alike
    assert [b.offset for b in gate_up.ranks[1].blocks] == [
        [0, inter // 2, 0],
        [0, 3 * inter // 2, 0],
    ]
    assert [r.shape for r in down.ranks] == [[experts_n, hidden, inter // 2]] * 2
    router = plan.tensor("model.layers.0.mlp.gate.weight")
    assert router.placement == "replicate"
    assert sum(plan.per_rank_bytes) >= plan.total_bytes


@pytest.mark.parametrize("name", [*MODELS, "qwen3_moe_stacked"])
def test_the_models_own_plan_cuts_the_experts_as_the_5_24_plans_did(moe, name):
    """transformers 5.25 ships no expert keys; tpviz derives them from the experts module's
    structure, so the model's own plan cuts every expert alike on any version."""
    default = tpviz.resolve_plan(moe[name], 2)
    given = tpviz.resolve_plan(moe[name], 2, TP_PLANS[name])
    assert not default.errors, default.errors
    experts = [t for t in given.params if ".experts." in t.name]
    assert experts and all(t.placement.startswith("shard") for t in experts)
    for t in experts:
        derived = default.tensor(t.name)
        assert (derived.style, derived.placement, derived.ranks) == (t.style, t.placement, t.ranks)
    assert default.patterns["model.layers.*.mlp.experts"] == "moe_tp_experts"  # in its JSON


def test_a_plan_that_places_the_experts_itself_is_kept(moe):
    plan = tpviz.resolve_plan(moe["mixtral"], 2, {"layers.*.mlp.experts": "replicate"})
    assert not plan.errors
    experts = [t for t in plan.params if ".experts." in t.name]
    assert experts and all(t.placement == "replicate" for t in experts)
    assert "moe_tp_experts" not in plan.patterns.values()


@pytest.mark.parametrize(
    "plan, named",
    [  # each would run and give wrong numbers: refused before launch
        ({"layers.*.mlp.experts": "moe_tp_experts"}, "gate_up_proj"),  # whole: summed twice
        ({"layers.*.mlp.experts.down_proj": "rowwise"}, "down_proj"),  # cut, never summed
        ({**EXPERTS_TP, "layers.*.mlp.experts.gate_up_proj": "colwise"}, "gate_up_proj"),
    ],
)
def test_experts_cut_in_ways_that_cannot_sum_are_refused(moe, cli, tmp_path, plan, named):
    resolved = tpviz.resolve_plan(moe["mixtral"], 2, plan)
    assert {e.code for e in resolved.errors} == {"inconsistent_experts"}
    assert resolved.errors[0].message.startswith(f"{EXPERTS.format(0)}.{named}")
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan))
    result = cli("plan", str(moe["mixtral"]), "--plan", str(plan_file))
    assert result.returncode == 2 and "Traceback" not in result.stderr


def test_shared_experts_follow_their_plan(moe):
    plan = tpviz.resolve_plan(moe["qwen2_moe"], 2, TP_PLANS["qwen2_moe"])
    # transformers' plan names `mlp.gate_proj`, which the shared expert's path does not end with
    for leaf in ("shared_expert.gate_proj", "shared_expert.down_proj", "shared_expert_gate"):
        assert plan.tensor(f"model.layers.1.mlp.{leaf}.weight").placement == "replicate"
    cut = tpviz.resolve_plan(
        moe["qwen2_moe"], 2, {"layers.*.mlp.shared_expert.gate_proj": "colwise"}
    )
    assert cut.tensor("model.layers.1.mlp.shared_expert.gate_proj.weight").placement == "shard(0)"


def test_an_uneven_expert_split_is_refused_with_the_world_sizes_that_work(tmp_path, cli):
    """transformers' experts kernel (grouped matmul) needs equal slices on every rank: 42
    intermediate features over 4 ranks (torch.chunk: 11, 11, 11, 9) are refused before launch."""
    config = config_of("mixtral")
    config.intermediate_size, config.num_key_value_heads = 42, 4
    config.save_pretrained(tmp_path)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(TP_PLANS["mixtral"]))
    plan = tpviz.resolve_plan(tmp_path, 4, plan_file)
    assert {e.code for e in plan.errors} == {"uneven_experts"}
    error = plan.errors[0]
    assert error.name == f"{EXPERTS.format(0)}.gate_up_proj"
    assert error.message.endswith("world sizes that work: 1, 2")  # 3, 6, ...: would cut heads
    assert cli("plan", str(tmp_path), "--world-size", "4", "--plan", str(plan_file)).returncode == 2
    # the two other ways out it names both resolve at 4 ranks
    assert "--experts ep" in error.message and "'model.layers.*.mlp.experts': 'replicate'" in (
        error.message
    )
    assert not tpviz.resolve_plan(tmp_path, 4, plan_file, experts="ep").errors
    whole = {k: v for k, v in TP_PLANS["mixtral"].items() if ".experts" not in k}
    whole["model.layers.*.mlp.experts"] = "replicate"
    assert not tpviz.resolve_plan(tmp_path, 4, whole).errors
    assert not tpviz.resolve_plan(tmp_path, 2, plan_file).errors
    with pytest.raises(tpviz.PlanError, match="uneven_experts|intermediate features"):
        tpviz.launch(tmp_path, 4, plan_file, init="random")
    # 4 experts do not split over 8 ranks either: whole experts are not offered there
    uneven = [
        e for e in tpviz.resolve_plan(tmp_path, 8, plan_file).errors if e.code == "uneven_experts"
    ]
    assert uneven and "--experts ep" not in uneven[0].message
    assert "keep them whole ('model.layers.*.mlp.experts': 'replicate'" in uneven[0].message


def test_every_plan_error_suggests_only_world_sizes_that_meet_all_constraints(tmp_path):
    """Four heads allow 1, 2, 4 and 20 expert features 1, 2, 4, 5, 10, 20: at 3 ranks both
    errors list 1, 2, 4 (not 5 or 10); with 9 features (1, 3, 9) only 1 is left."""
    config = config_of("mixtral")
    config.intermediate_size, config.num_key_value_heads = 20, 4
    config.save_pretrained(tmp_path)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(TP_PLANS["mixtral"]))
    errors = tpviz.resolve_plan(tmp_path, 3, plan_file).errors
    assert {e.code for e in errors} == {"head_alignment", "uneven_experts"}
    assert all(e.message.endswith("world sizes that work: 1, 2, 4") for e in errors)
    config.intermediate_size = 9  # 1, 3, 9 against the heads' 1, 2, 4
    config.save_pretrained(tmp_path)
    errors = tpviz.resolve_plan(tmp_path, 2, plan_file).errors
    assert {e.code for e in errors} == {"uneven_experts"}
    assert all(e.message.endswith("world sizes that work: 1") for e in errors)


def test_an_even_split_over_four_ranks(moe):
    plan = tpviz.resolve_plan(moe["qwen3_moe"], 4, TP_PLANS["qwen3_moe"])  # 48 over 4 ranks
    assert not plan.errors, plan.errors
    down = plan.tensor(f"{EXPERTS.format(1)}.down_proj")
    assert [r.shape[2] for r in down.ranks] == [12] * 4
    gate_up = plan.tensor(f"{EXPERTS.format(1)}.gate_up_proj")
    assert [r.shape[1] for r in gate_up.ranks] == [24] * 4


def test_experts_narrower_than_grouped_mm_takes_run_on_another_kernel(moe):
    """Ranks whose expert rows are not a multiple of 16 bytes run transformers' batched_mm:
    simulated here, real in test_moe_logits_match_transformers (qwen2_moe)."""
    plan = tpviz.resolve_plan(moe["qwen2_moe"], 2, TP_PLANS["qwen2_moe"])
    assert plan.tensor(f"{EXPERTS.format(0)}.down_proj").ranks[0].shape[-1] == 22
    assert tpviz.simulate_plan(plan).ok


NARROW = dict(num_experts=4, moe_intermediate_size=6, head_dim=16, num_key_value_heads=4)


def test_experts_too_narrow_for_grouped_mm_even_whole_are_simulated(tmp_path):
    """6 float32 features a row (24 bytes): torch's grouped_mm refuses even the whole model's
    experts, so transformers' own forward fails. The whole instance a plan is checked against
    runs batched_mm too, and so do its ranks (3 features each)."""
    config_of("qwen3_moe", {"qwen3_moe": ("qwen3_moe", NARROW)}).save_pretrained(tmp_path)
    assert tpviz.simulate_plan(tpviz.resolve_plan(tmp_path, 2, TP_PLANS["qwen3_moe"])).ok


def test_moe_checkpoints_plan_from_the_command_line(moe, cli, tmp_path):
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(TP_PLANS["mixtral"]))
    result = cli("plan", str(moe["mixtral"]), "--world-size", "2", "--plan", str(plan_file))
    assert result.returncode == 0, result.stdout
    assert "experts.gate_up_proj" in result.stdout and "packed_colwise" in result.stdout


def test_expert_styles_are_known_and_cost_an_all_reduce():
    from tpviz import styles

    for name in ("moe_tp_experts", "moe_identity_expert", "packed_rowwise", "all_reduce"):
        assert name in styles.STYLES and name not in styles.UNSUPPORTED
    assert styles.STYLES["moe_tp_experts"].forward_collective == "all-reduce of the output"
    # packed along the last dim, as transformers' packed_rowwise (_StridedShard(dim=-1))
    packed = styles.STYLES["packed_rowwise"].cut("gate_up_proj", 3)
    assert (packed.dim, packed.parts) == (2, 2)
    assert styles.STYLES["colwise"].cut("weight", 2).dim == 0  # 2-D weights as before


# --- loads and forwards (spawned process groups) --------------------------------------------


def _load_and_compare(name, source, world_size: int, dtype: str = "float32", **kwargs) -> None:
    expected = transformers_logits(source, dtype)
    plan = tpviz.resolve_plan(source, world_size, TP_PLANS[name], dtype=dtype)
    with tpviz.launch(source, world_size, plan, verify=False, **kwargs) as job:
        result = job.wait(240)
        logits = job.forward(torch.tensor(FIXED_PROMPT) % 1003)
    assert result["plan_matches_shards"]
    assert all(r["peak_tensor_bytes"] == r["forecast_peak_bytes"] for r in result["ranks"])
    for rank, held in enumerate(result["ranks"]):
        assert held["param_bytes"] == plan.per_rank_bytes[rank]
    assert (logits.float() - expected).abs().max().item() <= TOLERANCE[dtype]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["sliced", "rank0_broadcast", "replicated"])
def test_mixtral_matches_transformers_under_every_strategy(moe, strategy):
    _load_and_compare("mixtral", moe["mixtral"], 2, strategy=strategy)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, world_size, dtype",
    [
        ("qwen2_moe", 2, "float32"),  # shared expert and its gate
        ("olmoe", 2, "float32"),  # attention gathered for its q/k norms
        ("qwen3_moe_stacked", 2, "float32"),  # a checkpoint already stacked
        ("qwen3_moe", 4, "float32"),
        ("qwen3_moe", 2, "bfloat16"),
        ("mixtral", 1, "float32"),  # one rank's packed shard is the whole: still the plan's
    ],
)
def test_moe_logits_match_transformers(moe, name, world_size, dtype):
    _load_and_compare(name, moe[name], world_size, dtype)


@pytest.mark.slow
def test_a_reference_whose_experts_grouped_mm_refuses_still_verifies(tmp_path):
    """--verify's single-process reference runs batched_mm where grouped_mm refuses its
    experts' rows, as the ranks do."""
    source = save_models(tmp_path, {"narrow": ("qwen3_moe", NARROW)})["narrow"]
    plan = tpviz.resolve_plan(source, 2, TP_PLANS["qwen3_moe"])
    with tpviz.launch(source, 2, plan, verify=True) as job:
        verify = job.wait(240)["verify"]
    assert verify["ok"] and verify["max_abs_diff"] <= 1e-4, verify


class _Experts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down_proj = torch.nn.Parameter(torch.empty(4, 8, 6))
        self.identity_expert = torch.nn.Identity()


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = _Experts()
        self.shared = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 8))


def test_partial_sum_styles_reach_modules_without_tensors_of_their_own():
    """An identity expert and shared experts holding only submodules get their styles (the
    runtime divides the identity's input and all-reduces the shared experts' output)."""
    with torch.device("meta"):
        model = _Block()
    plan = tpviz.resolve_plan(
        model,
        2,
        {
            "experts": "moe_tp_experts",
            "experts.down_proj": "rowwise",
            "experts.identity_expert": "moe_identity_expert",
            "shared": "all_reduce",
        },
    )
    assert not plan.errors, plan.errors
    assert not [w for w in plan.warnings if w.code == "unmatched_pattern"]
    assert plan.module_styles["experts.identity_expert"] == "moe_identity_expert"
    assert plan.module_styles["shared"] == "all_reduce"
    assert plan.tensor("experts.down_proj").placement == "shard(2)"


def test_experts_outside_transformers_experts_interface_are_planned_as_given():
    """Keys are derived only for modules that declare their layout (transformers' experts
    interface): another module's stacked tensors could be laid out any way."""
    with torch.device("meta"):
        model = _Block()
    plan = tpviz.resolve_plan(model, 2, {})
    assert plan.tensor("experts.down_proj").placement == "replicate"
    assert "moe_tp_experts" not in plan.patterns.values()


def test_a_missing_expert_tensor_is_named_before_launch(moe, tmp_path, cli):
    """One expert's w1 gone from a per-expert checkpoint: the stack would shift every later
    expert, so the plan names the missing key instead."""
    import shutil

    from safetensors.torch import load_file

    broken = tmp_path / "broken"
    shutil.copytree(moe["mixtral"], broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    key = "model.layers.0.block_sparse_moe.experts.1.w1.weight"
    file = broken / index["weight_map"].pop(key)
    tensors = load_file(file)
    del tensors[key]
    save_file(tensors, file, metadata={"format": "pt"})
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    result = cli("plan", str(broken), "--world-size", "2")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{key} is missing from the checkpoint (3 of 4 modules found)" in result.stderr


def test_experts_are_found_by_their_own_count_whatever_the_config_calls_it(tmp_path):
    """ERNIE-4.5-MoE declares its experts as `moe_num_experts`, a name no other family uses:
    the experts module's own `num_experts` finds them under either layout."""
    config = transformers.AutoConfig.for_model(
        "ernie4_5_moe",
        **dict(DIMS, head_dim=16),
        moe_num_experts=4,
        moe_k=2,
        moe_intermediate_size=32,
        moe_num_shared_experts=1,
        moe_layer_start_index=0,
    )
    config.save_pretrained(tmp_path)  # config-only: planned without weights
    name = "model.layers.0.mlp.experts.gate_up_proj"
    for experts, placement in [("tp", "shard(1)"), ("ep", "shard(0)")]:
        plan = tpviz.resolve_plan(tmp_path, 2, experts=experts)
        assert not plan.errors and plan.tensor(name).placement == placement


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_16_bit_moe_off_its_reference_is_told_its_routing_may_have_tipped(moe, dtype):
    """A router's top-k can flip on one rounding step of a 16-bit dtype, which no tolerance
    covers: the failure says to check the plan in float32, where routing does not tip."""
    from tpviz.runtime.options import LoadOptions
    from tpviz.runtime.verify import ROUTING_NOTE, fixed_prompt, reference_logits, verify_forward

    plan = tpviz.resolve_plan(moe["mixtral"], 2, dtype=dtype)
    options = LoadOptions()

    def off_by_one(ids):  # logits as a rank whose router tipped might give them
        return reference_logits(plan, options, ids) + 1.0

    report = verify_forward(plan, options, fixed_prompt(plan), off_by_one)
    assert report["ok"] is False
    assert report.get("note") == (ROUTING_NOTE if dtype == "bfloat16" else None)
