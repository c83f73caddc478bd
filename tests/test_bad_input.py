"""Bad input of every kind is refused before any rank starts: exit 2, one line on stderr that
names the file and the key or tensor, no Python error, and the checkpoint left as it was."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import save_file

from tpviz.checkpoint import Checkpoint, CheckpointError, read_header
from tpviz.cli import main
from tpviz.models.demo import make_checkpoint

from .conftest import run_cli


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    """The tiny preset in one model.safetensors (never modified: tests copy it)."""
    return make_checkpoint(tmp_path_factory.mktemp("bad") / "tiny", "tiny")


@pytest.fixture
def ck(single, tmp_path) -> Path:
    """A private copy of `single` for a test to break."""
    out = tmp_path / "ck"
    shutil.copytree(single, out)
    return out


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _contents(args) -> dict[Path, str]:
    """Digests of the regular files in the directories among `args`."""
    dirs = [Path(a) for a in map(str, args) if os.path.isdir(a)]
    return {f: _digest(f) for d in dirs for f in d.iterdir() if f.is_file()}


def refused(capsys, *args) -> str:
    """Run the CLI in-process; it must exit 2 with one line on stderr and no traceback, and
    leave the files it was pointed at byte-identical."""
    before = _contents(args)
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert code == 2, (code, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert _contents(args) == before
    return err


def rewrite_header(path: Path, change) -> None:
    """Rewrite a real safetensors file's header with `change(header)` (in place)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    change(header)
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + length :])


def _offsets(name: str, begin, end):
    def change(header):
        header[name]["data_offsets"] = [begin, end]

    return change


NORM, FIRST = "model.norm.weight", "model.layers.0.input_layernorm.weight"


def _negative(h):  # the header's own bytes as the tensor: same length, before the data
    n = h[NORM]["data_offsets"][1] - h[NORM]["data_offsets"][0]
    h[NORM]["data_offsets"] = [-n, 0]


def _shared(h):  # two tensors of one shape reading the same bytes
    h[NORM]["data_offsets"] = list(h[FIRST]["data_offsets"])


def _float_offsets(h):
    h[NORM]["data_offsets"] = [float(o) for o in h[NORM]["data_offsets"]]


def _bool_shape(h):
    h[NORM]["shape"] = [True] * 128


@pytest.mark.parametrize(
    "change, tensor",
    [(_negative, NORM), (_shared, NORM), (_float_offsets, NORM), (_bool_shape, NORM)],
)
def test_corrupt_offsets_are_refused_naming_file_and_tensor(ck, capsys, change, tensor):
    path = ck / "model.safetensors"
    rewrite_header(path, change)
    before = _digest(path)
    err = refused(capsys, "plan", ck)
    assert str(path) in err and repr(tensor) in err  # _shared: named on either side
    with pytest.raises(CheckpointError) as e:
        read_header(path)
    assert e.value.file == str(path)
    assert _digest(path) == before


def test_overlapping_tensors_name_the_tensor(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.zeros(4), "b": torch.ones(4), "c": torch.ones(2)}, path)
    rewrite_header(path, _offsets("b", 8, 24))  # overlaps a, leaves 8 bytes before c unread
    with pytest.raises(CheckpointError, match="tensor 'b' .* shares bytes with 'a'") as e:
        read_header(path)
    assert e.value.tensor == "b"


def test_a_gap_between_tensors_is_refused(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.zeros(4), "b": torch.ones(4)}, path)
    with open(path, "ab") as f:
        f.write(b"\0" * 4)
    rewrite_header(path, _offsets("b", 20, 36))  # 4 unread bytes between a and b
    with pytest.raises(CheckpointError, match="leaves a gap") as e:
        read_header(path)
    assert e.value.tensor == "b"


def test_bytes_after_the_last_tensor_are_refused(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.zeros(4)}, path)
    with open(path, "ab") as f:
        f.write(b"\0" * 16)
    with pytest.raises(CheckpointError, match="not fully covered"):
        read_header(path)


