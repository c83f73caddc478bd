"""Bad input of every kind is refused before any rank starts: exit 2, one line on stderr that
names the file and the key or tensor, no Python error, and the checkpoint left as it was."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

from tpviz.checkpoint import Checkpoint, CheckpointError, read_header
from tpviz.cli import main
from tpviz.models.demo import make_checkpoint
from tpviz.plan import resolve_plan

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


def test_a_header_length_counting_into_the_tensors_is_called_a_corrupt_length(ck, capsys):
    path = ck / "model.safetensors"
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    path.write_bytes(struct.pack("<Q", length + 8) + raw[8:])  # 8 bytes of the first tensor
    err = refused(capsys, "plan", ck)
    assert f"{path}: corrupt safetensors file: its header length field counts {length + 8}" in err
    assert "UTF-8" not in err


def test_a_real_dtype_tpviz_does_not_read_is_named_as_such(ck, capsys):
    path = ck / "model.safetensors"
    rewrite_header(path, lambda h: h[NORM].update(dtype="U32"))  # same width as F32
    err = refused(capsys, "plan", ck)
    assert f"tensor {NORM!r} is stored as U32, a dtype tpviz does not read (it reads F64" in err


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
    # without model.safetensors or an index, every *.safetensors file in the folder is read
    (ck / "model.safetensors").rename(ck / "a.safetensors")
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
        ("torch_dtype", 5, 'give a dtype\'s name, such as "bfloat16"'),
        ("num_attention_heads", None, "num_attention_heads is null; a Llama model needs it"),
        ("rms_norm_eps", math.nan, "NaN is not a setting"),
        ("rope_parameters", {"rope_type": "default", "rope_theta": math.nan}, "NaN is not"),
        ("layer_norm_epsilon", -1e-5, "an epsilon must be a finite number >= 0"),
        # rope settings tpviz's Llama reads only as a rank builds its rotary table
        ("rope_theta", 0, "rope_theta must be above 0 (10000 is usual), not 0"),
        ("rope_scaling", {"type": "linear", "factor": 0}, ".factor must be a number above 0"),
        ("rope_scaling", {"rope_type": "llama3", "factor": "x"}, 'rope type llama3; not "x"'),
        (
            "rope_scaling",
            {"rope_type": "llama3", "factor": 8, "high_freq_factor": 4},
            "rope_scaling.low_freq_factor must be a number above 0 for rope type llama3; it is",
        ),
    ],
)
def test_config_values_that_cannot_be_real_are_refused(ck, capsys, key, value, words):
    config = _config(ck, **{key: value})
    err = refused(capsys, "plan", ck)
    assert str(config) in err and key in err and words in err


def test_a_dtype_no_model_computes_in_is_refused_wherever_it_comes_from(ck, capsys):
    """fp8 is a storage format (its scales are a quantisation's): loading into it made a model
    whose forward fails, blamed on the plan."""
    _config(ck, torch_dtype="float8_e4m3fn")
    err = refused(capsys, "plan", ck)
    assert "config.json's dtype float8_e4m3fn: a model computes in float32, bfloat16" in err
    assert "choose one with --dtype (dtype=)" in err
    assert main(["plan", str(ck), "--dtype", "bfloat16", "--json"]) == 0  # the way out
    assert json.loads(capsys.readouterr().out)["dtype"] == "bfloat16"
    for dtype in ("float8_e5m2", torch.float8_e4m3fn, "int8", ""):
        with pytest.raises(ValueError, match="dtype"):
            resolve_plan(ck, 2, dtype=dtype)
    assert resolve_plan(ck, 2, dtype="torch.float16").dtype == "float16"  # as config.json says
    weights = ck / "model.safetensors"  # fp8 weights, no dtype declared: none inferred either
    tensors = {name: t.to(torch.float8_e4m3fn) for name, t in load_file(weights).items()}
    save_file(tensors, weights)
    _config(ck, torch_dtype=None)
    assert "the weights' dtype float8_e4m3fn: a model computes in" in refused(capsys, "plan", ck)


def test_transformers_log_lines_stay_off_the_clis_one_line(ck, monkeypatch):
    """A fresh process: transformers reads its verbosity as it is imported."""
    _config(ck, rope_scaling={"rope_type": "frob", "factor": 2.0})  # transformers logs, then fails
    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    done = run_cli("plan", str(ck))
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert "[transformers]" not in done.stderr and "KeyError: 'frob'" in done.stderr


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
    path.write_bytes(raw)
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
        # another file of the checkpoint, or its folder, is not a shard (not "corrupt")
        ({NORM: "config.json"}, "is 'config.json', not a .safetensors file name"),
        ({NORM: "."}, "is '.', not a .safetensors file name"),
    ],
)
def test_index_weight_map_of_the_wrong_shape(ck, capsys, weight_map, words):
    index = _index(ck, weight_map)
    err = refused(capsys, "plan", ck)
    assert str(index) in err and words in err


def test_a_source_file_that_is_not_a_checkpoint_file_is_called_so(ck, capsys):
    err = refused(capsys, "plan", ck / "config.json")
    assert f"{ck / 'config.json'}: not a checkpoint file (*.safetensors, or an index" in err
    assert "give the checkpoint directory" in err and "corrupt" not in err
    notes = ck.parent / "notes" / "notes.txt"  # in a dir without config.json: its kind first
    notes.parent.mkdir()
    notes.write_text("not weights")
    assert f"{notes}: not a checkpoint file" in refused(capsys, "plan", notes)


@pytest.mark.parametrize("file", ["config.json", "model.safetensors.index.json", "plan.json"])
def test_files_that_are_not_utf8(ck, capsys, file):
    target = ck / file
    if file == "model.safetensors.index.json":
        _index(ck, {})
    target.write_bytes(b'{"a": "\xff"}')
    args = ["plan", ck] + (["--plan", target] if file == "plan.json" else [])
    err = refused(capsys, *args)
    assert str(target) in err and "not UTF-8" in err


@pytest.mark.parametrize(
    "plan",
    ['{"tp_plan": "abc"}', "[1, 2]", '{"base_model_tp_plan": [1]}', '{"base_model_tp_plan": []}'],
)
def test_plan_files_that_are_not_pattern_objects(ck, capsys, plan):
    path = ck.parent / "plan.json"
    path.write_text(plan)
    err = refused(capsys, "plan", ck, "--plan", path)
    assert str(path) in err and "pattern -> style" in err


@pytest.mark.parametrize(
    "stray",
    [{"base_model_tp_plans": {}}, {"layers.*.mlp.up_proj": "colwise"}],
    ids=["misspelt", "pattern-beside"],
)
def test_a_key_beside_transformers_form_is_refused_not_ignored(ck, capsys, stray):
    path = ck.parent / "plan.json"
    path.write_text(json.dumps({"tp_plan": {"lm_head": "colwise_gather_output"}, **stray}))
    err = refused(capsys, "plan", ck, "--plan", path)
    assert f"plan file {path}: {next(iter(stray))!r} is not part of a plan in transformers'" in err
    path.write_text(json.dumps({"tp_plan": {}, "suggestion": {}}))  # plan --suggest --json's
    assert main(["plan", str(ck), "--plan", str(path)]) == 0


def test_a_config_giving_one_key_twice(ck, capsys):
    """json (and so transformers) keeps the last of a key given twice: which did its author
    mean? A model's sizes and its plan follow from it, so it is asked, not guessed."""
    path = ck / "config.json"
    text = path.read_text().rstrip().removesuffix("}")
    path.write_text(text + ', "num_hidden_layers": 1}')
    assert f"{path}: the config gives key 'num_hidden_layers' twice" in refused(capsys, "plan", ck)


def test_a_plan_giving_one_pattern_twice(ck, capsys):
    path = ck.parent / "plan.json"
    path.write_text('{"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.up_proj": "rowwise"}')
    assert "gives key 'layers.*.mlp.up_proj' twice" in refused(capsys, "plan", ck, "--plan", path)
    # the same pattern in both parts of transformers' form: one style, or which one is meant?
    up = "layers.*.mlp.up_proj"
    path.write_text(json.dumps({"base_model_tp_plan": {up: "rowwise"}, "tp_plan": {up: "colwise"}}))
    err = refused(capsys, "plan", ck, "--plan", path)
    assert f"'{up}' is 'rowwise' in base_model_tp_plan but 'colwise' in tp_plan" in err
    path.write_text(json.dumps({"base_model_tp_plan": {up: "colwise"}, "tp_plan": {up: "colwise"}}))
    assert main(["plan", str(ck), "--plan", str(path)]) == 0


@pytest.mark.parametrize("timeout", ["nan", "inf", "0", "-1"])
def test_load_timeouts_that_are_not_a_positive_finite_time(ck, capsys, timeout):
    err = refused(capsys, "load", ck, "--world-size", "1", "--timeout", timeout)
    assert "argument --timeout: must be a positive, finite number" in err


@pytest.mark.parametrize("command", ["plan", "load"])
def test_a_world_size_past_every_tensor_dimension_is_refused_at_once(ck, capsys, command):
    # planning works per rank and tensor: 10**6 ranks used to take minutes before its refusal
    largest = max(max(info.shape) for info in Checkpoint.open(ck).tensors.values())
    err = refused(capsys, command, ck, "--world-size", str(10**6))
    assert "world size 1000000 is larger than every dimension" in err
    assert f"use at most {largest}" in err


def test_resolve_plan_names_an_argument_of_the_wrong_kind(ck):
    from tpviz import resolve_plan

    for source in (None, 3, b"ck"):  # 3 was read as file descriptor 3
        with pytest.raises(ValueError, match=r"source must be a checkpoint's path \(str or "):
            resolve_plan(source, 2)
    with pytest.raises(ValueError, match="checkpoint must be a checkpoint's path"):
        resolve_plan(ck, 2, checkpoint=5)
    with pytest.raises(ValueError, match="kv_replication must be True or False, not 'no'"):
        resolve_plan(ck, 2, kv_replication="no")  # was taken as True
    assert resolve_plan(ck, np.int64(2)).world_size == 2  # an integer from numpy is one


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


def test_model_safetensors_is_read_before_an_index_beside_it_as_transformers_does(ck, capsys):
    """A folder holding both layouts (a re-save left the other behind) may hold two models'
    weights: transformers reads model.safetensors, so tpviz plans that, and says what it
    leaves unread."""
    names = list(read_header(ck / "model.safetensors"))
    shutil.copy(ck / "model.safetensors", ck / "stale.safetensors")
    index = {"weight_map": dict.fromkeys(names, "stale.safetensors")}
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    assert Checkpoint.open(ck).files == [str(ck / "model.safetensors")]
    assert main(["plan", str(ck), "--world-size", "1"]) == 0
    out = capsys.readouterr().out
    assert (
        "{model.safetensors.index.json, ... (2 files)}: not read: model.safetensors is, the "
        "file transformers reads first; planned without them"
    ) in out


def test_a_base_models_checkpoint_is_told_apart_from_the_causal_lm_built(ck, capsys):
    """A checkpoint saved from the base model (no LM head) for a causal LM: the missing head is
    named with the class config.json names and the class tpviz builds."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    weights = load_file(ck / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, ck / "model.safetensors")
    _config(ck, architectures=["LlamaModel"])
    err = refused(capsys, "plan", ck)
    assert "lm_head.weight is in the model but not in the checkpoint" in err
    assert "config.json names LlamaModel, and tpviz builds LlamaForCausalLM" in err


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


# --- durations, token ids, config flags -----------------------------------------------------


@pytest.mark.parametrize("option", ["--timeout", "--heartbeat-timeout"])
@pytest.mark.parametrize("seconds", ["2592001", "1e13", "1e15"])
def test_durations_past_30_days_are_refused_before_any_rank(ck, capsys, option, seconds):
    # gloo overflowed (a hang, "Invalid timeout", no C int) on the ranks past about 9e9 s
    err = refused(capsys, "load", ck, "--world-size", "1", option, seconds)
    said = "must be a positive, finite number of seconds, at most 2592000 (30 days)"
    assert f"argument {option}: {said}, not '{seconds}'" in err  # the flag, not Python's name
    from tpviz.liveness import MAX_SECONDS, check_seconds

    name = option.lstrip("-").replace("-", "_")

    check_seconds(name, MAX_SECONDS)  # the bound itself is accepted


INTEGER_DTYPES = [torch.int8, torch.uint8, torch.int16, torch.uint16, torch.int32, torch.uint32,
                  torch.int64, torch.uint64]  # fmt: skip


@pytest.mark.parametrize("dtype", INTEGER_DTYPES)
def test_token_ids_are_checked_exactly_in_every_integer_dtype(dtype):
    from tpviz.token_ids import check_token_ids

    ids = check_token_ids(torch.tensor([0, 5, 100], dtype=dtype), 1000)  # 1000 as int8 is -24
    assert ids.dtype == torch.long and ids.tolist() == [[0, 5, 100]]
    with pytest.raises(ValueError, match=r"token id 100 at input_ids\[0, 2\] is outside"):
        check_token_ids(torch.tensor([0, 5, 100], dtype=dtype), 100)


def test_a_uint64_token_id_past_int64_is_refused_with_its_value():
    from tpviz.token_ids import check_token_ids

    ids = torch.tensor([3, -1]).view(torch.uint64)  # 2**64 - 1 wraps to -1 in int64
    with pytest.raises(ValueError, match=rf"token id {2**64 - 1} at input_ids\[0, 1\]"):
        check_token_ids(ids, 1000)


@pytest.mark.parametrize(
    "key, value",
    [("attention_bias", "false"), ("tie_word_embeddings", "yes"), ("mlp_bias", 0)],
)
def test_builtin_llama_flags_must_be_json_booleans(ck, capsys, key, value):
    _config(ck, **{key: value})  # bool("false") was True: a bias the checkpoint lacks
    err = refused(capsys, "plan", ck, "--model", "builtin")
    assert f"config.json: {key} must be true or false, not {json.dumps(value)}" in err


# --- transformers configs, factories, shipped model code ------------------------------------


def refused_after_transformers_warnings(capsys, *args) -> str:
    """As `refused`, where transformers may log a warning of its own first (an unknown rope
    type): tpviz's reason is the last line, and the only other lines are transformers'."""
    code = main([str(a) for a in args])
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    *before, last = err.strip().splitlines()
    assert "Traceback" not in err and all(line.startswith("[transformers]") for line in before)
    return last


@pytest.mark.parametrize("model", ["auto", "hf"])
@pytest.mark.parametrize(
    "changes, words",
    [
        ({"rope_scaling": {"type": "nonsense", "factor": 2}},
         "config.json: transformers refused it: KeyError: 'nonsense'"),
        ({"rope_scaling": {"rope_type": "yarn"}},
         "config.json: transformers refused it: KeyError: \"Missing required keys in "
         "`rope_parameters` for 'rope_type'='yarn': {'factor'}\""),
        ({"model_type": ["llama"]},
         'config.json: model_type must be a string naming a model type (such as "llama"), '
         'not ["llama"]'),
        ({"model_type": "llamma"},
         "does not know model_type 'llamma' (close: llama, mllama, llama4); fix it"),
        ({"model_type": None},
         'config.json has no model_type; add the model\'s (such as "llama")'),
    ],
    ids=["unknown-rope-type", "yarn-without-factor", "list-model-type", "unknown-model-type",
         "no-model-type"],
)  # fmt: skip
def test_transformers_config_errors_say_what_it_refused(ck, capsys, model, changes, words):
    # rope types tpviz's Llama lacks, and unknown model types, go to transformers under auto
    pytest.importorskip("transformers")
    _config(ck, **changes)
    line = refused_after_transformers_warnings(capsys, "plan", ck, "--model", model)
    assert words in line and len(line) < 400, line


def test_a_config_transformers_refuses_by_type_is_one_line(ck, capsys):
    pytest.importorskip("transformers")
    _config(ck, attention_bias="false")
    err = refused(capsys, "plan", ck, "--model", "hf")
    assert "transformers refused it: StrictDataclassFieldValidationError:" in err
    assert "expected bool, got str (value: 'false')" in err


FACTORIES = """
def returns_none(config):
    return None


def raises(config):
    raise ValueError("boom")


number = 3
"""


@pytest.fixture
def factories(tmp_path, monkeypatch):
    """Modules `tpviz_test_factories` (factories that fail each in its way) and
    `tpviz_test_broken` (raises on import), importable for this test only."""
    (tmp_path / "tpviz_test_factories.py").write_text(FACTORIES)
    (tmp_path / "tpviz_test_broken.py").write_text('raise RuntimeError("no import")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "tpviz_test_factories"
    for name in ("tpviz_test_factories", "tpviz_test_broken"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize(
    "spec, words",
    [
        ("{m}:returns_none", "--model {m}:returns_none: returns_none returned None, not an "
         "nn.Module"),
        ("{m}:number", "--model {m}:number: number is not callable (type int)"),
        ("{m}:raises", "--model {m}:raises: the factory raised ValueError: boom"),
        ("{m}:missing", "--model {m}:missing: {m} has no missing"),
        ("{m}:", "--model {m}:: give the factory's name after ':'"),
        (":x", "--model :x: give an absolute module path (pkg.mod) before ':'"),
        (".rel:x", "--model .rel:x: give an absolute module path (pkg.mod) before ':'"),
        ("tpviz_test_broken:f",
         "--model tpviz_test_broken:f: cannot import tpviz_test_broken (RuntimeError: no import)"),
    ],
    ids=["returns-none", "not-callable", "raises", "missing", "no-name", "no-module", "relative",
         "import-raises"],
)  # fmt: skip
def test_model_factory_errors_name_the_factory(ck, capsys, factories, spec, words):
    err = refused(capsys, "plan", ck, "--model", spec.format(m=factories))
    assert words.format(m=factories) in err


def test_shipped_model_code_is_refused_whatever_auto_would_pick(ck, capsys):
    # model_type llama: auto picks tpviz's own Llama, which used to plan it silently
    _config(ck, auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    err = refused(capsys, "plan", ck)
    assert "config.json names its own model code (auto_map)" in err
    assert "--model hf-remote-code" in err and "--model hf" in err
    assert main(["plan", str(ck), "--model", "builtin"]) == 0  # code the user names runs


@pytest.mark.parametrize("scope", ["", "text_config"])
def test_quantized_weights_are_refused_by_name_not_as_unexpected_tensors(ck, capsys, scope):
    config = json.loads((ck / "config.json").read_text())
    quantized = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    config.update({scope: quantized} if scope else quantized)
    (ck / "config.json").write_text(json.dumps(config))
    err = refused(capsys, "plan", ck, "--world-size", "2")
    assert "the weights are quantized (fp8)" in err and "unquantized" in err
    assert "unexpected" not in err
    # a config alone holds no quantized weights: a random init plans as before
    (ck / "model.safetensors").unlink()
    assert main(["plan", str(ck), "--world-size", "2"]) == 0


def test_scales_without_a_quantization_config_are_counted_and_said_to_look_quantized(ck, capsys):
    weights = ck / "model.safetensors"
    tensors = load_file(weights)
    for layer in range(2):  # fp8 weights with DeepSeek-V3's block scales, as 7 + 7 extra tensors
        for proj in ("q", "k", "v", "o", "gate", "up", "down"):
            part = "mlp" if proj in ("gate", "up", "down") else "self_attn"
            key = f"model.layers.{layer}.{part}.{proj}_proj.weight_scale_inv"
            tensors[key] = torch.ones(1, 1)
    save_file(tensors, weights)
    err = refused(capsys, "plan", ck)
    assert "the weights look quantized, though config.json declares no quantization_config" in err
    assert err.strip().endswith("; and 13 more plan errors")  # 10 listed, then a line for 4
    assert main(["plan", str(ck), "--json"]) == 2
    errors = json.loads(capsys.readouterr().out)["errors"]
    assert [e["count"] for e in errors] == [1] * 10 + [4]


def test_load_sharded_outside_a_process_group_says_how_to_run_it(ck, monkeypatch):
    import tpviz

    monkeypatch.delenv("RANK", raising=False)  # torch's error named only this variable
    with pytest.raises(ValueError, match=r"run the script under torchrun \(torchrun --nproc"):
        tpviz.load_sharded(ck)
    with pytest.raises(ValueError, match="timeout must be a positive, finite number of seconds"):
        tpviz.load_sharded(ck, timeout=0)
    # a device no rank loads on, said before the process group is joined
    with pytest.raises(ValueError, match=r"^device must be 'cpu' or 'cuda', not 'meta'$"):
        tpviz.load_sharded(ck, device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"local rank 0 has none \(0 visible\); load on 'cpu'"):
            tpviz.load_sharded(ck, device="cuda")


def test_load_sharded_in_the_callers_group_leaves_its_timeout_to_the_caller(ck, tmp_path):
    import torch.distributed as dist

    import tpviz

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"yours exists: give it to init_process_group\("):
            tpviz.load_sharded(ck, timeout=5)
    finally:
        dist.destroy_process_group()


def test_an_odd_head_dim_is_refused_before_a_checkpoint_or_a_plan(capsys, tmp_path):
    """Rotary embeddings turn pairs of a head's dimensions: tpviz's Llama with an odd head_dim
    planned one buffer and built another (a false shard mismatch, then a failed forward)."""
    odd = ["--hidden", "42", "--heads", "6", "--kv-heads", "6"]
    err = refused(capsys, "make-checkpoint", tmp_path / "ck", *odd)
    assert "head_dim 7 is odd; rotary embeddings need an even one" in err
    assert not (tmp_path / "ck").exists()
    source = tmp_path / "config-only"
    source.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 97,
              "hidden_size": 42, "intermediate_size": 13, "num_hidden_layers": 1,
              "num_attention_heads": 6, "num_key_value_heads": 6}  # fmt: skip
    (source / "config.json").write_text(json.dumps(config))
    assert "head_dim 7 is odd" in refused(capsys, "plan", source, "--model", "builtin")
