"""Hugging Face checkpoints as people hold them: bfloat16, keys transformers renames or stacks
when it loads, 0-dim tensors, and architectures transformers gives no TP plan. Checkpoints are
made with transformers' own classes and save_pretrained (which writes the legacy key layout)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import tpviz
from tpviz.keymap import in_saved_order
from tpviz.models import FIXED_PROMPT
from tpviz.report import load_table, plan_table
from tpviz.strategies.reads import fill_part
from tpviz.widgets.plan_view import issues_html

from .conftest import run_cli
from .hf_tiny import TINY_DIMS, VISION, tiny_text

transformers = pytest.importorskip("transformers")

MOE = dict(TINY_DIMS, hidden_size=64, intermediate_size=96, num_attention_heads=4)
MODELS = {  # name: (model_type, config overrides, dtype saved)
    "qwen2_bf16": ("qwen2", {}, torch.bfloat16),
    "qwen2_f32": ("qwen2", {}, torch.float32),
    "llama_bf16": ("llama", {}, torch.bfloat16),
    "gpt_neox": ("gpt_neox", {"num_key_value_heads": None}, torch.float32),
    "apertus": ("apertus", {}, torch.float32),  # xIELU's scalar beta and eps
    "mixtral": ("mixtral", dict(MOE, num_local_experts=4), torch.float32),
    "qwen2_moe_bf16": (
        "qwen2_moe",
        dict(MOE, num_experts=4, moe_intermediate_size=48, shared_expert_intermediate_size=64),
        torch.bfloat16,
    ),
    "falcon": ("falcon", {"num_key_value_heads": None, "intermediate_size": None}, torch.float32),
    # saved with q, k and v fused into one query_key_value, which transformers splits as it
    # loads: by the targets' sizes (Split; 8 query and 4 key-value heads), or evenly (Chunk)
    "sarvam_moe": (
        "sarvam_moe",
        dict(num_experts=4, moe_intermediate_size=48, num_experts_per_tok=2),
        torch.float32,
    ),
    "hrm_text": ("hrm_text", {}, torch.float32),
}
ROTARY = ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-checkpoints")
    out = {}
    for i, (name, (model_type, overrides, dtype)) in enumerate(MODELS.items()):
        kwargs = {k: v for k, v in {**TINY_DIMS, **overrides}.items() if v is not None}
        config = transformers.AutoConfig.for_model(model_type, **kwargs)
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
        model.save_pretrained(root / name, max_shard_size="300KB")
        out[name] = root / name
    return out


def hf_model(source, dtype=None):
    return transformers.AutoModelForCausalLM.from_pretrained(source, dtype=dtype).eval()


def rank_tensors(model, names):
    """Each rank's local tensors (and their dtypes) for `names`: run on the ranks."""
    from tpviz.models.adapter import local_of
    from tpviz.runtime.parallelize import lookup

    return {n: local_of(lookup(model, n)).detach().cpu().clone() for n in names}


# --- dtypes -----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("qwen2_bf16", {}),  # transformers adapter, bf16 checkpoint
        ("qwen2_f32", {"dtype": "bfloat16"}),  # cast while loading
        ("llama_bf16", {"model": "hf"}),  # the Llama family through transformers
    ],
)
def test_computed_buffers_keep_the_dtype_transformers_gives_them(hf_checkpoints, name, kwargs):
    source = hf_checkpoints[name]
    plan = tpviz.resolve_plan(source, 2, **kwargs)
    assert plan.dtype == "bfloat16" and not plan.errors
    assert [plan.tensor(n).dtype for n in ROTARY] == ["float32", "float32"]
    with tpviz.launch(source, 2, plan, verify=True) as job:
        result = job.wait(180)
        logits = job.forward(torch.tensor(FIXED_PROMPT) % 1003)
        held = job.call(rank_tensors, ROTARY)
    assert result["plan_matches_shards"], result["ranks"][0]["mismatches"]
    assert result["verify"]["ok"] and result["verify"]["tolerance"] == 5e-2
    reference = hf_model(source, torch.bfloat16)
    with torch.no_grad():
        expected = reference(torch.tensor(FIXED_PROMPT) % 1003).logits
    assert (logits.float() - expected.float()).abs().max().item() <= 5e-2
    for rank in held:
        for n in ROTARY:
            want = reference.get_buffer(n)
            assert rank[n].dtype == want.dtype == torch.float32 and torch.equal(rank[n], want)
    assert all(r["peak_tensor_bytes"] == r["forecast_peak_bytes"] for r in result["ranks"])


