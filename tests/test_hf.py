"""transformers checkpoints (made here with transformers' own classes and save_pretrained),
loaded with the TP plans transformers computes, against transformers' own logits."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import tpviz
from tpviz.models import FIXED_PROMPT
from tpviz.models.config import ConfigError

from .conftest import REPO, run_cli
from .hf_tiny import TINY_DIMS

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**TINY_DIMS),  # GQA
    "qwen2": lambda: transformers.Qwen2Config(**TINY_DIMS, tie_word_embeddings=True),  # q/k/v bias
    "mistral": lambda: transformers.MistralConfig(**TINY_DIMS, sliding_window=None),
    "qwen3": lambda: transformers.Qwen3Config(**TINY_DIMS, head_dim=16),  # q/k norms
    "phi3": lambda: transformers.Phi3Config(
        **{**TINY_DIMS, "num_key_value_heads": 8}, pad_token_id=0
    ),  # fused qkv and gate_up
    "minicpm3": lambda: transformers.MiniCPM3Config(
        **{**TINY_DIMS, "num_key_value_heads": 8},
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
    ),  # multi-head latent attention: mla_kv_a_proj
    "granite_swa": lambda: transformers.GraniteSWAConfig(**TINY_DIMS, pad_token_id=0),  # sinks
}


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for i, (name, make) in enumerate(CONFIGS.items()):
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(make())
        with torch.no_grad():  # norms away from one, so they matter
            for n, p in model.named_parameters():
                if "norm" in n or "sinks" in n:
                    p.add_(0.1 * torch.randn_like(p))
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


def transformers_logits(source) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(FIXED_PROMPT) % 1003).logits


def test_qwen2_is_tied_and_phi3_is_fused(hf_models):
    qwen2 = tpviz.resolve_plan(hf_models["qwen2"], 2, model="hf")
    assert qwen2.tensor("model.embed_tokens.weight").tied_to == ["lm_head.weight"]
    assert qwen2.tensor("model.layers.0.self_attn.q_proj.bias").placement == "shard(0)"
    phi3 = tpviz.resolve_plan(hf_models["phi3"], 2)
    assert phi3.model == "hf" and not phi3.errors
    assert phi3.tensor("model.layers.0.self_attn.qkv_proj.weight").style == "colwise_gather_output"
    assert phi3.tensor("model.layers.0.mlp.down_proj.weight").style == "rowwise_split_input"
    qwen3 = tpviz.resolve_plan(hf_models["qwen3"], 2)
    assert qwen3.tensor("model.layers.0.self_attn.q_norm.weight").style == (
        "replicated_with_grad_allreduce"
    )


def test_latent_attention_keeps_its_kv_down_projection_whole_and_its_heads_aligned(hf_models):
    plan = tpviz.resolve_plan(hf_models["minicpm3"], 2)
    assert plan.model == "hf" and not plan.errors
    kv_a = plan.tensor("model.layers.0.self_attn.kv_a_proj_with_mqa.weight")
    assert (kv_a.style, kv_a.placement) == ("mla_kv_a_proj", "replicate")
    assert plan.tensor("model.layers.0.self_attn.kv_b_proj.weight").placement == "shard(0)"
    (error,) = tpviz.resolve_plan(hf_models["minicpm3"], 3).errors  # 8 heads
    assert error.code == "head_alignment" and "q_b_proj" in error.name
    assert "world sizes that work: 1, 2, 4, 8" in error.message


def test_attention_sinks_are_sharded_by_head_and_used_as_local_tensors(hf_models):
    plan = tpviz.resolve_plan(hf_models["granite_swa"], 4)
    assert not plan.errors
    assert plan.module_styles["model.layers.0.self_attn"] == "local_params"
    sinks = plan.tensor("model.layers.0.self_attn.sinks")
    assert (sinks.style, sinks.placement) == ("colwise", "shard(0)")
    assert [r.shape for r in sinks.ranks] == [[2]] * 4  # 8 heads
    # a module style that places its own tensors still conflicts with a sharding tensor key
    patterns = {k: "replicate" if v == "local_params" else v for k, v in plan.patterns.items()}
    clash = tpviz.resolve_plan(hf_models["granite_swa"], 2, patterns)
    assert {e.code for e in clash.errors} == {"conflicting_style"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, world_size",
    [
        ("llama", 2),
        ("qwen2", 2),
        ("mistral", 2),
        ("qwen3", 2),
        ("qwen3", 4),
        ("phi3", 2),
        ("minicpm3", 2),
        ("granite_swa", 2),
    ],
)
def test_logits_match_transformers(hf_models, name, world_size):
    source = hf_models[name]
    expected = transformers_logits(source)
    with tpviz.launch(source, world_size, model="hf", verify=True) as job:
        result = job.wait(180)
        logits = job.forward(torch.tensor(FIXED_PROMPT) % 1003)
    assert result["plan_matches_shards"]
    assert result["verify"]["ok"] and result["verify"]["max_abs_diff"] <= 1e-4
    assert (logits - expected).abs().max().item() <= 1e-4


def test_a_factorys_computed_buffers_are_made_as_its_code_makes_them_or_refused(hf_models):
    """A factory's model is built on meta, which loses the buffers its code computes: a
    transformers model's are made by transformers' init, as `--model hf` makes them; a
    model that cannot make them again is refused, naming the buffer, not loaded without."""
    from tpviz.models import FactoryAdapter, build_skeleton, read_config

    config = read_config(hf_models["llama"])
    adapter = FactoryAdapter("tests.helpers:transformers_llama")
    model = build_skeleton(adapter, config, torch.float32)
    adapter.compute_buffers(model, torch.device("cpu"))
    made = model.model.rotary_emb.inv_freq
    expected = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).model.rotary_emb
    assert not made.is_meta and torch.equal(made, expected.inv_freq)
    adapter = FactoryAdapter("tests.helpers:with_a_computed_buffer")
    model = build_skeleton(adapter, config, torch.float32)
    with pytest.raises(ConfigError, match=r"1\.inv_freq \(_Rotary\) is a buffer its code comp"):
        adapter.compute_buffers(model, torch.device("cpu"))


@pytest.mark.slow
def test_a_factory_building_a_transformers_model_loads_and_verifies(hf_models):
    with tpviz.launch(hf_models["llama"], 2, model="tests.helpers:transformers_llama") as job:
        job.wait(180)
        assert job.result["plan_matches_shards"] and job.verify()["ok"]


@pytest.mark.slow
def test_packed_colwise_keeps_the_phi3_mlp_sharded(hf_models):
    source = hf_models["phi3"]
    plan = {
        "layers.*.self_attn.qkv_proj": "colwise_gather_output",
        "layers.*.self_attn.o_proj": "rowwise_split_input",
        "layers.*.mlp.gate_up_proj": "packed_colwise",
        "layers.*.mlp.down_proj": "rowwise",
        "embed_tokens": "embedding_rowwise",
        "lm_head": "colwise_gather_output",
    }
    resolved = tpviz.resolve_plan(source, 2, plan)
    gate_up = resolved.tensor("model.layers.0.mlp.gate_up_proj.weight")
    assert [[b.offset[0] for b in r.blocks] for r in gate_up.ranks] == [[0, 256], [128, 384]]
    expected = transformers_logits(source)
    with tpviz.launch(source, 2, resolved) as job:
        result = job.wait(180)
        logits = job.forward(torch.tensor(FIXED_PROMPT) % 1003)
        rows = {r["name"]: r for r in job.shard_report()[1]}
    assert result["plan_matches_shards"]
    assert rows["model.layers.0.mlp.gate_up_proj.weight"]["shape"] == [256, 128]
    assert rows["model.layers.0.mlp.down_proj.weight"]["placement"] == "shard(1)"
    assert (logits - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cli_plan(hf_models, name, cli):
    source = str(hf_models[name])
    shown = cli("plan", source, "--world-size", "2", "--json")
    assert shown.returncode == 0, shown.stderr
    assert not json.loads(shown.stdout)["errors"]


# every architecture loads and verifies in test_logits_match_transformers: through the CLI,
# one on the built-in model (auto picks it for Llama) and one on the transformers adapter
@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_cli_load_verify(hf_models, name, cli):
    source = str(hf_models[name])
    loaded = cli("load", source, "--world-size", "2", "--verify", "--json")
    assert loaded.returncode == 0, loaded.stderr
    verify = json.loads(loaded.stdout)["verify"]
    assert verify["ok"] and verify["max_abs_diff"] <= 1e-4


@pytest.mark.slow
def test_random_init_uses_transformers_init(hf_models):
    with tpviz.launch(
        hf_models["qwen3"], 2, strategy="rank0_broadcast", init="random", seed=5, verify=True
    ) as job:
        result = job.wait(180)
        std = job.call(_weight_std, "model.layers.0.mlp.up_proj.weight")
    assert result["init_check"]["ok"] and result["verify"]["ok"]
    # transformers' _init_weights: normal(0, initializer_range=0.02)
    assert all(0.015 < s < 0.025 for s in std)


def _weight_std(model, name):
    from tpviz.models.adapter import local_of

    return local_of(model.get_parameter(name)).std().item()


def _tensor_values(model, module):
    """A module's own parameters as lists (its buffers are checked by verify and init_check)."""
    return {n: p.tolist() for n, p in model.get_submodule(module).named_parameters()}


