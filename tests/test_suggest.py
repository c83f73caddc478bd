"""Suggested plans (`tpviz.suggest_plan`, `tpviz plan --suggest [--check]`, the Dashboard's
suggest button) on models that ship no usable plan: Falcon (multi-query, fused qkv), StableLM
(per-head q/k norms), BitNet (sub-norms over the cut features), Phi-3 (fused gate_up), each
built with transformers' own classes from its default config scaled down, and the built-in
Llama with its plan ignored.

The suggestions are computed in-process once per model; `--check` (real ranks) runs once per
model in the slow tests.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import tpviz
from tpviz import cli
from tpviz.models.demo import make_checkpoint

from .hf_tiny import TINY_DIMS, save_tiny

transformers = pytest.importorskip("transformers")

DIMS = dict(TINY_DIMS, pad_token_id=0)
# name -> (model_type, changes to the defaults); StableLM's qk_layernorm is off by default
HF_MODELS = {
    "falcon": ("falcon", {}),
    "stablelm": ("stablelm", dict(qk_layernorm=True)),
    "bitnet": ("bitnet", {}),
    "phi3": ("phi3", {}),
    "mixtral": ("mixtral", dict(num_local_experts=4)),
    # 100 intermediate features split evenly over 4 ranks but not 8; 8 experts fill 8 ranks
    "mixtral_100": ("mixtral", dict(num_local_experts=8, intermediate_size=100)),
    "mixtral_100_4": ("mixtral", dict(num_local_experts=4, intermediate_size=100)),
    "opt": ("opt", dict(ffn_dim=128, word_embed_proj_dim=64)),  # learned positions
}
MLP = {
    "falcon": ("mlp.dense_h_to_4h", "mlp.dense_4h_to_h"),
    "stablelm": ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
    "bitnet": ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
    "phi3": ("mlp.gate_up_proj", "mlp.down_proj"),
    "llama": ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """name -> checkpoint dir, built once on first use; norms moved away from one."""
    root = tmp_path_factory.mktemp("suggest")
    built = {}

    def get(name: str):
        if name in built:
            return built[name]
        if name == "llama":
            built[name] = make_checkpoint(root / name, "tiny")
            return built[name]
        model_type, changes = HF_MODELS[name]
        config = transformers.AutoConfig.for_model(model_type, **{**DIMS, **changes})
        built[name] = save_tiny(config, root / name, seed=len(built))
        return built[name]

    return get


@pytest.fixture(scope="module")
def suggestion(checkpoint):
    """(name, world size) -> the suggestion, computed once."""
    found = {}

    def get(name: str, world_size: int = 2):
        if (name, world_size) not in found:
            found[name, world_size] = tpviz.suggest_plan(checkpoint(name), world_size)
        return found[name, world_size]

    return get


def _placements(plan) -> dict[str, str]:
    return {e.name: e.placement for e in plan.params}


def _decision(s, module: str):
    return next(d for d in s.decisions if any(p.endswith(module) for p in d.patterns))


@pytest.mark.parametrize("name", ["falcon", "stablelm", "bitnet", "phi3", "llama"])
def test_every_suggestion_resolves_and_shards_its_mlp(suggestion, name):
    s = suggestion(name)
    assert s.resolved.errors == [] and s.max_abs_diff <= s.tolerance
    placed = _placements(s.resolved)
    for module in MLP[name]:
        weights = [n for n in placed if n.endswith(f"{module}.weight")]
        assert len(weights) == 2 and all(placed[w].startswith("shard(") for w in weights)
    layers = [e for e in s.resolved.params if e.name.startswith(s.layers)]
    sharded = sum(e.nbytes for e in layers if e.placement != "replicate")
    assert s.decoder_bytes == sum(e.nbytes for e in layers) and s.decoder_sharded_bytes == sharded
    assert 0.9 < s.decoder_share <= 1  # every Linear of these layers; norms stay whole


def test_builtin_llama_suggestion_shards_what_its_shipped_plan_shards(suggestion, checkpoint):
    for world_size in (2, 4):
        shipped = tpviz.resolve_plan(checkpoint("llama"), world_size)
        assert _placements(suggestion("llama", world_size).resolved) == _placements(shipped)
    decisions = suggestion("llama").decisions
    assert all(d.tried == [] for d in decisions if d.kind != "other")  # Megatron everywhere
    norms = [d for d in decisions if d.kind == "other"]
    assert {d.patterns[0] for d in norms} == {
        "model.layers.*.input_layernorm",
        "model.layers.*.post_attention_layernorm",
        "model.norm",
    }
    assert all(d.styles == {} and "not an nn.Linear" in d.tried[0] for d in norms)


def test_forward_code_that_reshapes_by_the_head_count_keeps_attention_gathered(suggestion):
    # Falcon's fused multi-query qkv holds one key-value head (no cut by head keeps it whole)
    # and is split by num_heads (on a rank's features that split fails): q/k/v and
    # the output projection are sharded, but every rank sees their activations whole
    attention = _decision(suggestion("falcon"), "self_attention.dense")
    assert set(attention.styles.values()) == {"colwise_gather_output", "rowwise_split_input"}
    assert [why.split(":")[0] for why in attention.tried] == [
        "colwise, rowwise",
        "packed_colwise, rowwise",
    ]
    assert all("forward fails" in why or "head_alignment" in why for why in attention.tried)
    mlp = _decision(suggestion("falcon"), "mlp.dense_4h_to_h")
    assert set(mlp.styles.values()) == {"colwise", "rowwise"} and mlp.tried == []
    tied = _decision(suggestion("falcon"), "lm_head")  # tied to the embedding: one unit
    assert tied.styles == {
        "transformer.word_embeddings": "embedding_rowwise",
        "lm_head": "colwise_gather_output",
    }


def test_a_norm_over_the_cut_features_is_never_cut_under_it(suggestion):
    s = suggestion("bitnet")
    mlp = _decision(s, "mlp.down_proj")  # ffn_sub_norm normalises the intermediate features
    assert mlp.styles["model.layers.*.mlp.down_proj"] == "rowwise_split_input"
    assert "forward fails" in mlp.tried[0]
    attention = _decision(s, "self_attn.o_proj")  # attn_sub_norm spans every head
    assert "head_parameter" in attention.tried[0]
    assert _placements(s.resolved)["model.layers.0.mlp.ffn_sub_norm.weight"] == "replicate"


def test_silently_wrong_logits_are_caught_and_the_fused_parts_packed(suggestion):
    # plain colwise on Phi-3's [gate; up] gives rank 0 all of gate: no error, wrong numbers
    mlp = _decision(suggestion("phi3"), "mlp.down_proj")
    assert mlp.styles["model.layers.*.mlp.gate_up_proj"] == "packed_colwise"
    assert "logits differ from the whole model's" in mlp.tried[0]


def test_per_head_norms_in_a_module_list_stay_with_the_whole_heads(suggestion):
    s = suggestion("stablelm")
    attention = _decision(s, "self_attn.o_proj")
    assert set(attention.styles.values()) == {"colwise_gather_output", "rowwise_split_input"}
    norms = [e for e in s.resolved.params if ".q_layernorm.norms." in e.name]
    assert norms and all(e.placement == "replicate" for e in norms)


def test_experts_are_cut_by_derived_keys_and_their_partial_sums_simulated(suggestion, capsys):
    """The experts get the keys the `tp` layout derives; attention's pair is kept only if the
    simulated ranks also sum the experts' partial outputs as the real ranks do."""
    s = suggestion("mixtral")
    assert s.resolved.errors == [] and s.max_abs_diff <= s.tolerance
    experts = _decision(s, "mlp.experts")
    assert (experts.kind, list(experts.styles.values())) == ("experts", ["moe_tp_experts"])
    assert s.plan["model.layers.*.mlp.experts"] == "moe_tp_experts"  # in the printed plan
    assert _decision(s, "self_attn.o_proj").styles["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert _placements(s.resolved)["model.layers.0.mlp.experts.down_proj"] == "shard(2)"


@pytest.mark.parametrize(
    "name, style, placement, refused",
    [
        ("mixtral_100", "ep_dispatch_experts", "shard(0)", ["moe_tp_experts"]),
        ("mixtral_100_4", "replicate", "replicate", ["moe_tp_experts", "ep_dispatch_experts"]),
    ],
)
def test_experts_the_derived_cut_cannot_split_get_whole_experts_or_stay_whole(
    suggestion, name, style, placement, refused
):
    """A plan holds the experts whatever else it places: where their intermediate features do
    not split over the ranks, each rank gets whole experts, and where the experts do not
    either, they stay whole; the rest of the plan is suggested as for any model."""
    s = suggestion(name, 8)
    assert s.resolved.errors == [] and s.max_abs_diff <= s.tolerance
    experts = _decision(s, "mlp.experts")
    assert experts.styles["model.layers.*.mlp.experts"] == style
    assert [why.split(":")[0] for why in experts.tried] == refused
    assert all("uneven_experts" in why for why in experts.tried)
    attention = _decision(s, "self_attn.o_proj")
    assert attention.styles["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert _placements(s.resolved)["model.layers.0.mlp.experts.down_proj"] == placement


def test_cli_prints_a_plan_file_that_resolves_to_the_suggestion(
    suggestion, checkpoint, tmp_path, capsys
):
    source = str(checkpoint("falcon"))
    assert cli.main(["plan", source, "--suggest"]) == 0
    out, err = capsys.readouterr()
    (tmp_path / "plan.json").write_text(out)
    again = tpviz.resolve_plan(source, 2, tmp_path / "plan.json")
    assert _placements(again) == _placements(suggestion("falcon").resolved)
    assert "of the decoder layers'" in err and "not colwise, rowwise: " in err
    assert cli.main(["plan", source, "--suggest", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tp_plan"] == json.loads(out)
    assert data["suggestion"]["decoder_share"] == round(suggestion("falcon").decoder_share, 4)
    json_plan = tmp_path / "suggestion.json"  # the JSON itself is a plan file too
    json_plan.write_text(json.dumps(data))
    assert _placements(tpviz.resolve_plan(source, 2, json_plan)) == _placements(again)


def test_cli_refuses_check_alone_and_suggest_with_a_plan(checkpoint, tmp_path, capsys):
    source = str(checkpoint("llama"))
    assert cli.main(["plan", source, "--check"]) == 2
    assert "use it with --suggest" in capsys.readouterr().err
    (tmp_path / "p.json").write_text("{}")
    assert cli.main(["plan", source, "--suggest", "--plan", str(tmp_path / "p.json")]) == 2
    assert "drop --plan" in capsys.readouterr().err
    assert cli.main(["plan", source, "--suggest", "--experts", "ep"]) == 2
    assert "--suggest chooses the experts' layout itself" in capsys.readouterr().err


def test_a_suggestion_without_key_value_replication_needs_none(checkpoint):
    """At 8 ranks over 4 key-value heads, cutting attention by head needs replication: asked
    not to replicate, the suggestion keeps attention's heads whole (it replicated them before,
    a plan the same flag then refused)."""
    source = checkpoint("llama")
    s = tpviz.suggest_plan(source, 8, kv_replication=False)
    assert not s.resolved.errors and not s.resolved.kv_replication
    assert not tpviz.resolve_plan(source, 8, s.plan, kv_replication=False).errors
    assert s.plan["model.layers.*.mlp.gate_proj"] == "colwise"  # the rest is still cut


def test_dashboard_suggest_button_fills_the_editor(checkpoint, tmp_path):
    dash = tpviz.Dashboard(checkpoint("bitnet"), cache=tmp_path)
    assert dash.plan.patterns == {}  # transformers ships BitNet no plan
    dash.suggest_button.click()
    suggested = json.loads(dash.plan_editor.value)
    assert suggested["model.layers.*.mlp.gate_proj"] == "colwise_gather_output"
    assert dash.plan.patterns == suggested and dash.plan.errors == []
    assert "suggested plan: shards" in dash.status.value


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, world_size", [("falcon", 2), ("stablelm", 2), ("bitnet", 2), ("llama", 4)]
)
def test_suggest_check_loads_on_real_ranks_and_matches(checkpoint, capsys, name, world_size):
    source = str(checkpoint(name))
    args = ["plan", source, "--suggest", "--check", "--json", "--world-size", str(world_size)]
    assert cli.main(args) == 0
    data = json.loads(capsys.readouterr().out)
    check = data["check"]
    assert check["ok"] and check["plan_matches_shards"] and check["world_size"] == world_size
    # float32's 1e-4, times the largest logit where it is above 1 (these are about 1)
    assert check["max_abs_diff"] <= check["tolerance"] and 1e-4 <= check["tolerance"] < 1e-3
    assert all(any(p.endswith(m) for p in data["tp_plan"]) for m in MLP[name])


class _Attention(nn.Module):
    """A user's own attention: names no plan knows, heads split by `-1` views."""

    def __init__(self, dim: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.ask, self.key, self.val, self.mix = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        q, k, v = (
            p(h).view(b, t, -1, self.head_dim).transpose(1, 2)
            for p in (self.ask, self.key, self.val)
        )
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.mix(a.transpose(1, 2).reshape(b, t, -1))


class _Block(nn.Module):
    def __init__(self, dim: int, head_dim: int):
        super().__init__()
        self.ln_a, self.ln_b = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = _Attention(dim, head_dim)
        self.widen, self.narrow = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_a(x))
        return x + self.narrow(nn.functional.gelu(self.widen(self.ln_b(x))))


class _Model(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        dim = config["hidden_size"]
        self.tok = nn.Embedding(config["vocab_size"], dim)
        self.blocks = nn.ModuleList(
            _Block(dim, dim // config["num_attention_heads"])
            for _ in range(config["num_hidden_layers"])
        )
        self.unembed = nn.Linear(dim, config["vocab_size"], bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x)
        return self.unembed(x)


def user_model(config: dict) -> nn.Module:
    return _Model(config)


def test_a_users_own_module_gets_megatron_pairs_found_from_its_dataflow(tmp_path):
    config = dict(vocab_size=97, hidden_size=64, num_attention_heads=4, num_hidden_layers=3)
    (tmp_path / "config.json").write_text(json.dumps(config))
    s = tpviz.suggest_plan(tmp_path, 4, model="tests.test_suggest:user_model")
    assert s.plan == {
        "tok": "embedding_rowwise",
        **dict.fromkeys(["blocks.*.attn.ask", "blocks.*.attn.key", "blocks.*.attn.val"], "colwise"),
        "blocks.*.attn.mix": "rowwise",
        "blocks.*.widen": "colwise",
        "blocks.*.narrow": "rowwise",
        "unembed": "colwise_gather_output",
    }
    assert s.layers == "blocks." and s.resolved.errors == [] and s.decoder_share > 0.95


def test_modules_no_style_cuts_stay_replicated_with_the_reason(tmp_path, capsys):
    # GPT-2's projections are transformers' Conv1D (weight stored in x out), not nn.Linear
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=97, n_positions=32)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    assert cli.main(["plan", str(tmp_path), "--suggest"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {
        "transformer.wte": "embedding_rowwise",
        "lm_head": "colwise_gather_output",
        "transformer.wpe": "embedding_rowwise",
    }
    assert "transformer.h.*.attn.c_attn: replicated (Conv1D is not an nn.Linear" in err
    assert "(0.0%)" in err


def test_an_embedding_that_looks_up_no_ids_is_neither_suggested_nor_cut(suggestion, checkpoint):
    """OPT's learned positions subclass nn.Embedding, but their forward takes the attention
    mask: a vocabulary cut's hook would mask the mask. Its token embedding is still cut."""
    plan = suggestion("opt").plan
    assert "model.decoder.embed_positions" not in plan
    assert plan["model.decoder.embed_tokens"] == "embedding_rowwise"
    given = {"model.decoder.embed_positions": "embedding_rowwise"}
    errors = tpviz.resolve_plan(checkpoint("opt"), 2, given).errors
    assert [(e.code, e.name) for e in errors] == [
        ("unsupported_style", "model.decoder.embed_positions")
    ]
    assert "this module is OPTLearnedPositionalEmbedding" in errors[0].message