@pytest.mark.slow
def test_cli_loads_a_bf16_checkpoint_and_verifies(hf_checkpoints):
    loaded = run_cli(
        "load", str(hf_checkpoints["qwen2_bf16"]), "--world-size", "2", "--verify", "--json"
    )
    assert loaded.returncode == 0, loaded.stderr
    result = json.loads(loaded.stdout)
    assert result["plan_matches_shards"] and result["verify"]["ok"]


ROUTER = ["model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"]


@pytest.fixture(scope="module")
def bf16_with_float32_router(tmp_path_factory):
    """A GLM-4 MoE checkpoint as transformers saves it in bfloat16: its routers (the class's
    `_keep_in_fp32_modules_strict`) stay float32. Correction biases near 6 make the routing
    depend on the bits a bfloat16 cast would drop."""
    root = tmp_path_factory.mktemp("glm4-moe")
    config = transformers.AutoConfig.for_model(
        "glm4_moe",
        **dict(MOE, moe_intermediate_size=32, head_dim=16, first_k_dense_replace=1),
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        bias = model.get_buffer(ROUTER[1])
        bias.copy_(6.0 + torch.rand_like(bias) * 0.05)
    model.save_pretrained(root / "float32")
    hf_model(root / "float32", torch.bfloat16).save_pretrained(root / "bfloat16")
    return root


def test_what_transformers_keeps_float32_stays_float32_in_the_plan(bf16_with_float32_router):
    root = bf16_with_float32_router
    for source, dtype in [(root / "bfloat16", None), (root / "float32", "bfloat16")]:
        plan = tpviz.resolve_plan(source, 2, dtype=dtype)
        assert plan.dtype == "bfloat16" and not plan.errors
        assert [plan.tensor(n).dtype for n in ROUTER] == ["float32", "float32"]
        assert plan.tensor("model.layers.1.mlp.experts.gate_up_proj").dtype == "bfloat16"
        router = plan.tensor(ROUTER[0])
        assert router.ranks[0].bytes == router.nbytes == 8 * 64 * 4  # whole, 4 bytes each
    assert plan.tensor(ROUTER[0]).source_dtype in (None, "float32")
    assert [
        t.dtype
        for t in tpviz.resolve_plan(root / "bfloat16", 2, dtype="float32").params
        if t.name in ROUTER
    ] == ["float32", "float32"]


@pytest.mark.slow
@pytest.mark.parametrize("experts", ["tp", "ep"])
def test_a_bf16_moe_routes_as_transformers_does(bf16_with_float32_router, experts):
    source = bf16_with_float32_router / "bfloat16"
    ids = torch.randint(0, 1003, (1, 48), generator=torch.Generator().manual_seed(1))
    with tpviz.launch(source, 2, experts=experts, verify=True) as job:
        result = job.wait(180)
        logits = job.forward(ids)
        held = job.call(rank_tensors, ROUTER)
    assert result["plan_matches_shards"] and result["verify"]["ok"]
    assert all(rank[n].dtype == torch.float32 for rank in held for n in ROUTER)
    with torch.no_grad():
        expected = hf_model(source, torch.bfloat16)(ids).logits
    # bfloat16 sums in another order differ by about 0.004; a router cast to bfloat16 picks
    # other experts, 0.03 apart
    assert (logits.float() - expected.float()).abs().max().item() <= 1e-2


@pytest.fixture(scope="module")
def falcon_h1(tmp_path_factory):
    """Falcon-H1 (attention beside Mamba-2 mixers) as save_pretrained writes it: its config
    holds an infinity, saved tagged ({"__float__": "Infinity"}), and each mixer's computed
    `mup_vector` is set by the base model's init, not the mixer's."""
    config = transformers.AutoConfig.for_model(
        "falcon_h1",
        **dict(TINY_DIMS, hidden_size=64, num_attention_heads=4, head_dim=16),
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_n_groups=1,
        mamba_d_ssm=128,
    )
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("falcon-h1")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root)
    assert "__float__" in (root / "config.json").read_text()
    return root