def test_moe_expert_styles_plan_and_styles_still_unsupported_are_reported(tmp_path, cli):
    config = transformers.MixtralConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
    )
    config.save_pretrained(tmp_path / "mixtral")
    # transformers' MoE plan (moe_tp_experts) is executed now: tests/test_moe.py loads it
    assert cli("plan", str(tmp_path / "mixtral"), "--world-size", "2").returncode == 0
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps({"layers.*.mlp.gate": "ep_router"}))
    args = ("plan", str(tmp_path / "mixtral"), "--world-size", "2", "--json")
    result = cli(*args, "--plan", str(plan_file))
    assert result.returncode == 2
    (error,) = [e for e in json.loads(result.stdout)["errors"] if e["code"] == "unsupported_style"]
    assert "ep_router" in error["message"] and "model.layers.0.mlp.gate" in error["message"]
    with pytest.raises(tpviz.PlanError, match="ep_router"):
        tpviz.launch(tmp_path / "mixtral", 2, plan_file, init="random")


@pytest.mark.slow  # a fresh interpreter without transformers
def test_without_transformers_other_architectures_say_to_install_the_extra(hf_models):
    code = (
        "import sys; sys.modules['transformers'] = None; from tpviz.cli import main; "
        f"sys.exit(main(['plan', {str(hf_models['qwen2'])!r}]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert result.returncode == 2
    assert "pip install 'tpviz[hf]'" in result.stderr
    builtin = subprocess.run(
        [sys.executable, "-c", code.replace(str(hf_models["qwen2"]), str(hf_models["llama"]))],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert builtin.returncode == 0, builtin.stderr  # the Llama family needs no transformers


REMOTE_CONFIG_CODE = """from transformers import LlamaConfig


class RemoteLlamaConfig(LlamaConfig):
    model_type = "remote_llama"
"""
REMOTE_MODEL_CODE = """from transformers import LlamaForCausalLM

from .configuration_remote_llama import RemoteLlamaConfig


class RemoteLlamaForCausalLM(LlamaForCausalLM):
    config_class = RemoteLlamaConfig
"""


@pytest.mark.slow  # fresh interpreters: HF_MODULES_CACHE is read when transformers is imported
def test_code_shipped_with_a_checkpoint_runs_only_when_asked(hf_models, tmp_path):
    source = tmp_path / "remote"
    source.mkdir()
    for f in hf_models["llama"].iterdir():
        (source / f.name).write_bytes(f.read_bytes())
    (source / "configuration_remote_llama.py").write_text(REMOTE_CONFIG_CODE)
    (source / "modeling_remote_llama.py").write_text(REMOTE_MODEL_CODE)
    config = json.loads((source / "config.json").read_text())
    config.update(
        model_type="remote_llama",
        architectures=["RemoteLlamaForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_remote_llama.RemoteLlamaConfig",
            "AutoModelForCausalLM": "modeling_remote_llama.RemoteLlamaForCausalLM",
        },
    )
    (source / "config.json").write_text(json.dumps(config))
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules")}
    refused = run_cli("plan", str(source), "--world-size", "2", env=env)
    assert refused.returncode == 2
    assert "auto_map" in refused.stderr and "--model hf-remote-code" in refused.stderr
    assert not (tmp_path / "modules").exists()  # nothing of the shipped code was imported
    loaded = run_cli(
        "load",
        str(source),
        "--world-size",
        "2",
        "--model",
        "hf-remote-code",
        "--verify",
        "--json",
        env=env,
    )
    assert loaded.returncode == 0, loaded.stderr
    result = json.loads(loaded.stdout)
    assert result["plan_matches_shards"] and result["verify"]["ok"]
    assert (tmp_path / "modules").exists()


@pytest.mark.slow
def test_random_init_draws_what_an_ancestor_sets_and_defaults_what_nothing_sets(tmp_path):
    # Qwen3.5-MoE's router weight is drawn by its sparse block's init, not the router's own;
    # Apertus' xIELU alphas (and saved beta, eps) are set only when the class is built, by no
    # init at all: tpviz's default draws them, and the result names them
    small = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    linear = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16)
    qwen = transformers.AutoConfig.for_model(
        "qwen3_5_moe_text",
        **TINY_DIMS,
        **small,
        **linear,
        linear_value_head_dim=16,
        head_dim=16,
        shared_expert_intermediate_size=32,
    )
    qwen.save_pretrained(tmp_path / "qwen")
    transformers.AutoConfig.for_model("apertus", **TINY_DIMS).save_pretrained(tmp_path / "apertus")
    # CTRL's head: its weight tied to the embedding (another unit's), a bias of its own
    ctrl = transformers.AutoConfig.for_model("ctrl", **TINY_DIMS, dff=256)
    ctrl.save_pretrained(tmp_path / "ctrl")
    with tpviz.launch(
        tmp_path / "qwen", 2, strategy="rank0_broadcast", init="random", verify=True
    ) as first:
        result = first.wait(180)
        std = first.call(_weight_std, "model.layers.0.mlp.gate.weight")
        assert result["verify"]["ok"], result["verify"]
        assert all(0.015 < s < 0.025 for s in std), std
        tied = first.reload(source=tmp_path / "ctrl")
        result = tied.wait(180)
        assert result["init_check"]["ok"] and result["verify"]["ok"], result["init_check"]
        built = tied.reload(source=tmp_path / "apertus")
        result = built.wait(180)
        assert result["init_check"]["ok"] and result["verify"]["ok"], result["init_check"]
        assert result["init_check"]["drawn_without_init"] == [
            f"XIELUActivation.{n}" for n in ("alpha_n", "alpha_p", "beta", "eps")
        ]
        act = "model.layers.0.mlp.act_fn"
        assert built.call(_tensor_values, act) == [{"alpha_n": [1.0], "alpha_p": [1.0]}] * 2
