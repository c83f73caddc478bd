"""Reading `config.json` files of both transformers generations (4.x and 5.x field names)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..choices import BUILTIN_ROPE_FIELDS, builtin_cannot_compute, rope_type
from ..inputs import InputFileError, read_json, stat_path
from .limits import config_problem


class ConfigError(InputFileError):
    pass


def error_text(error: BaseException, limit: int = 300) -> str:
    """An exception raised by code tpviz runs for the user (transformers, a model factory) as
    one short line: its type (a bare KeyError says little alone), then its message with line
    breaks folded (some put the reason on a second line), cut at `limit` characters."""
    text = " ".join(str(error).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def config_path(source: str | os.PathLike) -> Path:
    """`config.json` of a checkpoint directory (or of the directory holding a checkpoint
    file)."""
    is_dir = stat.S_ISDIR(stat_path(source, "source", ConfigError).st_mode)
    return (Path(source) if is_dir else Path(source).parent) / "config.json"


@contextlib.contextmanager
def naming_config_file(source: str | os.PathLike) -> Iterator[None]:
    """Refusals of config.json's content raised while a model is built from it (adapters
    begin them "config.json") name the file itself."""
    try:
        yield
    except ConfigError as e:
        text = str(e)
        if e.file is not None or not text.startswith("config.json"):
            raise
        file = config_path(source)
        raise ConfigError(f"{file}{text.removeprefix('config.json')}", str(file)) from None


def read_config(source: str | Path) -> dict[str, Any]:
    """`config.json` of a checkpoint directory (or of the directory holding a checkpoint file),
    its sizes and dtype checked (see limits.py)."""
    file = config_path(source)
    if not os.path.lexists(file):
        raise ConfigError(
            f"{file.parent}: no config.json; a source needs one to build the model", str(file)
        )
    config = read_json(file, "config", ConfigError, unique_keys=True)
    if not isinstance(config, dict):
        raise ConfigError(f"{file}: expected a JSON object, not a {type(config).__name__}")
    problem = config_problem(config)
    if problem:
        raise ConfigError(f"{file}: {problem}", str(file))
    return config


def check_unquantized(config: dict[str, Any], source: str | os.PathLike) -> None:
    """Refuse weights that config.json declares quantized (`quantization_config`: FP8 blocks
    with their scales, GPTQ/AWQ packed integers, MXFP4): their tensors are not the model's
    parameters, and listing each as unexpected would not say why."""
    for scope in (config, config.get("text_config")):
        if not isinstance(scope, dict):
            continue
        quantized = scope.get("quantization_config") or scope.get("compression_config")
        if quantized:
            method = quantized.get("quant_method") if isinstance(quantized, dict) else None
            raise ConfigError(
                f"{source}: the weights are quantized ({method or 'quantization_config'}); "
                "tpviz loads floating-point weights: use an unquantized (bfloat16, float16 or "
                "float32) checkpoint of the model",
                str(source),
            )


def config_dtype(config: dict[str, Any]) -> str | None:
    """The weights' dtype a config declares: 5.x writes `dtype`, 4.x `torch_dtype`."""
    value = config.get("dtype") or config.get("torch_dtype")
    if isinstance(value, str):
        return value.removeprefix("torch.")
    return None


def rope_settings(config: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling parameters) from 5.x `rope_parameters` or 4.x `rope_theta` +
    `rope_scaling`. The scaling dict has at least `rope_type`."""
    params = config.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = config.get("rope_theta", 10000.0)
        scaling = dict(config.get("rope_scaling") or {})
    scaling["rope_type"] = rope_type(config)
    return float(theta), scaling


def check_rope(config: dict[str, Any], theta: float, scaling: dict[str, Any]) -> None:
    """Refuse rope settings whose frequencies would not be finite and positive (a theta of
    zero, a factor of "x", a llama3 scaling without its low_freq_factor): the built-in Llama
    reads them only as a rank builds its rotary table, where they would fail or give NaN."""
    kind = scaling["rope_type"]
    where = "rope_parameters" if isinstance(config.get("rope_parameters"), dict) else "rope_scaling"
    if not _positive(theta):
        raise ConfigError(f"config.json: rope_theta must be above 0 (10000 is usual), not {theta}")
    for field in BUILTIN_ROPE_FIELDS.get(kind, ()):
        if not _positive(scaling.get(field)):
            got = f"not {json.dumps(scaling[field])}" if field in scaling else "it is missing"
            raise ConfigError(
                f"config.json: {where}.{field} must be a number above 0 for rope type {kind}; {got}"
            )
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ConfigError(
            f"config.json: {where}.high_freq_factor must be above its low_freq_factor "
            f"({scaling['high_freq_factor']} <= {scaling['low_freq_factor']})"
        )


def _positive(value: Any) -> bool:
    """A finite JSON number above 0 (true and false are not numbers here)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and 0 < value < math.inf


def config_flag(config: dict[str, Any], key: str) -> bool:
    """A true/false field of config.json (false when absent or null, as transformers reads
    it). Only a JSON boolean counts: `bool("false")` is True, and would build a model the
    checkpoint does not hold."""
    value = config.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConfigError(f"config.json: {key} must be true or false, not {json.dumps(value)}")
    return value


@dataclass(frozen=True)
class LlamaDims:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any]
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    max_position_embeddings: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LlamaDims:
        unsupported = builtin_cannot_compute(config)
        if unsupported:
            raise ConfigError(
                f"config.json: {unsupported} is not implemented by tpviz's built-in Llama; "
                "use --model hf or --model auto"
            )
        flags = {
            key: config_flag(config, key)
            for key in ("tie_word_embeddings", "attention_bias", "mlp_bias")
        }
        heads, hidden = _whole(config, "num_attention_heads"), _whole(config, "hidden_size")
        try:
            theta, scaling = rope_settings(config)
            dims = cls(
                vocab_size=_whole(config, "vocab_size"),
                hidden_size=hidden,
                intermediate_size=_whole(config, "intermediate_size"),
                num_layers=_whole(config, "num_hidden_layers"),
                num_heads=heads,
                num_kv_heads=_whole(config, "num_key_value_heads", heads),
                head_dim=_whole(config, "head_dim", hidden // heads),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=_whole(config, "max_position_embeddings", 2048),
                **flags,
            )
        except (KeyError, TypeError, ValueError) as e:  # inside rope or eps settings
            raise ConfigError(f"config.json holds a value a Llama model cannot use ({e})") from None
        check_rope(config, dims.rope_theta, dims.rope_scaling)
        if dims.head_dim < 1:
            raise ConfigError(
                f"config.json: hidden_size {hidden} over {heads} attention heads leaves no "
                "head_dim; give head_dim or fewer heads"
            )
        if dims.head_dim % 2:  # rotary embeddings turn pairs of a head's dimensions
            raise ConfigError(
                f"config.json: head_dim {dims.head_dim} is odd; rotary embeddings need an "
                "even one (give head_dim, or a hidden_size and heads whose ratio is even)"
            )
        return dims


def _whole(config: dict[str, Any], key: str, default: int | None = None) -> int:
    """A size of a Llama config (limits.py checked it is whole where given); absent, null or 0
    (as configs write "derive it"), `default`, and without one the key is named as missing."""
    value = config.get(key)
    if not value:
        if default is None:
            state = "null" if key in config else "missing"
            raise ConfigError(f"config.json: {key} is {state}; a Llama model needs it")
        return default
    return int(value)