@pytest.mark.slow
def test_buffers_an_ancestor_initialises_and_tagged_floats_load_as_in_transformers(falcon_h1):
    mup = [f"model.layers.{i}.mamba.mup_vector" for i in range(2)]
    with tpviz.launch(falcon_h1, 2) as job:
        result = job.wait(180)
        logits = job.forward(torch.tensor(FIXED_PROMPT) % 1003)
        held = job.call(rank_tensors, mup)
    assert result["plan_matches_shards"]
    reference = hf_model(falcon_h1)
    with torch.no_grad():
        expected = reference(torch.tensor(FIXED_PROMPT) % 1003).logits
    assert (logits - expected).abs().max().item() <= 1e-4
    assert all(torch.equal(rank[n], reference.get_buffer(n)) for rank in held for n in mup)


# --- renamed keys -----------------------------------------------------------------------------


@pytest.mark.slow
def test_renamed_keys_are_resolved_in_the_plan_and_loaded(hf_checkpoints):
    source = hf_checkpoints["gpt_neox"]
    shown = run_cli("plan", str(source), "--world-size", "2", "--json")
    assert shown.returncode == 0, shown.stderr
    params = {p["name"]: p for p in json.loads(shown.stdout)["params"]}
    assert params["lm_head.weight"]["checkpoint_keys"] == ["embed_out.weight"]
    assert params["lm_head.weight"]["placement"] == "shard(0)"
    embed = params["gpt_neox.embed_in.weight"]
    assert embed["checkpoint_keys"] == ["gpt_neox.embed_in.weight"] and not embed["sources"]
    with tpviz.launch(source, 2, verify=True) as job:
        result = job.wait(180)
        logits = job.forward(torch.tensor(FIXED_PROMPT) % 1003)
    assert result["plan_matches_shards"] and result["verify"]["ok"]
    with torch.no_grad():
        expected = hf_model(source)(torch.tensor(FIXED_PROMPT) % 1003).logits
    assert (logits - expected).abs().max().item() <= 1e-4


# --- tensors stacked from several checkpoint tensors -------------------------------------------


def test_stacked_experts_list_their_checkpoint_tensors(hf_checkpoints):
    plan = tpviz.resolve_plan(hf_checkpoints["mixtral"], 2)
    # the keys are all accounted for, and transformers' MoE plan now runs (tests/test_moe.py)
    assert not plan.errors
    gate_up = plan.tensor("model.layers.1.mlp.experts.gate_up_proj")
    prefix = "model.layers.1.block_sparse_moe.experts"
    assert gate_up.checkpoint_keys == [
        f"{prefix}.{e}.w{w}.weight" for w in (1, 3) for e in range(4)
    ]
    assert gate_up.combine == "stack(0), cat(1)" and gate_up.global_shape == [4, 192, 64]
    assert [(s.offset, s.shape) for s in gate_up.sources[3:5]] == [
        ([3, 0, 0], [1, 96, 64]),
        ([0, 96, 0], [1, 96, 64]),
    ]
    down = tpviz.resolve_plan(hf_checkpoints["qwen2_moe_bf16"], 2).tensor(
        "model.layers.0.mlp.experts.down_proj"
    )
    assert down.checkpoint_keys == [
        f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(4)
    ]
    assert down.combine == "stack(0)" and down.source_dtype == "bfloat16"
    again = tpviz.ResolvedPlan.from_json(plan.to_json())
    assert again.tensor(gate_up.name).sources == gate_up.sources


STACKED = "model.layers.1.block_sparse_moe.experts"  # mixtral's w1/w3 make gate_up_proj


