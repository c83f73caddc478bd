"""The plan engine: chunk math, styles, precedence, aliases, validation, JSON."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from torch import nn

import tpviz
from tpviz import styles
from tpviz.plan import (
    ResolvedPlan,
    chunk_sizes,
    forecast,
    load_plan_patterns,
    resolve_plan,
    shard_blocks,
)

from .conftest import write_config
from .hf_tiny import TINY_DIMS

LLAMA_70B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    vocab_size=128256,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    max_position_embeddings=131072,
)


@pytest.mark.parametrize("n", [0, 1, 5, 6, 7, 8, 64, 1001, 32001])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_chunk_sizes_follow_torch_chunk(n, world):
    expected = [c.shape[0] for c in torch.empty(n).chunk(world)] if n else []
    expected += [0] * (world - len(expected))
    assert chunk_sizes(n, world) == expected
    assert sum(chunk_sizes(n, world)) == n


def test_trailing_ranks_can_be_empty():
    assert chunk_sizes(6, 4) == [2, 2, 2, 0]
    blocks = shard_blocks([6, 3], 0, 4)
    assert blocks[3] == []
    assert [b[0].offset for b in blocks[:3]] == [[0, 0], [2, 0], [4, 0]]


def test_packed_blocks_take_one_block_of_every_part():
    blocks = shard_blocks([8, 4], 0, 2, packed_parts=2)
    assert [(b.offset, b.shape) for b in blocks[0]] == [([0, 0], [2, 4]), ([4, 0], [2, 4])]
    assert [(b.offset, b.shape) for b in blocks[1]] == [([2, 0], [2, 4]), ([6, 0], [2, 4])]


class Toy(nn.Module):
    """A model with one module of every kind a style applies to."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList(nn.ModuleDict({"proj": nn.Linear(4, 6)}) for _ in range(4))
        self.fused = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(4)


def toy_plan(plan, world=2):
    with torch.device("meta"):
        model = Toy()
    return resolve_plan(model, world, plan)


def placements(plan):
    return {t.name: t.placement for t in plan.params}


@pytest.mark.parametrize(
    "style, weight, bias",
    [
        ("colwise", "shard(0)", "shard(0)"),
        ("rowwise", "shard(1)", "replicate"),
        ("colwise_gather_output", "shard(0)", "shard(0)"),
        ("rowwise_split_input", "shard(1)", "replicate"),
        ("packed_colwise", "shard(0)", "shard(0)"),
        ("replicated_with_grad_allreduce", "replicate", "replicate"),
        ("replicate", "replicate", "replicate"),
    ],
)
def test_every_linear_style_places_weight_and_bias(style, weight, bias):
    plan = toy_plan({"fused": style})
    assert not plan.errors
    fused = plan.tensor("fused.weight")
    assert (fused.style, fused.placement, plan.tensor("fused.bias").placement) == (
        style,
        weight,
        bias,
    )
    if style == "packed_colwise":
        assert len(fused.ranks[0].blocks) == 2 and fused.ranks[0].shape == [4, 4]


def test_embedding_rowwise_splits_the_vocabulary():
    plan = toy_plan({"embed": "embedding_rowwise"}, world=3)
    t = plan.tensor("embed.weight")
    assert t.placement == "shard(0)" and [r.shape for r in t.ranks] == [[4, 4], [4, 4], [2, 4]]


def test_style_on_the_wrong_module_kind_is_an_error():
    plan = toy_plan({"norm": "colwise", "embed": "rowwise"})
    codes = {(e.code, e.name) for e in plan.errors}
    assert ("unsupported_style", "norm") in codes and ("unsupported_style", "embed") in codes


def test_indexed_key_beats_wildcard_and_parameter_key_beats_module_key():
    plan = toy_plan(
        {
            "layers.*.proj": "colwise",
            "layers.2.proj": "rowwise",
            "layers.3.proj.bias": "replicate",
            "layers.3.proj": "rowwise",
        }
    )
    p = placements(plan)
    assert p["layers.0.proj.weight"] == "shard(0)"
    assert p["layers.2.proj.weight"] == "shard(1)"
    assert p["layers.3.proj.bias"] == "replicate"  # its own key (agrees with rowwise)
    assert not plan.errors