def test_a_valid_header_in_any_order_is_read_and_leaves_nothing_mapped(ck):
    path = ck / "model.safetensors"
    rewrite_header(path, lambda h: [h.update({k: h.pop(k)}) for k in list(h)[::-1]])
    ckpt = Checkpoint.open(ck)
    assert ckpt.tensors[NORM].nbytes == 128 * 4
    maps = Path("/proc/self/maps").read_text()
    opened = [f.path for f in psutil.Process().open_files()]
    assert str(path) not in maps and str(path) not in opened


@pytest.mark.slow  # fresh interpreters: a FIFO that blocks cannot hang the suite
def test_non_regular_files_are_refused_without_blocking(single, tmp_path):
    fifo_config = tmp_path / "cfg"
    fifo_config.mkdir()
    os.mkfifo(fifo_config / "config.json")
    fifo_shard = tmp_path / "shard"
    fifo_shard.mkdir()
    shutil.copy(single / "config.json", fifo_shard)
    os.mkfifo(fifo_shard / "model.safetensors")
    for source, file in [(fifo_config, "config.json"), (fifo_shard, "model.safetensors")]:
        done = run_cli("plan", str(source), timeout=120)  # the old code blocked forever
        assert done.returncode == 2, done.stderr
        assert f"{source / file}" in done.stderr and "FIFO" in done.stderr
        assert "Traceback" not in done.stderr


def test_a_directory_named_like_a_shard_is_refused(ck, capsys):
    (ck / "extra.safetensors").mkdir()
    assert "must be a regular file, but this is a directory" in refused(capsys, "plan", ck)


# --- config values ------------------------------------------------------------------------


def _config(ck: Path, **changes) -> Path:
    path = ck / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return path


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("hidden_size", "abc", "whole number"),
        ("hidden_size", None, "hidden_size is null"),
        ("hidden_size", -8, ">= 1"),
        ("hidden_size", True, "whole number"),
        ("num_attention_heads", 0, ">= 1"),
        ("intermediate_size", 0, ">= 1"),
        ("num_hidden_layers", 100_000, "limit of 10000"),
        ("vocab_size", 10**12, "limit of"),
        ("num_key_value_heads", 2.5, "whole number"),
        ("torch_dtype", "int8", "floating-point"),
        ("dtype", "float99", "not a torch dtype"),
    ],
)
def test_config_values_that_cannot_be_real_are_refused(ck, capsys, key, value, words):
    config = _config(ck, **{key: value})
    err = refused(capsys, "plan", ck)
    assert str(config) in err and key in err and words in err


def test_absurd_layer_count_is_refused_at_once_for_a_config_only_plan(tmp_path, capsys):
    source = tmp_path / "deep"
    source.mkdir()
    (source / "config.json").write_text(
        json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 64,
                    "num_attention_heads": 4, "vocab_size": 100, "num_hidden_layers": 10**5})
    )  # fmt: skip
    assert "num_hidden_layers is 100000" in refused(capsys, "plan", source)


def test_random_init_with_zero_heads_is_refused_before_any_rank(ck, capsys):
    _config(ck, num_attention_heads=0, num_key_value_heads=0)
    (ck / "model.safetensors").unlink()
    err = refused(capsys, "load", ck, "--init", "random", "--verify", "--world-size", "1")
    assert "num_attention_heads is 0" in err


