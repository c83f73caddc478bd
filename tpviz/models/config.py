"""Reading `config.json` files of both transformers generations (4.x and 5.x field names)."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..choices import builtin_cannot_compute, rope_type
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


def read_config(source: str | Path) -> dict[str, Any]:
    """`config.json` of a checkpoint directory (or of the directory holding a checkpoint file),
    its sizes and dtype checked (see limits.py)."""
    is_dir = stat.S_ISDIR(stat_path(source, "source", ConfigError).st_mode)
    directory = Path(source) if is_dir else Path(source).parent
    file = directory / "config.json"
    if not os.path.lexists(file):
        raise ConfigError(
            f"{directory}: no config.json; a source needs one to build the model", str(file)
        )
    config = read_json(file, "config", ConfigError)
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
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            theta, scaling = rope_settings(config)
            dims = cls(
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
                **flags,
            )
        except KeyError as e:
            raise ConfigError(
                f"config.json lacks {e.args[0]!r}, which a Llama model needs"
            ) from None
        except (TypeError, ValueError, ZeroDivisionError) as e:
            raise ConfigError(f"config.json holds a value a Llama model cannot use ({e})") from None
        if dims.head_dim < 1:
            raise ConfigError(
                f"config.json: hidden_size {hidden} over {heads} attention heads leaves no "
                "head_dim; give head_dim or fewer heads"
            )
        return dims