def test_longer_pattern_wins_between_wildcards():
    plan = toy_plan({"proj": "colwise", "layers.*.proj": "rowwise"})
    assert plan.tensor("layers.1.proj.weight").style == "rowwise"


def test_parameter_key_that_contradicts_its_module_is_an_error():
    plan = toy_plan({"fused": "colwise", "fused.bias": "replicate"})
    assert [e.code for e in plan.errors] == ["conflicting_style"]


def test_v4_aliases_resolve_and_keep_the_given_name():
    plan = toy_plan({"fused": "colwise_rep", "layers.*.proj": "rowwise_rep"})
    t = plan.tensor("fused.weight")
    assert (t.style, t.style_given) == ("colwise_gather_output", "colwise_rep")
    assert plan.tensor("layers.0.proj.weight").style == "rowwise_split_input"


def test_unknown_style_names_the_closest_valid_ones():
    plan = toy_plan({"fused": "colwsie"})
    (error,) = plan.errors
    assert error.code == "unknown_style" and "colwise" in error.message and "fused" in error.message


@pytest.mark.parametrize("typo", ["colwize", "colwise_repp", "rowwise_rep2", "local_rowise"])
def test_suggestions_are_canonical_names_with_aliases_named_as_aliases(typo):
    with pytest.raises(styles.UnknownStyle) as e:
        styles.canonical(typo)
    assert e.value.suggestions and all(s in styles.STYLES for s in e.value.suggestions)
    hint = str(e.value).split("; did you mean ")[1].split("?")[0]
    # every name offered outside parentheses is canonical; an alias appears only as "alias"
    offered = re.sub(r" \(alias (\w+)\)", "", hint).split(", ")
    assert offered == e.value.suggestions
    for alias in re.findall(r"\(alias (\w+)\)", hint):
        assert alias in styles.ALIASES
    assert "aliases: colwise_rep = colwise_gather_output" in str(e.value)


def test_known_but_unexecutable_style_is_reported_with_its_modules():
    plan = toy_plan({"layers.*.proj": "ep_router"})
    (error,) = [e for e in plan.errors if e.code == "unsupported_style"]
    assert "layers.0.proj" in error.message and "ep_router" in error.message


class _NormedEmbedding(nn.Embedding):
    """A vocabulary embedding that normalises the rows it looks up (as Inkling's does)."""

    def __init__(self, vocab: int, dim: int):
        super().__init__(vocab, dim)
        self.embed_norm = nn.LayerNorm(dim)

    def forward(self, input_ids):
        return self.embed_norm(super().forward(input_ids))


class _UnweightedNormEmbedding(_NormedEmbedding):
    """One whose norm has no weights (as Muse Glimmer's): it still computes on the rows."""

    def __init__(self, vocab: int, dim: int):
        super().__init__(vocab, dim)
        self.embed_norm = nn.LayerNorm(dim, elementwise_affine=False)


class _ScaledEmbedding(nn.Embedding):
    """One that scales its rows by a buffer (as Gemma's does): no submodule inside."""

    def __init__(self, vocab: int, dim: int):
        super().__init__(vocab, dim)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, input_ids):
        return super().forward(input_ids) * self.scale


@pytest.mark.parametrize("norm", [_NormedEmbedding, _UnweightedNormEmbedding])
def test_an_embedding_with_a_module_inside_computing_on_its_rows_is_not_cut_by_vocabulary(norm):
    # DTensor sums a vocabulary-cut lookup only where it leaves the module: a norm inside
    # would see one rank's partial rows (on real ranks DTensor fails there; summed, the
    # normalised partial rows are not in general the norm of their sum): refused before any rank
    with torch.device("meta"):
        model = nn.ModuleDict({"normed": norm(10, 4), "scaled": _ScaledEmbedding(10, 4)})
    plan = resolve_plan(model, 2, {"normed": "embedding_rowwise", "scaled": "embedding_rowwise"})
    (error,) = plan.errors
    assert (error.code, error.name) == ("unsupported_style", "normed")
    assert "no submodule (such as a norm)" in error.message
    assert norm.__name__ in error.message
    assert plan.tensor("scaled.weight").placement == "shard(0)"