@pytest.mark.parametrize(
    "name, key, change, words",
    [
        # a tensor the checkpoint names differently from the model: the error gives both
        (
            "hrm_text",
            "model.H_module.layers.1.attn.o_proj.weight",
            None,
            "model.H_module.layers.1.self_attn.o_proj.weight (saved as "
            "model.H_module.layers.1.attn.o_proj.weight) is in the model but not in",
        ),
        # one of the tensors stacked into one: the odd one is named, not just its shape
        (
            "mixtral",
            f"{STACKED}.2.w3.weight",
            lambda t: t.flatten()[:-1],
            f"cannot stack them: {STACKED}.2.w3.weight is [6143] where {STACKED}.0.w3.weight "
            "is [96, 64]",
        ),
        (
            "mixtral",
            f"{STACKED}.2.w3.weight",
            lambda t: t.to(torch.bfloat16),
            f"tensor '{STACKED}.2.w3.weight' is bfloat16 where '{STACKED}.0.w1.weight' is float32",
        ),
    ],
)
def test_a_broken_checkpoint_tensor_is_named_as_saved(
    hf_checkpoints, tmp_path, cli, name, key, change, words
):
    from safetensors.torch import load_file, save_file

    source = tmp_path / name
    shutil.copytree(hf_checkpoints[name], source)
    index = json.loads((source / "model.safetensors.index.json").read_text())
    path = source / index["weight_map"][key]
    tensors = load_file(path)
    if change is None:  # gone, from its file and the index
        del tensors[key], index["weight_map"][key]
        (source / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        tensors[key] = change(tensors[key])
    save_file(tensors, path, metadata={"format": "pt"})
    run = cli("plan", str(source), "--world-size", "2")
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1
    assert words in run.stderr, run.stderr


# --- tensors split from one checkpoint tensor -------------------------------------------------


def test_a_fused_projection_is_split_into_the_models_tensors(hf_checkpoints):
    plan = tpviz.resolve_plan(hf_checkpoints["sarvam_moe"], 2)
    assert not plan.errors, plan.errors
    fused = "model.layers.1.attention.query_key_value.weight"  # rows [q | k | v]
    parts = [plan.tensor(f"model.layers.1.self_attn.{p}_proj.weight") for p in "qkv"]
    assert [(t.checkpoint_keys, t.combine, t.global_shape) for t in parts] == [
        ([fused], "split(0)", [512, 128]),
        ([fused], "split(0)", [256, 128]),
        ([fused], "split(0)", [256, 128]),
    ]
    # each part sees the whole fused tensor placed where it lies relative to the part
    assert [(t.sources[0].offset, t.sources[0].shape) for t in parts] == [
        ([0, 0], [1024, 128]),
        ([-512, 0], [1024, 128]),
        ([-768, 0], [1024, 128]),
    ]
    assert [r.shape for r in parts[1].ranks] == [[128, 128]] * 2  # by head, as planned
    chunked = tpviz.resolve_plan(hf_checkpoints["hrm_text"], 2)
    assert not chunked.errors, chunked.errors
    gate = chunked.tensor("model.L_module.layers.0.mlp.gate_proj.weight")
    assert gate.combine == "chunk(0)" and gate.checkpoint_keys[0].endswith(
        "mlp.gate_up_proj.weight"
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, strategy",
    [("sarvam_moe", "sliced"), ("sarvam_moe", "rank0_broadcast"), ("hrm_text", "sliced")],
)
def test_each_rank_reads_its_rows_of_a_fused_projection(hf_checkpoints, name, strategy):
    source = hf_checkpoints[name]
    with tpviz.launch(source, 2, strategy=strategy) as job:
        result = job.wait(180)
        logits = job.forward(torch.tensor(FIXED_PROMPT) % 1003)
    assert result["plan_matches_shards"]
    assert all(r["peak_tensor_bytes"] == r["forecast_peak_bytes"] for r in result["ranks"])
    with torch.no_grad():
        expected = hf_model(source)(torch.tensor(FIXED_PROMPT) % 1003).logits
    assert (logits - expected).abs().max().item() <= 1e-4


# experts cut along their features: gate_up_proj one block of each of gate and up per rank,
# down_proj across each source's columns
EXPERT_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.experts": "moe_tp_experts",  # sums the ranks' partial outputs
    "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
    "layers.*.mlp.experts.down_proj": "rowwise",
    "embed_tokens": "embedding_rowwise",
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, strategy, dtype",
    [
        ("mixtral", "sliced", None),
        ("mixtral", "rank0_broadcast", None),
        ("mixtral", "replicated", None),
        ("qwen2_moe_bf16", "sliced", "float32"),  # read through a buffer and cast
    ],
)
def test_each_rank_reads_its_slices_of_each_stacked_source(hf_checkpoints, name, strategy, dtype):
    source = hf_checkpoints[name]
    plan = tpviz.resolve_plan(source, 2, EXPERT_PLAN, dtype=dtype)
    assert not plan.errors, plan.errors
    stacked = [t for t in plan.params if t.sources]
    assert len(stacked) == 4
    with tpviz.launch(source, 2, plan, strategy=strategy) as job:
        result = job.wait(180)
        held = job.call(rank_tensors, [t.name for t in stacked])
    assert result["plan_matches_shards"]
    assert all(r["peak_tensor_bytes"] == r["forecast_peak_bytes"] for r in result["ranks"])
    reference = hf_model(source, torch.float32 if dtype else None)
    for t in stacked:
        full = reference.get_parameter(t.name).detach()
        for rank, tensors in enumerate(held):
            expected = torch.empty(t.ranks[rank].shape, dtype=full.dtype)
            assert torch.equal(tensors[t.name], fill_part(expected, full, t, rank)), (t.name, rank)


