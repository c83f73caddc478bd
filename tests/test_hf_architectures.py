"""Dense transformers architectures beyond tests/test_hf.py, each built with transformers' own
config and model classes, saved with `save_pretrained` into several files, loaded by tpviz
with the plan transformers computes and compared with transformers' own single-process logits.

One job per case (a spawn costs seconds); the plan checks run in-process.
"""

from __future__ import annotations

import json

import pytest
import torch

import tpviz
from tpviz import cli
from tpviz.models import FIXED_PROMPT

from .hf_tiny import TINY_DIMS, VISION, gemma4_with_vision, save_tiny, tiny_text

transformers = pytest.importorskip("transformers")

DIMS = dict(TINY_DIMS, pad_token_id=0)

# name -> (model_type, changes to DIMS; None drops a key)
ARCHS: dict[str, tuple[str, dict]] = {
    "gemma2": ("gemma2", dict(head_dim=16)),
    "gemma3_text": ("gemma3_text", dict(head_dim=16)),
    "cohere": ("cohere", {}),
    "cohere_qk_norm": ("cohere", dict(use_qk_norm=True)),  # q/k norms shaped heads x head_dim
    "cohere2": ("cohere2", {}),
    "starcoder2": ("starcoder2", {}),
    "stablelm": ("stablelm", {}),
    "olmo": ("olmo", {}),
    "olmo3": ("olmo3", {}),
    "glm": ("glm", {}),
    "glm4": ("glm4", {}),
    "helium": ("helium", dict(head_dim=16)),
    "smollm3": ("smollm3", {}),
    "exaone4": ("exaone4", {}),
    "arcee": ("arcee", {}),
    "apertus": ("apertus", {}),
    "seed_oss": ("seed_oss", dict(head_dim=16)),
    "ernie4_5": ("ernie4_5", dict(head_dim=16)),
    "hunyuan_v1_dense": (
        "hunyuan_v1_dense",
        dict(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    ),
    "gpt_neox": ("gpt_neox", dict(num_key_value_heads=None)),  # fused, interleaved qkv
    "falcon": ("falcon", {}),
    "phi": ("phi", {}),
    "nemotron": ("nemotron", {}),
    "bitnet": ("bitnet", {}),
    # head_dim set per layer: the full-attention layers' heads are twice as wide
    "gemma4_text": ("gemma4_text", dict(vocab_size_per_layer_input=1003)),
    # buffers made in the default dtype: a sinusoid table, a causal mask
    "xglm": ("xglm", {}),
    "openai_gpt": ("openai-gpt", {}),
    # 6 heads / 3 kv heads over 3 ranks; the MLP (256) and the vocabulary (1003) split unevenly
    "starcoder2_uneven": (
        "starcoder2",
        dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3),
    ),
}
# (name, world size, dtype); bfloat16 against transformers in bfloat16
ONLY_NAMED = ("starcoder2_uneven", "xglm", "openai_gpt")  # in CASES only as named there
CASES = [(name, 2, "float32") for name in ARCHS if name not in ONLY_NAMED] + [
    ("gemma2", 2, "bfloat16"),
    ("xglm", 2, "bfloat16"),
    ("openai_gpt", 2, "bfloat16"),
    ("cohere_qk_norm", 2, "bfloat16"),
    ("glm", 2, "bfloat16"),
    ("cohere_qk_norm", 4, "float32"),
    ("starcoder2_uneven", 3, "float32"),
]
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}


def make_config(name: str):
    model_type, changes = ARCHS[name]
    merged = {**DIMS, **changes}
    return transformers.AutoConfig.for_model(
        model_type, **{k: v for k, v in merged.items() if v is not None}
    )


@pytest.fixture(scope="session")
def arch_checkpoint(tmp_path_factory):
    """name -> checkpoint dir, each built once per session on first use."""
    root = tmp_path_factory.mktemp("hf-archs")
    built: dict[str, object] = {}

    def get(name: str):
        if name not in built:
            seed = sorted(ARCHS).index(name)
            built[name] = save_tiny(make_config(name), root / name, seed)
        return built[name]

    return get


def transformers_logits(source, dtype: str) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        source, dtype=getattr(torch, dtype)
    ).eval()
    with torch.no_grad():
        return model(torch.tensor(FIXED_PROMPT) % 1003).logits.float()


@pytest.mark.slow
@pytest.mark.parametrize("name, world_size, dtype", CASES)
def test_logits_match_transformers(arch_checkpoint, name, world_size, dtype):
    source = arch_checkpoint(name)
    assert len(list(source.glob("*.safetensors"))) > 1
    expected = transformers_logits(source, dtype)
    with tpviz.launch(source, world_size, dtype=dtype, verify=False) as job:
        result = job.wait(180)
        logits = job.forward(torch.tensor(FIXED_PROMPT) % 1003)
    assert result["plan_matches_shards"]
    assert (logits.float() - expected).abs().max().item() <= TOLERANCE[dtype]