def test_pattern_that_matches_nothing_is_a_warning():
    plan = toy_plan({"layers.*.mlp.w1": "colwise", "layers.*": "colwise"})
    assert [(w.code, w.name) for w in plan.warnings] == [
        ("unmatched_pattern", "layers.*.mlp.w1"),
        ("unmatched_pattern", "layers.*"),
        ("mostly_replicated", ""),  # and so the plan shards nothing
    ]
    assert plan.warnings[0].message == "plan key 'layers.*.mlp.w1' matches no module or tensor"
    assert plan.warnings[1].message.startswith(  # not "matches no module": it does
        "plan key 'layers.*' matches only modules without parameters of their own (such as "
        "layers.0): its style reaches nothing"
    )
    assert not plan.errors


def test_a_default_plans_keys_for_other_variants_are_not_warned_about(tmp_path):
    """transformers writes one plan for every variant of an architecture: Qwen2-MoE's names
    the dense MLP that a model whose every layer is sparse lacks. Given by the user, the same
    keys are warned about."""
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(
        "qwen2_moe", **TINY_DIMS, num_experts=4, moe_intermediate_size=32
    )
    config.save_pretrained(tmp_path)  # config.json alone: plans need no weights
    default = tpviz.resolve_plan(tmp_path, 2)
    assert default.errors == [] and "model.layers.*.mlp.gate_proj" in default.patterns
    assert not [w for w in default.warnings if w.code == "unmatched_pattern"]
    given = tpviz.resolve_plan(tmp_path, 2, default.patterns)
    unmatched = {w.name for w in given.warnings if w.code == "unmatched_pattern"}
    assert "model.layers.*.mlp.gate_proj" in unmatched


def test_base_model_and_full_model_keys_both_match(tiny):
    base = resolve_plan(tiny, 2, {"layers.*.mlp.up_proj": "colwise"})
    full = resolve_plan(tiny, 2, {"model.layers.*.mlp.up_proj": "colwise"})
    name = "model.layers.1.mlp.up_proj.weight"
    assert base.tensor(name).placement == full.tensor(name).placement == "shard(0)"


def test_plan_file_in_transformers_form(tmp_path, tiny):
    path = tmp_path / "plan.json"
    path.write_text(
        json.dumps(
            {
                "base_model_tp_plan": {"layers.*.mlp.up_proj": "colwise"},
                "tp_plan": {"lm_head": "colwise_gather_output"},
            }
        )
    )
    assert load_plan_patterns(path) == {
        "layers.*.mlp.up_proj": "colwise",
        "lm_head": "colwise_gather_output",
    }
    plan = resolve_plan(tiny, 2, path)
    assert plan.tensor("lm_head.weight").style == "colwise_gather_output"
    assert plan.tensor("model.layers.0.self_attn.q_proj.weight").style == "replicate"


def test_default_llama_plan_is_transformers_plan(tiny):
    plan = resolve_plan(tiny, 2)
    assert not plan.errors and not plan.warnings
    assert plan.tensor("model.embed_tokens.weight").style == "embedding_rowwise"
    assert plan.tensor("lm_head.weight").style == "colwise_gather_output"
    assert plan.tensor("model.layers.0.self_attn.o_proj.weight").placement == "shard(1)"
    assert plan.tensor("model.norm.weight").placement == "replicate"
    inv_freq = plan.tensor("model.rotary_emb.inv_freq")
    assert (inv_freq.kind, inv_freq.origin) == ("buffer", "computed")


def test_per_rank_bytes_sum_the_shards_and_total_counts_each_tensor_once(tiny):
    plan = resolve_plan(tiny, 4)
    for r in range(4):
        assert plan.per_rank_bytes[r] == sum(t.ranks[r].bytes for t in plan.params)
    replicated = sum(t.nbytes for t in plan.params if t.placement == "replicate")
    assert sum(plan.per_rank_bytes) == plan.total_bytes + 3 * replicated
    assert plan.total_bytes == sum(p.numel() * 4 for p in _state(tiny).values())


def _state(directory):
    from safetensors.torch import load_file

    state = {}
    for f in directory.glob("*.safetensors"):
        state.update(load_file(f))
    return {**state, "inv_freq": torch.empty(8)}


