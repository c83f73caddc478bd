"""Demo checkpoints: deterministic, in Hugging Face layout, and loadable by transformers."""

from __future__ import annotations

import hashlib
import json
import math
import os

import pytest
import torch

from tpviz.checkpoint import Checkpoint, dtype_name
from tpviz.models import BuiltinLlama, build_skeleton
from tpviz.models.demo import PRESETS, demo_config, make_checkpoint
from tpviz.plan import resolve_plan
from tpviz.runtime.reference import FullModel


def _digest(directory) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(directory.iterdir())}


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    a = make_checkpoint(tmp_path / "a", "tiny", seed=7)
    b = make_checkpoint(tmp_path / "b", "tiny", seed=7)
    c = make_checkpoint(tmp_path / "c", "tiny", seed=8)
    assert _digest(a) == _digest(b)
    assert _digest(a)["model.safetensors"] != _digest(c)["model.safetensors"]


def test_config_has_the_transformers_llama_fields(tiny):
    config = json.loads((tiny / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "rms_norm_eps",
        "rope_theta",
        "tie_word_embeddings",
        "torch_dtype",
    ):
        assert key in config


def test_sharded_into_files_with_an_index_over_the_shard_size(tiny, tmp_path):
    files = sorted(p.name for p in tiny.glob("*.safetensors"))
    assert len(files) > 1 and all(f.startswith("model-0000") for f in files)
    index = json.loads((tiny / "model.safetensors.index.json").read_text())
    ckpt = Checkpoint.open(tiny)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in ckpt.tensors.values())
    single = make_checkpoint(tmp_path / "single", "tiny")
    assert [p.name for p in single.glob("*.safetensors")] == ["model.safetensors"]


def test_dimension_overrides_and_dtype(tmp_path):
    out = make_checkpoint(
        tmp_path / "x",
        "tiny",
        dtype="bfloat16",
        layers=3,
        hidden=64,
        heads=4,
        kv_heads=2,
        vocab=300,
        intermediate=96,
    )
    ckpt = Checkpoint.open(out)
    assert ckpt.tensors["model.embed_tokens.weight"].shape == (300, 64)
    assert ckpt.tensors["model.layers.2.mlp.up_proj.weight"].shape == (96, 64)
    assert ckpt.tensors["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)
    assert {t.dtype for t in ckpt.tensors.values()} == {"bfloat16"}
    with pytest.raises(ValueError, match="multiple"):
        make_checkpoint(tmp_path / "y", "tiny", heads=5)


def test_tied_checkpoint_stores_the_embedding_once(tiny_tied):
    names = set(Checkpoint.open(tiny_tied).tensors)
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names


@pytest.mark.parametrize(
    "preset, low, high", [("tiny", 1e6, 5e6), ("small", 100e6, 200e6), ("medium", 0.5e9, 1e9)]
)
def test_preset_sizes(preset, low, high):
    model = build_skeleton(BuiltinLlama(), demo_config(preset), torch.float32)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    assert low <= nbytes <= high, f"{preset}: {nbytes / 1e6:.0f} MB"
    assert PRESETS[preset]["heads"] % 4 == 0


def _reference_logits(source, ids):
    plan = resolve_plan(source, 1)
    from tpviz.models import get_adapter, read_config

    config = read_config(source)
    ref = FullModel(plan, get_adapter(config), config)
    ref.load_checkpoint(Checkpoint.open(source))
    with torch.no_grad():
        return ref.model(ids)


@pytest.mark.parametrize("which", ["tiny", "tiny_tied"])
def test_transformers_loads_it_and_gives_the_same_logits(which, request):
    transformers = pytest.importorskip("transformers")
    source = request.getfixturevalue(which)
    ids = torch.tensor([[1, 5, 42, 7, 99, 3, 250, 17]])
    hf = transformers.LlamaForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(ids).logits
    ours = _reference_logits(source, ids)
    assert ours.shape == expected.shape
    assert (ours - expected).abs().max().item() <= 1e-5
    assert dtype_name(next(hf.parameters()).dtype) == "float32"
    assert math.isfinite(ours.abs().max().item())


def test_a_checkpoint_too_large_for_memory_or_disk_is_refused_before_anything_is_made(
    tmp_path, cli
):
    out = tmp_path / "nested" / "big"
    done = cli("make-checkpoint", str(out), "--hidden", "1000000")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "the checkpoint would take" in done.stderr and "choose smaller dimensions" in done.stderr
    assert not (tmp_path / "nested").exists()
    (tmp_path / "file").touch()
    done = cli("make-checkpoint", str(tmp_path / "file"))
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0
    assert "file is a file; give a directory to write the checkpoint into" in done.stderr
    config_only = tmp_path / "config-only"  # a plan's source: never written over
    config_only.mkdir()
    (config_only / "config.json").write_text('{"model_type": "mine"}')
    done = cli("make-checkpoint", str(config_only))
    assert done.returncode == 2 and "config-only is not empty; choose a new or empty" in done.stderr
    assert os.listdir(config_only) == ["config.json"]
    assert (config_only / "config.json").read_text() == '{"model_type": "mine"}'
    done = cli("make-checkpoint", "")
    assert done.returncode == 2 and "the path is empty" in done.stderr
    done = cli("make-checkpoint", "/proc/tpviz-checkpoint")
    assert done.returncode == 2 and "cannot make /proc/tpviz-checkpoint (" in done.stderr


def test_a_demo_cache_that_is_a_file_or_has_lost_its_weights_is_named(tmp_path, tiny, cli):
    (tmp_path / "file").touch()
    done = cli("demo", "--preset", "tiny", env={"TPVIZ_CACHE": str(tmp_path / "file")})
    assert done.returncode == 2 and "is not a directory; set TPVIZ_CACHE" in done.stderr
    below = tmp_path / "file" / "cache"  # as under a $HOME that is a file
    done = cli("demo", "--preset", "tiny", env={"TPVIZ_CACHE": str(below)})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]  # after the line saying it is making one
    assert f"cannot make the demo cache {below} (Not a directory); set TPVIZ_CACHE" in last
    (tmp_path / "cache" / "demo-tiny").mkdir(parents=True)
    (tmp_path / "cache" / "demo-tiny" / "config.json").write_bytes(
        (tiny / "config.json").read_bytes()
    )
    done = cli("demo", "--preset", "tiny", env={"TPVIZ_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 2 and "has lost its weights; remove it" in done.stderr


def test_a_world_size_below_one_is_refused_before_the_demo_checkpoint_is_made(tmp_path, cli):
    for value in ("0", "-2", "two"):
        done = cli("demo", "--world-size", value, env={"TPVIZ_CACHE": str(tmp_path / "cache")})
        assert done.returncode == 2 and f"must be a positive integer, not '{value}'" in done.stderr
        # one line, as every refusal: the usage is where --help says, not printed first
        assert done.stderr.strip().count("\n") == 0 and "(see tpviz demo --help)" in done.stderr
    assert not (tmp_path / "cache").exists()