# --- 0-dim tensors ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["sliced", "rank0_broadcast", "replicated"])
def test_scalar_tensors_load_under_every_strategy(hf_checkpoints, strategy):
    source = hf_checkpoints["apertus"]
    plan = tpviz.resolve_plan(source, 2)
    beta = plan.tensor("model.layers.0.mlp.act_fn.beta")
    assert beta.global_shape == [] and beta.placement == "replicate"
    assert "scalar" in plan_table(plan)
    with tpviz.launch(source, 2, plan, strategy=strategy, verify=True) as job:
        result = job.wait(180)
        held = job.call(rank_tensors, [beta.name])
    assert result["plan_matches_shards"] and result["verify"]["ok"]
    assert all(r["peak_tensor_bytes"] == r["forecast_peak_bytes"] for r in result["ranks"])
    expected = hf_model(source).get_buffer(beta.name)
    assert all(torch.equal(h[beta.name], expected) for h in held)


# --- plans that shard nothing -----------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["falcon", "stablelm", "bitnet"])
def test_a_plan_that_shards_nothing_says_so(tmp_path, model_type):
    kwargs = {k: v for k, v in TINY_DIMS.items() if model_type != "falcon" or "key" not in k}
    transformers.AutoConfig.for_model(model_type, **kwargs).save_pretrained(tmp_path)
    plan = tpviz.resolve_plan(tmp_path, 2)
    assert not plan.errors and all(t.placement == "replicate" for t in plan.params)
    (warning,) = [w for w in plan.warnings if w.code == "mostly_replicated"]
    assert "100%" in warning.message and "--plan" in warning.message
    assert "warning [mostly_replicated]" in plan_table(plan)
    assert "warning [mostly_replicated]" in issues_html(plan)  # the PlanView's issue list
    assert not any(w.code == "mostly_replicated" for w in tpviz.resolve_plan(tmp_path, 1).warnings)


def test_a_plan_that_leaves_most_bytes_whole_says_so(hf_checkpoints):
    source = hf_checkpoints["qwen2_f32"]
    assert not [w for w in tpviz.resolve_plan(source, 2).warnings if w.code == "mostly_replicated"]
    few = tpviz.resolve_plan(source, 2, {"layers.*.self_attn.q_proj": "colwise"})
    (warning,) = [w for w in few.warnings if w.code == "mostly_replicated"]
    share = sum(t.nbytes for t in few.params if t.placement == "replicate") / few.total_bytes
    assert f"{share:.0%}" in warning.message and "shards nothing" not in warning.message