def test_tied_weights_appear_once_and_shard_alike(tiny_tied):
    plan = resolve_plan(tiny_tied, 2)
    names = [t.name for t in plan.params]
    assert "lm_head.weight" not in names
    embed = plan.tensor("model.embed_tokens.weight")
    assert embed.tied_to == ["lm_head.weight"] and embed.placement == "shard(0)"
    assert plan.tensor("lm_head.weight") is embed
    assert plan.module_styles["lm_head"] == "colwise_gather_output"
    assert not plan.errors


def test_a_stored_copy_of_a_tied_tensor_is_left_unread_with_a_warning(tiny_tied, tmp_path):
    """Conversions often save `lm_head.weight` beside the embedding it is tied to: transformers
    loads such a checkpoint (the tie wins), so tpviz plans it, reading the embedding's key; a
    copy of another shape is still an error."""
    from safetensors.torch import load_file, save_file

    weights = load_file(tiny_tied / "model.safetensors")
    copy = weights["model.embed_tokens.weight"].clone()
    for name, value in [("with-copy", copy), ("with-other", copy[:, :8].contiguous())]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_bytes((tiny_tied / "config.json").read_bytes())
        save_file({**weights, "lm_head.weight": value}, tmp_path / name / "model.safetensors")
    plan = resolve_plan(tmp_path / "with-copy", 2)
    assert not plan.errors
    assert plan.tensor("lm_head.weight").checkpoint_keys == ["model.embed_tokens.weight"]
    (warning,) = [w for w in plan.warnings if w.code == "tied_copy_unread"]
    assert warning.message.startswith("lm_head.weight: tied to model.embed_tokens.weight")
    (error,) = resolve_plan(tmp_path / "with-other", 2).errors
    assert error.code == "shape_mismatch"  # not "in the checkpoint but not in the model"
    assert error.message.startswith("lm_head.weight (")
    assert "is [1000, 8], but it is tied to model.embed_tokens.weight" in error.message


def test_tied_weights_with_conflicting_styles_are_an_error(tiny_tied):
    plan = resolve_plan(tiny_tied, 2, {"embed_tokens": "embedding_rowwise", "lm_head": "rowwise"})
    assert [e.code for e in plan.errors] == ["tied_mismatch"]


def test_heads_that_a_world_size_would_cut_list_the_sizes_that_work(tiny):
    plan = resolve_plan(tiny, 3)  # 8 heads, 4 kv heads
    messages = [e.message for e in plan.errors if e.code == "head_alignment"]
    assert len(messages) == 2
    assert all("world sizes that work: 1, 2, 4" in m for m in messages)
    assert any("key-value heads" in m for m in messages)


class _OddAttention(nn.Module):
    """Names no suffix list knows: a fused qkv interleaved per head, and its output."""

    def __init__(self):
        super().__init__()
        self.head_dim = 16
        self.wqkv = nn.Linear(96, 3 * 96)  # 6 heads of [q; k; v]
        self.wo = nn.Linear(96, 96)


class _OddModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = {"num_attention_heads": 6, "hidden_size": 96}
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"mix": _OddAttention(), "ff": nn.Linear(96, 100)}) for _ in range(2)
        )


def test_heads_are_found_from_the_structure_whatever_the_names():
    with torch.device("meta"):
        model = _OddModel()
    plan = {"blocks.*.mix.wqkv": "colwise", "blocks.*.mix.wo": "rowwise", "blocks.*.ff": "colwise"}
    assert not resolve_plan(model, 3, plan).errors  # 2 heads a rank; ff's 100 splits unevenly
    (error,) = resolve_plan(model, 4, plan).errors
    assert (error.code, error.name) == ("head_alignment", "blocks.0.mix.wqkv")
    assert "48 features a head" in error.message
    assert "world sizes that work: 1, 2, 3, 6" in error.message


def test_gathered_styles_need_no_head_alignment(tiny):
    plan = resolve_plan(
        tiny,
        3,
        {
            "layers.*.self_attn.q_proj": "colwise_gather_output",
            "layers.*.self_attn.k_proj": "colwise_gather_output",
            "layers.*.self_attn.v_proj": "colwise_gather_output",
            "layers.*.self_attn.o_proj": "rowwise_split_input",
        },
    )
    assert not plan.errors