def test_every_causal_lm_config_of_transformers_is_admitted():
    """The limits admit every real architecture: each causal-LM config class transformers
    ships, with its defaults (real sizes), passes."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from tpviz.models.limits import config_problem

    checked = 0
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            config = transformers.CONFIG_MAPPING[model_type]().to_dict()
        except Exception:  # noqa: BLE001 - a class that needs arguments has no defaults to check
            continue
        assert config_problem(config) is None, model_type
        checked += 1
    assert checked > 100


def test_benchmark_sized_configs_are_admitted():
    from tpviz.models.limits import config_problem

    from .test_plan import LLAMA_70B

    for layers in (80, 800, 8000):
        assert config_problem({**LLAMA_70B, "num_hidden_layers": layers}) is None
    assert config_problem({**LLAMA_70B, "vocab_size": 4_000_000}) is None
    assert config_problem({**LLAMA_70B, "max_position_embeddings": 10_485_760}) is None


def test_make_checkpoint_checks_everything_before_making_the_directory(tmp_path, capsys):
    for flag, value in [("--hidden", "-8"), ("--layers", "100000"), ("--heads", "0")]:
        out = tmp_path / f"ck{flag}"
        err = refused(capsys, "make-checkpoint", out, flag, value)
        assert flag.lstrip("-") in err
        assert not out.exists()


# --- files that are not what they claim ---------------------------------------------------


def test_header_that_is_a_json_list(ck, capsys):
    path = ck / "model.safetensors"
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    path.write_bytes(raw[:8] + b"[1, 2]".ljust(length) + raw[8 + length :])
    assert f"{path}: corrupt safetensors header: a JSON list" in refused(capsys, "plan", ck)


def test_header_that_is_a_json_list_in_json_mode(ck, capsys):
    path = ck / "model.safetensors"
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    path.write_bytes(raw[:8] + b"[1, 2]".ljust(length) + raw[8 + length :])
    assert main(["plan", str(ck), "--json"]) == 2
    errors = json.loads(capsys.readouterr().out)["errors"]
    assert str(path) in errors[0]["message"] and "list" in errors[0]["message"]


def test_deeply_nested_header_and_config(ck, capsys):
    path = ck / "model.safetensors"
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    deep = b'{"x":' * 100_000 + b"1" + b"}" * 100_000
    header = raw[8 : 8 + length].rstrip()[:-1] + b', "__metadata__": ' + deep + b"}"
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + length :])
    assert "nested too deeply" in refused(capsys, "plan", ck)
    (ck / "config.json").write_bytes(deep)
    err = refused(capsys, "plan", ck)
    assert str(ck / "config.json") in err and "nested too deeply" in err


def _index(ck: Path, weight_map) -> Path:
    (ck / "model.safetensors").rename(ck / "model-00001-of-00001.safetensors")
    index = ck / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


@pytest.mark.parametrize(
    "weight_map, words",
    [
        (["model-00001-of-00001.safetensors"], 'needs an object "weight_map"'),
        ({NORM: 3}, f"weight_map entry {NORM!r} is 3"),
        ({NORM: None}, f"weight_map entry {NORM!r} is None"),
    ],
)
def test_index_weight_map_of_the_wrong_shape(ck, capsys, weight_map, words):
    index = _index(ck, weight_map)
    err = refused(capsys, "plan", ck)
    assert str(index) in err and words in err


@pytest.mark.parametrize("file", ["config.json", "model.safetensors.index.json", "plan.json"])
def test_files_that_are_not_utf8(ck, capsys, file):
    target = ck / file
    if file == "model.safetensors.index.json":
        _index(ck, {})
    target.write_bytes(b'{"a": "\xff"}')
    args = ["plan", ck] + (["--plan", target] if file == "plan.json" else [])
    err = refused(capsys, *args)
    assert str(target) in err and "not UTF-8" in err


@pytest.mark.parametrize("plan", ['{"tp_plan": "abc"}', "[1, 2]", '{"base_model_tp_plan": [1]}'])
def test_plan_files_that_are_not_pattern_objects(ck, capsys, plan):
    path = ck.parent / "plan.json"
    path.write_text(plan)
    err = refused(capsys, "plan", ck, "--plan", path)
    assert str(path) in err and "pattern -> style" in err


def test_a_plan_giving_one_pattern_twice(ck, capsys):
    path = ck.parent / "plan.json"
    path.write_text('{"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.up_proj": "rowwise"}')
    assert "gives key 'layers.*.mlp.up_proj' twice" in refused(capsys, "plan", ck, "--plan", path)


@pytest.mark.parametrize("timeout", ["nan", "inf", "0", "-1"])
def test_load_timeouts_that_are_not_a_positive_finite_time(ck, capsys, timeout):
    err = refused(capsys, "load", ck, "--world-size", "1", "--timeout", timeout)
    assert "timeout must be a positive, finite number" in err


@pytest.mark.parametrize("command", ["plan", "load"])
def test_a_world_size_past_every_tensor_dimension_is_refused_at_once(ck, capsys, command):
    # planning works per rank and tensor: 10**6 ranks used to take minutes before its refusal
    largest = max(max(info.shape) for info in Checkpoint.open(ck).tensors.values())
    err = refused(capsys, command, ck, "--world-size", str(10**6))
    assert "world size 1000000 is larger than every dimension" in err
    assert f"use at most {largest}" in err


def test_launch_refuses_a_boolean_world_size(ck):
    from tpviz import launch, resolve_plan

    with pytest.raises(ValueError, match="world size must be a positive integer, got True"):
        launch(ck, True)
    plan = resolve_plan(ck, 1)
    with pytest.raises(ValueError, match="got True"):
        launch(ck, True, plan)
    with pytest.raises(ValueError, match="timeout"):
        launch(ck, 1, plan, timeout=math.nan)


# --- words that say what happened ----------------------------------------------------------


def test_a_tensor_in_two_shards_is_named_with_both(ck, capsys):
    shutil.copy(ck / "model.safetensors", ck / "b.safetensors")
    _index(ck, {NORM: "b.safetensors", "lm_head.weight": "model-00001-of-00001.safetensors"})
    err = refused(capsys, "plan", ck)
    assert "appears in both" in err and "does not list it" not in err


def _pickle_only(ck: Path) -> None:
    (ck / "model.safetensors").unlink()
    (ck / "pytorch_model.bin").write_bytes(b"a pickle")


@pytest.mark.parametrize(
    "make, found",
    [
        (_pickle_only, "pytorch_model.bin: not safetensors"),
        (lambda ck: save_file({}, ck / "model.safetensors"), "holds no tensors"),
        (lambda ck: _index(ck, {}), "weight_map lists no tensors"),
    ],
)
def test_no_usable_weights_says_what_was_found(ck, capsys, make, found):
    make(ck)
    err = refused(capsys, "load", ck, "--world-size", "1")
    assert found in err and "config.json only" not in err
    assert main(["plan", str(ck), "--world-size", "1"]) == 0
    assert found in capsys.readouterr().out  # the plan shows it as a warning


def test_a_symlink_loop_is_called_one(ck, capsys, tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    assert "symlink loop" in refused(capsys, "plan", loop)
    (ck / "model.safetensors").unlink()
    (ck / "model.safetensors").symlink_to(ck / "model.safetensors")
    err = refused(capsys, "plan", ck)
    assert "symlink loop" in err and str(ck / "model.safetensors") in err


def test_more_errors_are_not_read_as_more_world_sizes(ck, capsys):
    err = refused(capsys, "load", ck, "--world-size", "3")
    assert "world sizes that work: 1, 2, 4, 8;" in err and "more plan error" in err
    assert "(and " not in err


# --- paths outside the checkpoint ---------------------------------------------------------


@pytest.mark.parametrize("outside", ["absolute", "../up"])
def test_an_index_may_not_name_files_outside_its_directory(single, ck, capsys, outside):
    elsewhere = ck.parent / "up"
    elsewhere.mkdir()
    shutil.copy(single / "model.safetensors", elsewhere)
    file = (
        str(elsewhere / "model.safetensors") if outside == "absolute" else "../up/model.safetensors"
    )
    names = list(read_header(single / "model.safetensors"))
    index = _index(ck, dict.fromkeys(names, file))
    err = refused(capsys, "plan", ck)
    assert str(index) in err and "outside the checkpoint directory" in err and names[0] in err


def test_an_index_may_name_files_in_a_subdirectory(ck):
    names = list(read_header(ck / "model.safetensors"))
    _index(ck, dict.fromkeys(names, "sub/model.safetensors"))
    (ck / "sub").mkdir()
    (ck / "model-00001-of-00001.safetensors").rename(ck / "sub" / "model.safetensors")
    assert set(Checkpoint.open(ck).tensors) == set(names)