@pytest.mark.slow
def test_loading_a_plan_that_shards_nothing_warns(hf_checkpoints):
    shown = run_cli("plan", str(hf_checkpoints["falcon"]), "--world-size", "2")
    assert shown.returncode == 0 and "warning [mostly_replicated]" in shown.stdout
    with tpviz.launch(hf_checkpoints["falcon"], 2) as job:
        result = job.wait(180)
    assert result["plan_matches_shards"]
    assert [w["code"] for w in result["warnings"]] == ["mostly_replicated"]
    assert "warning [mostly_replicated]" in load_table(result)


# --- a conversion registered with transformers: fused projections -------------------------------

REGISTERED = """
import json, sys
import torch
import transformers
import tpviz
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import Concatenate, Interleave, WeightConverter

source, prompt = sys.argv[1], torch.tensor(json.loads(sys.argv[2])) % 1003
fused = WeightConverter(
    ["mlp.gate_proj.weight", "mlp.up_proj.weight"], "mlp.gate_up_proj.weight", [Concatenate(0)]
)
register_checkpoint_conversion_mapping("phi3", [fused])
plan = tpviz.resolve_plan(source, 2)
gate_up = plan.tensor("model.layers.0.mlp.gate_up_proj.weight")
with tpviz.launch(source, 2, plan, verify=True) as job:
    result = job.wait(180)
    logits = job.forward(prompt)
expected = transformers.AutoModelForCausalLM.from_pretrained(source)(prompt).logits
qkv = "self_attn.qkv_proj.weight"
interleaved = WeightConverter(qkv, qkv, [Interleave(0)])
register_checkpoint_conversion_mapping("phi3", [fused, interleaved], overwrite=True)
print(json.dumps({
    "errors": [e.code for e in plan.errors],
    "keys": gate_up.checkpoint_keys,
    "combine": gate_up.combine,
    "ok": result["plan_matches_shards"] and result["verify"]["ok"],
    "diff": (logits - expected).abs().max().item(),
    "unsupported": [(e.code, e.name, e.message) for e in tpviz.resolve_plan(source, 2).errors],
}))
"""


