"""Deterministic Llama-family checkpoints in Hugging Face layout for demos, tests, benchmarks."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import psutil
import torch
from safetensors.torch import save_file

from ..checkpoint import INDEX_NAME, SINGLE_NAME, torch_dtype
from ..format import human_bytes
from . import BuiltinLlama, build_skeleton
from .limits import config_problem

# hidden, intermediate, layers, heads, kv heads, vocab
PRESETS: dict[str, dict[str, int]] = {
    # ~2.5 MB in float32: heads and kv heads split over 1, 2 and 4 ranks
    "tiny": dict(hidden=128, intermediate=352, layers=2, heads=8, kv_heads=4, vocab=1000),
    # ~150 MB
    "small": dict(hidden=768, intermediate=2048, layers=4, heads=12, kv_heads=4, vocab=8000),
    # ~640 MB: the calibration size in DESIGN.md
    "medium": dict(hidden=1024, intermediate=2816, layers=8, heads=16, kv_heads=8, vocab=32000),
}
DEFAULT_MAX_SHARD_SIZE = 200 * 1000 * 1000


def demo_config(
    preset: str = "tiny",
    dtype: str = "float32",
    tie_embeddings: bool = False,
    **overrides: int | None,
) -> dict[str, Any]:
    """A transformers-compatible Llama `config.json` for a preset, with dimension overrides."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    dims = {**PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}}
    unknown = set(dims) - set(PRESETS[preset])
    if unknown:
        raise ValueError(f"unknown dimension override(s): {', '.join(sorted(unknown))}")
    for name, value in dims.items():
        if type(value) is not int or value < 1:
            flag = name.replace("_", "-")
            raise ValueError(f"--{flag} must be a whole number >= 1, not {value!r}")
    if dims["hidden"] % dims["heads"]:
        raise ValueError(f"hidden size {dims['hidden']} is not a multiple of {dims['heads']} heads")
    if dims["heads"] % dims["kv_heads"]:
        raise ValueError(f"{dims['heads']} heads is not a multiple of {dims['kv_heads']} kv heads")
    torch_dtype(dtype)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": dims["hidden"],
        "intermediate_size": dims["intermediate"],
        "num_hidden_layers": dims["layers"],
        "num_attention_heads": dims["heads"],
        "num_key_value_heads": dims["kv_heads"],
        "head_dim": dims["hidden"] // dims["heads"],
        "vocab_size": dims["vocab"],
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": tie_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    problem = config_problem(config)
    if problem:
        raise ValueError(f"make-checkpoint: {problem}")
    return config


def make_checkpoint(
    directory: str | os.PathLike,
    preset: str = "tiny",
    dtype: str = "float32",
    tie_embeddings: bool = False,
    seed: int = 0,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    **overrides: int | None,
) -> Path:
    """Write a deterministic checkpoint (config.json + safetensors, sharded over
    `max_shard_size`) that transformers' `LlamaForCausalLM.from_pretrained` loads."""
    config = demo_config(preset, dtype, tie_embeddings, **overrides)  # all checks come first
    out = _new_directory(directory)
    skeleton = build_skeleton(BuiltinLlama(), config, torch.float32)
    _check_room(out, sum(p.numel() for p in skeleton.parameters()) * torch_dtype(dtype).itemsize)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot make {out} ({e.strerror}); choose another directory") from None
    generator = torch.Generator().manual_seed(seed)
    target = torch_dtype(dtype)
    tensors: dict[str, torch.Tensor] = {}
    for name, param in skeleton.named_parameters():  # tied weights appear once
        if name.endswith("norm.weight"):  # near one, so the norms are not trivial
            value = 1.0 + 0.1 * torch.randn(param.shape, generator=generator)
        else:
            value = 0.02 * torch.randn(param.shape, generator=generator)
        tensors[name] = value.to(target)
    _save_sharded(tensors, out, max_shard_size)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _new_directory(directory: str | os.PathLike) -> Path:
    """`directory` if it is new or empty: a checkpoint is never written over anything, a
    config.json beside other weights or a plan's config-only directory included."""
    if not os.fspath(directory):
        raise ValueError("give a directory to write the checkpoint into (the path is empty)")
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file; give a directory to write the checkpoint into")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; choose a new or empty directory")
    return out


def _check_room(out: Path, nbytes: int) -> None:
    """Refuse, before writing anything, a checkpoint that memory (its tensors are made whole
    first) or the disk cannot hold."""
    held = next(p for p in [out, *out.parents] if p.exists())
    room = {"memory": psutil.virtual_memory().available}
    disk = shutil.disk_usage(held)
    if disk.total:  # a file system with no blocks (/proc) holds no files: mkdir says so
        room["disk"] = disk.free
    for what, free in room.items():
        if nbytes > free:
            raise ValueError(
                f"the checkpoint would take {human_bytes(nbytes)}, more than "
                f"the {human_bytes(free)} of {what} available; choose smaller dimensions"
            )


def _save_sharded(tensors: dict[str, torch.Tensor], out: Path, max_shard_size: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        _save(shards[0], out / SINGLE_NAME)
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _save(shard, out / file)
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file(tensors, path, metadata={"format": "pt"})
    # safetensors writes its files 0600; give them the mode config.json gets, as any file
    path.chmod(0o666 & ~_umask())


def _umask() -> int:
    """The process umask, read without setting it (os.umask would, for every thread)."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(re.search(r"^Umask:\s*(\d+)", status, re.M)[1], 8)
    except (OSError, TypeError):
        mask = os.umask(0o077)
        os.umask(mask)
        return mask


def cache_dir() -> Path:
    """Where demo checkpoints live: `$TPVIZ_CACHE`, else ~/.cache/tpviz."""
    return Path(os.environ.get("TPVIZ_CACHE", Path.home() / ".cache" / "tpviz"))


def demo_checkpoint(preset: str = "small", cache: str | os.PathLike | None = None) -> Path:
    """The `preset` demo checkpoint in the cache dir, made on first use (`tpviz demo`, the
    notebooks, the Dashboard and the benchmarks share it)."""
    root = Path(cache) if cache is not None else cache_dir()
    if root.exists() and not root.is_dir():
        raise ValueError(f"the demo cache {root} is not a directory; set TPVIZ_CACHE to one")
    target = root / f"demo-{preset}"
    if (target / "config.json").exists() and not any(target.glob("*.safetensors")):
        raise ValueError(f"{target} has lost its weights; remove it, and it is made again")
    if not (target / "config.json").exists():
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a file on the way ($HOME itself), or no permission
            raise ValueError(
                f"cannot make the demo cache {root} ({e.strerror}); set TPVIZ_CACHE to a "
                "writable directory"
            ) from None
        tmp = root / f".demo-{preset}-{os.getpid()}"
        make_checkpoint(tmp, preset)
        try:
            tmp.rename(target)  # whole or not at all: another process may be making it too
        except OSError:
            if not (target / "config.json").exists():
                raise
    return target