def test_computed_buffers_take_the_dtype_transformers_builds_them_in(arch_checkpoint):
    """A buffer the model's code makes in the default dtype (XGLM's sinusoid table, GPT's
    causal mask) is made in the target dtype, as transformers builds under it: float32 beside
    bfloat16 weights, it would make the hidden states float32 and the next bfloat16 layer
    fail. One the code makes float32 itself (rotary frequencies) stays float32."""
    xglm = arch_checkpoint("xglm")
    table = "model.embed_positions.weights"
    assert tpviz.resolve_plan(xglm, 2, dtype="bfloat16").tensor(table).dtype == "bfloat16"
    assert tpviz.resolve_plan(xglm, 2).tensor(table).dtype == "float32"
    gpt = tpviz.resolve_plan(arch_checkpoint("openai_gpt"), 2, dtype="bfloat16")
    assert gpt.tensor("transformer.h.0.attn.bias").dtype == "bfloat16"
    gemma = tpviz.resolve_plan(arch_checkpoint("gemma2"), 2, dtype="bfloat16")
    assert gemma.tensor("model.rotary_emb.inv_freq").dtype == "float32"


def test_gpt_neox_fused_qkv_at_world_size_3_names_the_module(arch_checkpoint, capsys):
    source = str(arch_checkpoint("gpt_neox"))  # 8 heads, qkv interleaved per head
    assert cli.main(["plan", source, "--world-size", "3", "--json"]) == 2
    (error,) = json.loads(capsys.readouterr().out)["errors"]
    assert error["code"] == "head_alignment"
    assert error["name"] == "gpt_neox.layers.0.attention.query_key_value"
    assert "world sizes that work: 1, 2, 4, 8" in error["message"]
    for world_size in (2, 4, 8):
        assert not tpviz.resolve_plan(source, world_size).errors


def test_per_head_norms_are_sharded_with_their_heads(arch_checkpoint):
    plan = tpviz.resolve_plan(arch_checkpoint("cohere_qk_norm"), 4)
    assert not plan.errors
    q_norm = plan.tensor("model.layers.1.self_attn.q_norm.weight")  # 8 heads x 16
    k_norm = plan.tensor("model.layers.1.self_attn.k_norm.weight")  # 4 kv heads x 16
    assert (q_norm.style, q_norm.placement) == ("colwise", "shard(0)")
    assert [r.shape for r in q_norm.ranks] == [[2, 16]] * 4
    assert [r.shape for r in k_norm.ranks] == [[1, 16]] * 4
    assert plan.module_styles["model.layers.1.self_attn.q_norm"] == "local_params"
    (warning,) = [w for w in plan.warnings if w.name.endswith("layers.0.self_attn.q_norm.weight")]
    assert warning.code == "sharded_by_head" and "layers.*.self_attn.q_norm" in warning.message
    # heads kept whole by the plan leave the norm whole too
    gathered = {
        k: {"colwise": "colwise_gather_output", "rowwise": "rowwise_split_input"}[v]
        if ".self_attn." in k
        else v
        for k, v in plan.patterns.items()
    }
    whole = tpviz.resolve_plan(arch_checkpoint("cohere_qk_norm"), 4, gathered)
    assert whole.tensor("model.layers.1.self_attn.q_norm.weight").placement == "replicate"
    assert not whole.errors and not whole.warnings


def test_attention_sinks_left_whole_by_a_plan_are_sharded_by_head(tmp_path):
    transformers.GraniteSWAConfig(**DIMS).save_pretrained(tmp_path)
    patterns = tpviz.resolve_plan(tmp_path, 2).patterns
    mine = {k: v for k, v in patterns.items() if not k.endswith(("sinks", "self_attn"))}
    plan = tpviz.resolve_plan(tmp_path, 2, mine)
    sinks = plan.tensor("model.layers.0.self_attn.sinks")
    assert (sinks.placement, [r.shape for r in sinks.ranks]) == ("shard(0)", [[4], [4]])
    assert {w.code for w in plan.warnings} == {"sharded_by_head"}