@pytest.mark.slow
def test_projections_fused_by_a_registered_conversion_are_read_per_source(tmp_path):
    """A user's conversion registered with transformers (public API) is applied too: phi3's
    fused gate_up_proj read from separate gate and up tensors, each rank its slices of both."""
    from safetensors.torch import load_file, save_file

    config = transformers.Phi3Config(**{**TINY_DIMS, "num_key_value_heads": 8}, pad_token_id=0)
    torch.manual_seed(7)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for name in [n for n in tensors if n.endswith("mlp.gate_up_proj.weight")]:
        gate, up = tensors.pop(name).chunk(2)
        tensors[name.replace("gate_up_proj", "gate_proj")] = gate.contiguous()
        tensors[name.replace("gate_up_proj", "up_proj")] = up.contiguous()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    import subprocess
    import sys

    from .conftest import REPO

    run = subprocess.run(
        [sys.executable, "-c", REGISTERED, str(tmp_path), json.dumps(FIXED_PROMPT)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["errors"] == [] and out["ok"] and out["diff"] <= 1e-4
    layer = "model.layers.0.mlp"
    assert out["keys"] == [f"{layer}.gate_proj.weight", f"{layer}.up_proj.weight"]
    assert out["combine"] == "cat(0)"
    codes = {code for code, _, _ in out["unsupported"]}
    assert codes == {"unsupported_conversion"}
    assert "Interleave" in out["unsupported"][0][2] and "qkv_proj" in out["unsupported"][0][1]


def test_tensors_transformers_ignores_on_load_are_not_errors(hf_checkpoints, tmp_path):
    """Old checkpoints hold per-layer rotary `inv_freq` copies, which transformers drops as it
    loads; a tensor no rule covers is still an error."""
    from safetensors.torch import save_file

    source = hf_checkpoints["gpt_neox"]
    for f in source.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    extra = {
        "gpt_neox.layers.0.attention.rotary_emb.inv_freq": torch.ones(4),
        "gpt_neox.layers.0.attention.extra.weight": torch.ones(4),
    }
    save_file(extra, tmp_path / "model-extra.safetensors", metadata={"format": "pt"})
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(extra, "model-extra.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    plan = tpviz.resolve_plan(tmp_path, 2)
    assert [(e.code, e.name) for e in plan.errors] == [
        ("unexpected_tensor", "gpt_neox.layers.0.attention.extra.weight")
    ]


# --- tensors saved transposed -------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_vl_moe(tmp_path_factory):
    """A tiny Qwen3-VL-MoE saved as its released checkpoints are: experts `gate_up_proj`
    [experts, hidden, 2 x intermediate] and `down_proj` [experts, intermediate, hidden], the
    transposes of the model's, which transformers transposes as it loads; and transformers'
    logits of it."""
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("transposed") / "qwen3_vl_moe"
    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}
    text = tiny_text(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48)
    text.update(rope_parameters=rope)
    vision = dict(VISION, depth=1, num_heads=2, out_hidden_size=128, deepstack_visual_indexes=[0])
    config = transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision)
    torch.manual_seed(11)
    model = transformers.AutoModelForMultimodalLM.from_config(config)
    state = {
        k: (v.transpose(1, 2) if ".experts." in k else v).contiguous()
        for k, v in model.state_dict().items()
    }
    path.mkdir()
    config.save_pretrained(path)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    loaded = transformers.AutoModelForMultimodalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logits = loaded(input_ids=torch.tensor(FIXED_PROMPT) % 1003).logits
    return path, logits


def test_experts_saved_transposed_are_read_transposed(qwen3_vl_moe):
    source, _ = qwen3_vl_moe
    plan = tpviz.resolve_plan(source, 2)
    assert not plan.errors
    gate_up = plan.tensor("model.language_model.layers.0.mlp.experts.gate_up_proj")
    assert gate_up.global_shape == [8, 96, 128] and gate_up.combine == "transpose(1, 2)"
    (saved,) = gate_up.sources
    assert saved.order == [0, 2, 1] and in_saved_order(saved.shape, saved.order) == [8, 128, 96]
    assert gate_up.placement != "replicate"


@pytest.mark.parametrize(
    "change, words",
    [
        (
            lambda t: t[..., :95],
            "holds [8, 128, 95] as {}, which transpose(1, 2) makes [8, 95, 128]",
        ),
        (lambda t: t[0], "cannot transpose dims 1 and 2 of {}, which is [128, 96]"),
    ],
)
def test_a_broken_transposed_tensor_is_named_with_its_saved_shape(
    qwen3_vl_moe, tmp_path, change, words
):
    from safetensors.torch import load_file, save_file

    source = tmp_path / "broken"
    shutil.copytree(qwen3_vl_moe[0], source)
    tensors = load_file(source / "model.safetensors")
    key = "model.language_model.layers.1.mlp.experts.gate_up_proj"
    tensors[key] = change(tensors[key]).contiguous()
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    (error,) = tpviz.resolve_plan(source, 2).errors
    assert error.name == key and words.format(key) in error.message, error.message


@pytest.mark.slow
def test_experts_saved_transposed_load_in_every_strategy_and_layout(qwen3_vl_moe):
    source, expected = qwen3_vl_moe
    prompt = torch.tensor(FIXED_PROMPT) % 1003
    loads = [("sliced", "tp"), ("rank0_broadcast", "ep"), ("replicated", "tp")]
    job = tpviz.launch(source, 2, strategy="sliced", experts="tp", verify=True)
    try:
        for i, (strategy, experts) in enumerate(loads):
            if i:  # the same ranks
                job = job.reload(strategy=strategy, experts=experts)
            result = job.wait(180)
            assert result["plan_matches_shards"] and result["verify"]["ok"], strategy
            diff = (job.forward(prompt) - expected).abs().max().item()
            assert diff <= 1e-4, (strategy, experts, diff)
    finally:
        job.shutdown()