def test_uneven_legal_split_is_allowed_and_shown_per_rank(tmp_path):
    source = write_config(
        tmp_path / "c",
        **{
            **LLAMA_70B,
            "num_hidden_layers": 2,
            "vocab_size": 32001,
            "hidden_size": 768,
            "intermediate_size": 2048,
            "num_attention_heads": 6,
            "num_key_value_heads": 3,
        },
    )
    plan = resolve_plan(source, 3)
    assert not plan.errors
    assert [r.shape[0] for r in plan.tensor("lm_head.weight").ranks] == [10667, 10667, 10667]
    assert [r.shape[0] for r in plan.tensor("model.embed_tokens.weight").ranks] == [10667] * 3
    plan4 = resolve_plan(
        write_config(tmp_path / "d", **{**LLAMA_70B, "num_hidden_layers": 1, "vocab_size": 32001}),
        8,
    )
    assert [r.shape[0] for r in plan4.tensor("lm_head.weight").ranks] == [4001] * 7 + [3994]


@pytest.fixture
def edited(tmp_path, tiny):
    """A copy of the tiny checkpoint whose config.json the test may change."""
    out = tmp_path / "edited"
    shutil.copytree(tiny, out)

    def edit(**changes):
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, **changes}))
        return out

    return edit


def test_tensor_missing_from_the_checkpoint_is_an_error(edited):
    plan = resolve_plan(edited(num_hidden_layers=3), 2)
    missing = [e for e in plan.errors if e.code == "missing_tensor"]
    assert missing and all("model.layers.2." in e.name for e in missing)
    assert "checkpoint" in missing[0].message


def test_tensor_in_the_checkpoint_but_not_the_model_is_an_error(edited):
    plan = resolve_plan(edited(num_hidden_layers=1), 2)
    unexpected = {e.name for e in plan.errors if e.code == "unexpected_tensor"}
    assert "model.layers.1.mlp.up_proj.weight" in unexpected
    assert all(".safetensors" in e.message for e in plan.errors if e.code == "unexpected_tensor")


def test_shapes_that_differ_are_an_error(edited):
    plan = resolve_plan(edited(vocab_size=1002), 2)
    errors = {e.name: e for e in plan.errors if e.code == "shape_mismatch"}
    assert set(errors) == {"model.embed_tokens.weight", "lm_head.weight"}
    assert "[1002, 128]" in errors["lm_head.weight"].message


def test_config_only_source_plans_without_weights(config_only):
    plan = resolve_plan(config_only, 2)
    assert not plan.errors and not plan.has_weights
    assert plan.tensor("model.norm.weight").source_dtype is None


def test_dtype_override_halves_the_bytes_but_not_computed_buffers(tiny):
    f32 = resolve_plan(tiny, 2)
    bf16 = resolve_plan(tiny, 2, dtype="bfloat16")
    name = "model.layers.0.mlp.up_proj.weight"
    assert bf16.tensor(name).ranks[0].bytes * 2 == f32.tensor(name).ranks[0].bytes
    assert bf16.tensor(name).source_dtype == "float32"
    assert bf16.tensor("model.rotary_emb.inv_freq").dtype == "float32"


def test_json_round_trip(uneven3):
    plan = resolve_plan(uneven3, 3)
    text = plan.to_json()
    again = ResolvedPlan.from_json(text)
    assert again.to_json() == text
    assert again.tensor("lm_head.weight").ranks[2].blocks[0].offset == [668, 0]
    data = json.loads(text)
    for key in (
        "world_size",
        "dtype",
        "source",
        "params",
        "per_rank_bytes",
        "total_bytes",
        "forecast",
        "warnings",
        "errors",
    ):
        assert key in data
    entry = data["params"][0]
    for key in (
        "name",
        "module",
        "style",
        "style_given",
        "placement",
        "global_shape",
        "dtype",
        "tied_to",
        "ranks",
    ):
        assert key in entry
    assert set(entry["ranks"][0]) == {"rank", "shape", "bytes", "blocks"}