@pytest.mark.parametrize("o_proj", ["rowwise", None])
def test_a_norm_spanning_all_heads_of_a_cut_projection_is_refused(tmp_path, capsys, o_proj):
    # OLMo-2 normalises q and k over all heads at once; transformers' plan gathers them, a
    # plan that keeps them sharded by head cannot run. A whole o_proj puts out as many
    # features as q_norm holds, yet takes the heads in: q_norm is not taken for its norm
    transformers.AutoConfig.for_model("olmo2", **DIMS).save_pretrained(tmp_path / "olmo2")
    plan = {f"layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"}
    if o_proj:
        plan["layers.*.self_attn.o_proj"] = o_proj
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    argv = ["plan", str(tmp_path / "olmo2"), "--plan", str(tmp_path / "plan.json"), "--json"]
    assert cli.main(argv) == 2
    errors = json.loads(capsys.readouterr().out)["errors"]
    assert {e["code"] for e in errors} == {"head_parameter"}
    assert errors[0]["name"] == "model.layers.0.self_attn.q_norm"
    assert "colwise_gather_output" in errors[0]["message"]


# DeepSeek-style latent attention (8 heads of 16 + 8 features, values of 16), 4 routed experts
LATENT = dict(
    num_key_value_heads=8,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
)


def latent_config(model_type: str, **changes):
    return transformers.AutoConfig.for_model(model_type, **{**DIMS, **LATENT, **changes})


def test_a_latent_norm_as_wide_as_all_heads_is_not_taken_for_theirs(tmp_path):
    # DeepSeek-V3's q_a_layernorm normalises q_a_proj's latent (q_lora_rank) before q_b_proj;
    # here that latent is as wide as q_b_proj's 8 heads x 24 features, which once read as a norm
    # spanning all heads and refused transformers' own plan
    latent_config("deepseek_v3", q_lora_rank=192).save_pretrained(tmp_path)
    plan = tpviz.resolve_plan(tmp_path, 2)
    assert not plan.errors
    assert plan.tensor("model.layers.0.self_attn.q_a_layernorm.weight").placement == "replicate"
    assert tpviz.simulate_plan(plan).ok


def test_head_sizes_set_per_layer_are_read_from_each_layers_attention(tmp_path):
    # Gemma-4's config sets head_dim per layer (its full-attention layers' heads are wider);
    # transformers refuses a global read of it, so each attention module's own head_dim counts
    make_config("gemma4_text").save_pretrained(tmp_path)
    plan = tpviz.resolve_plan(tmp_path, 4)
    assert not plan.errors
    widths = [
        plan.tensor(f"model.layers.{i}.self_attn.q_proj.weight").global_shape[0] for i in (0, 1)
    ]
    assert widths == [8 * 256, 8 * 512]
    assert tpviz.simulate_plan(plan).ok
    errors = tpviz.resolve_plan(tmp_path, 16).errors  # query and key-value heads
    assert [e.name.rsplit(".", 1)[1] for e in errors] == ["q_proj", "k_proj"]
    for error in errors:
        assert error.code == "head_alignment"
        assert "world sizes that work: 1, 2, 4, 8" in error.message
    # 8 ranks, 4 key-value heads: each held whole by the 2 ranks whose query heads use it (the
    # config's hidden / heads, 16, once passed for a head size and cut them in halves)
    plan = tpviz.resolve_plan(tmp_path, 8)
    assert not plan.errors and len(plan.local_kv_groups) == 2
    k_proj = plan.tensor("model.layers.1.self_attn.k_proj.weight")  # 4 heads of 512
    assert [r.blocks[0].offset[0] for r in k_proj.ranks] == [0, 0, 512, 512, 1024, 1024, 1536, 1536]
    assert {r.shape[0] for r in k_proj.ranks} == {512}
    assert tpviz.simulate_plan(plan).ok


def test_a_value_head_wider_than_the_query_head_is_cut_as_a_key_value_head(tmp_path):
    """MiMo-V2-Flash's value heads (64 wide here) are wider than its query and key heads (16):
    a full-attention layer's v_proj, 4 key-value heads x 64, holds as many features as 8 query
    heads of 32 would, a width no head has. It is cut into its key-value heads, each held by
    the ranks sharing it, and simulated ranks match the whole model."""
    config = transformers.AutoConfig.for_model("mimo_v2_flash", **DIMS, head_dim=16, v_head_dim=64)
    config.save_pretrained(tmp_path)
    plan = tpviz.resolve_plan(tmp_path, 8)
    assert plan.tensor("model.layers.0.self_attn.v_proj.weight").placement == "shard(0, groups=4)"
    assert tpviz.simulate_plan(plan).ok


def test_heads_are_checked_in_an_attention_that_holds_another(tmp_path):
    # DeepSeek-V3.2's attention holds an indexer with heads of its own (index_head_dim): the
    # outer attention's projections were once left unchecked, and 3 ranks cut its 8 heads
    config = latent_config("deepseek_v32", q_lora_rank=32, index_n_heads=4, index_head_dim=32)
    config.save_pretrained(tmp_path)
    (error,) = tpviz.resolve_plan(tmp_path, 3).errors
    assert error.code == "head_alignment"
    assert error.name == "model.layers.0.self_attn.q_b_proj"
    assert "world sizes that work: 1, 2, 4, 8" in error.message
    plan = tpviz.resolve_plan(tmp_path, 2)
    assert not plan.errors and tpviz.simulate_plan(plan).ok


@pytest.mark.slow
def test_a_plan_whose_weight_the_model_reads_outside_its_module_fails_then_the_suggestion_loads(
    tmp_path,
):
    source = save_tiny(gemma4_with_vision(), tmp_path / "gemma4", seed=0)
    expected = transformers_logits(source, "float32")
    prompt = torch.tensor(FIXED_PROMPT) % 1003
    with tpviz.launch(source, 2, verify=False) as first:  # transformers' plan cuts the embedding
        first.wait(180)
        with pytest.raises(tpviz.LoadError, match="forward failed in model: .*DTensor") as failed:
            first.forward(prompt)
        assert "`tpviz plan --simulate` names it" in str(failed.value)
        suggested = tpviz.suggest_plan(source, 2).plan
        with first.reload(plan=suggested) as job:  # the same ranks: their group survived
            result = job.wait(180)
            logits = job.forward(prompt)
    assert result["plan_matches_shards"]
    assert (logits - expected).abs().max().item() <= TOLERANCE["float32"]


def save_llava_in_its_older_layout(path):
    """A tiny LLaVA (a multimodal LM; no causal-LM class) saved with the keys LLaVA
    checkpoints made before transformers 5 have (`language_model.model.*`,
    `language_model.lm_head.*`, `vision_tower.*`), which transformers renames when it loads."""
    from safetensors.torch import save_file

    llama = tiny_text(model_type="llama")
    config = transformers.LlavaConfig(text_config=llama, vision_config=VISION)
    torch.manual_seed(3)
    model = transformers.AutoModelForMultimodalLM.from_config(config)
    older = {
        "model.language_model.": "language_model.model.",
        "lm_head.": "language_model.lm_head.",
    }
    state = {}
    for name, tensor in model.state_dict().items():
        prefix = next((p for p in older if name.startswith(p)), None)
        state[older[prefix] + name[len(prefix) :] if prefix else name.removeprefix("model.")] = (
            tensor.contiguous()
        )
    path.mkdir()
    config.save_pretrained(path)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


def multimodal_logits(source) -> torch.Tensor:
    model = transformers.AutoModelForMultimodalLM.from_pretrained(source).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor(FIXED_PROMPT) % 1003).logits


@pytest.mark.slow
def test_multimodal_lms_load_as_transformers_reads_them(tmp_path):
    llava = save_llava_in_its_older_layout(tmp_path / "llava")
    plan = tpviz.resolve_plan(llava, 2)
    assert not plan.errors
    q_proj = plan.tensor("model.language_model.layers.0.self_attn.q_proj.weight")
    assert q_proj.placement != "replicate"
    assert q_proj.checkpoint_keys == ["language_model.model.layers.0.self_attn.q_proj.weight"]
    # PaliGemma's own _init_weights leaves its Gemma embedding's computed scale unset: the
    # language model's sets it, as transformers dispatches a composite model's init
    gemma = tiny_text(model_type="gemma")
    config = transformers.PaliGemmaConfig(text_config=gemma, vision_config=VISION)
    paligemma = save_tiny(config, tmp_path / "paligemma", 4, "AutoModelForMultimodalLM")
    # an audio LM: Voxtral, a Whisper-like encoder before a Llama
    audio = dict(VISION, vocab_size=1003)
    llama = tiny_text(model_type="llama")
    config = transformers.VoxtralConfig(text_config=llama, audio_config=audio)
    voxtral = save_tiny(config, tmp_path / "voxtral", 5, "AutoModelForMultimodalLM")
    prompt = torch.tensor(FIXED_PROMPT) % 1003
    loaded = []
    with tpviz.launch(llava, 2, verify=False) as first:
        loaded.append((first.wait(180), first.forward(prompt), llava))
        with first.reload(source=paligemma) as second:
            loaded.append((second.wait(180), second.forward(prompt), paligemma))
            with second.reload(source=voxtral) as job:
                loaded.append((job.wait(180), job.forward(prompt), voxtral))
    for result, logits, source in loaded:
        assert result["plan_matches_shards"]
        assert (logits - multimodal_logits(source)).abs().max().item() <= TOLERANCE["float32"]


def test_a_model_type_transformers_builds_into_no_model_for_token_ids_is_refused(tmp_path, capsys):
    transformers.AutoConfig.for_model("vit", hidden_size=32).save_pretrained(tmp_path)
    assert cli.main(["plan", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "model_type 'vit' neither as a causal LM nor as a multimodal LM" in err
    assert len(err.splitlines()) == 1