def test_forecast_shapes_of_the_strategies(tiny):
    plan = resolve_plan(tiny, 2, dtype="bfloat16")
    sliced, rank0, replicated = (forecast(plan, s) for s in styles_strategies())
    shard = plan.per_rank_bytes
    largest_slice = max(
        t.source_nbytes(b.shape[0] * (b.shape[1] if len(b.shape) > 1 else 1))
        for t in plan.params
        for b in t.ranks[0].blocks
    )
    assert shard[0] < sliced.peak_bytes[0] <= shard[0] + largest_slice
    assert rank0.peak_bytes[0] > rank0.peak_bytes[1] == shard[1]
    assert replicated.peak_bytes[0] >= sum(
        t.source_nbytes() for t in plan.params if t.origin == "checkpoint"
    )
    assert rank0.sent_bytes[0] == rank0.received_bytes[1] > 0
    assert sliced.sent_bytes == replicated.sent_bytes == [0, 0]


def styles_strategies():
    return ("sliced", "rank0_broadcast", "replicated")


def test_70b_plan_at_world_size_8_adds_up(tmp_path):
    plan = resolve_plan(write_config(tmp_path / "llama70b", **LLAMA_70B), 8)
    assert not plan.errors
    assert len(plan.params) == 80 * 9 + 4
    replicated = sum(t.nbytes for t in plan.params if t.placement == "replicate")
    assert sum(plan.per_rank_bytes) == plan.total_bytes + 7 * replicated
    for r in range(8):
        assert plan.per_rank_bytes[r] == sum(t.ranks[r].bytes for t in plan.params)
    # bf16 weights of a 70.6B-parameter model
    params = sum(t.nbytes for t in plan.params if t.origin == "checkpoint") // 2
    assert 70_000_000_000 < params < 71_000_000_000


def test_style_table_has_every_documented_style():
    for name in (
        "colwise",
        "rowwise",
        "colwise_gather_output",
        "rowwise_split_input",
        "embedding_rowwise",
        "packed_colwise",
        "replicated_with_grad_allreduce",
        "replicate",
    ):
        assert styles.canonical(name).name == name
    with pytest.raises(styles.UnknownStyle):
        styles.canonical("nope")


@pytest.mark.parametrize(
    "changes, refusal",
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                           "original_max_position_embeddings": 8192}},
         "rope type 'yarn' (it computes default, linear, llama3) is not implemented"),
        ({"hidden_act": "gelu"},
         "hidden_act 'gelu' (its MLP is SwiGLU, with silu) is not implemented"),
    ],
    ids=["rope-yarn", "gelu-mlp"],
)  # fmt: skip
def test_a_llama_setting_the_builtin_llama_lacks_is_planned_with_transformers(
    tmp_path, changes, refusal
):
    """The built-in Llama would load the same tensors and compute other logits: `auto` gives
    such a config to transformers, and asking for the built-in is refused while planning."""
    source = write_config(tmp_path / "other", **{**LLAMA_70B, "num_hidden_layers": 1, **changes})
    with pytest.raises(ValueError, match=f"config.json: {re.escape(refusal)}.* use --model hf"):
        resolve_plan(source, 8, model="builtin")
    pytest.importorskip("transformers")
    assert resolve_plan(source, 8).model == "hf"  # what `auto` picks for it
    assert resolve_plan(write_config(tmp_path / "llama3", **LLAMA_70B), 8).model == "builtin"
    swish = write_config(tmp_path / "swish", **{**LLAMA_70B, "hidden_act": "swish"})
    assert resolve_plan(swish, 8).model == "builtin"  # transformers' other name for SiLU


def test_a_resolved_plan_refuses_arguments_it_contradicts(tiny, tiny_tied):
    """A ResolvedPlan is executed as it is: another source, dtype, model, world size or expert
    layout than its own is refused, not silently replaced by the plan's."""
    plan = resolve_plan(tiny, 2)
    assert resolve_plan(tiny, 2, plan, dtype="float32", model="auto") is plan
    assert resolve_plan(str(tiny), 2, plan, dtype=torch.float32, model="builtin") is plan
    for kwargs, what in [
        ({"source": tiny_tied}, "source"),
        ({"dtype": "bfloat16"}, "dtype float32, not bfloat16"),
        ({"model": "hf"}, "model builtin, not hf"),
        ({"world_size": 4}, "world size 2, not 4"),
        ({"experts": "ep"}, "experts tp, not ep"),
    ]:
        args = {"source": tiny, "world_size": 2, **kwargs}
        with pytest.raises(ValueError, match=f"resolved for {what}"):
            resolve_plan(args.pop("source"), args.pop("world_size"), plan, **args)
    with pytest.raises(ValueError, match="resolved for source"):
        tpviz.launch(tiny_tied, 2, plan)  # refused before any rank starts


@pytest.mark.parametrize("style", ["moe_tp_experts", "ep_dispatch_experts"])
def test_an_experts_style_on_a_module_without_stacked_experts_is_an_error(tiny, style):
    """An experts module's style all-reduces its output: on a Linear the logits would be
    wrong, so the plan is refused before launch."""
    plan = resolve_plan(tiny, 2, {"layers.*.self_attn.q_proj": style})
    assert {e.code for e in plan.errors} == {"unsupported_style"}
    assert "applies to an experts module" in plan.errors[0].message
    assert "this module is Linear" in plan.errors[0].message


def test_integer_values_for_a_floating_point_tensor_are_an_error(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    weights = {k: v for f in tiny.glob("*.safetensors") for k, v in load_file(f).items()}
    weights["model.norm.weight"] = weights["model.norm.weight"].to(torch.int32)
    (tmp_path / "config.json").write_bytes((tiny / "config.json").read_bytes())
    save_file(weights, tmp_path / "model.safetensors")
    plan = resolve_plan(tmp_path, 2)
    assert [(e.code, e.name) for e in plan.errors] == [("dtype_mismatch", "model.norm.weight")]
    assert "tensor 'model.norm.weight' is int32, but model.norm.weight is float32" in (
        plan.errors[0].message
    )


def test_the_builtin_llama_reads_checkpoints_as_transformers_llama_does(tiny, tmp_path):
    """Older checkpoints hold each layer's rotary `inv_freq` (dropped, as transformers drops
    them); a checkpoint saved from the base model has no `model.` prefix (added back). A key
    neither explains is still an error."""
    from safetensors.torch import load_file, save_file

    weights = {k: v for f in tiny.glob("*.safetensors") for k, v in load_file(f).items()}
    config = (tiny / "config.json").read_bytes()
    old = {**weights, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    base = {k.removeprefix("model."): v for k, v in weights.items()}
    stray = {**weights, "model.layers.0.self_attn.extra.weight": torch.ones(8)}
    for name, tensors in [("old", old), ("base", base), ("stray", stray)]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_bytes(config)
        save_file(tensors, tmp_path / name / "model.safetensors")
    assert not resolve_plan(tmp_path / "old", 2).errors
    plan = resolve_plan(tmp_path / "base", 2)
    assert not plan.errors
    q = plan.tensor("model.layers.1.self_attn.q_proj.weight")
    assert q.checkpoint_keys == ["layers.1.self_attn.q_proj.weight"]
    assert plan.tensor("lm_head.weight").checkpoint_keys == ["lm_head.weight"]
    errors = resolve_plan(tmp_path / "stray", 2).errors
    assert [(e.code, e.name) for e in errors] == [
        ("unexpected_tensor", "model.layers.0.self_attn.extra.weight")
    ]


def test_transformers_unit_styles_are_the_head_keeping_cuts_tpviz_makes(tiny):
    """transformers 5's unit_colwise / unit_rowwise keep heads whole, replicating them when
    ranks outnumber them: colwise / rowwise here, whose cuts by head do the same."""
    unit = {
        "layers.*.self_attn.k_proj": "unit_colwise",
        "layers.*.self_attn.o_proj": "unit_rowwise",
    }
    plain = {"layers.*.self_attn.k_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}
    for world_size in (2, 8):  # 4 key-value heads: replicated over pairs of ranks at 8
        a, b = resolve_plan(tiny, world_size, unit), resolve_plan(tiny, world_size, plain)
        assert not a.errors and a.local_kv_groups == b.local_kv_groups
        held = [[(t.name, t.style, t.placement, t.ranks) for t in p.params] for p in (a, b)]
        assert held[0] == held[1]
