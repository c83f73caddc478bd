"""Sizes and counts in config.json: whole numbers, positive where every model needs them, and
under limits no real model comes near.

The check is by key name, so it covers every architecture transformers builds, not only Llama:
a key of the (text) config that names a size or a count (`*_size`, `*_dim`, `num_*`, `n_*`,
`*_layers`, ...) must hold a whole number when it holds a value at all, >= 1 for the widths
every model is built from, else >= -1 (real configs write 0 or -1 for "none"). Lists and
objects are left to the model code (some configs give per-layer lists). The declared dtype
must be a floating-point one: floating-point weights are cast to it. No value may be NaN, and
an epsilon (`*_eps`, `*_epsilon`) must be finite and >= 0: either would make every logit NaN.

Why these limits. Resolving a plan costs time and memory per tensor (about 0.15 ms and 10 KB
each at world size 8 here), and the skeleton's tensors are the layers times the tensors of one
layer: a config with 10^5 layers took 267 s and 11.5 GB before it failed for the user. A
limit on the total tensor count would need the skeleton first, which is the cost to avoid, so
the count that multiplies modules, layers, gets `MAX_LAYERS`: ten thousand admits real models
(under 200 layers) and the benchmark configs (thousands of layers) and bounds a plan to about
ten seconds. Experts do not multiply modules (transformers 5 fuses a layer's experts into one
tensor; Doge's default is 16384 of them), and every other size only shapes meta tensors, which
cost nothing, so their limit only says "cannot be real": vocabularies run to millions and
contexts to tens of millions, 2**31 is far above both.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import torch

MAX_LAYERS = 10_000
MAX_SIZE = 2**31

SIZE_KEY = re.compile(r"^(num|n)_|_(size|dim|heads|layers|experts)$|^max_position_embeddings$")
LAYERS_KEY = re.compile(r"layers?$")
# widths every tensor of a model is built from: >= 1. Other sizes may be 0 or -1, as real
# configs write for "none" or "derive it" (shared_intermediate_size 0, head_dim 0,
# chunk_size -1).
POSITIVE_KEY = re.compile(
    r"^((hidden|intermediate|vocab)_size|num_(\w+_)?heads|num_hidden_layers)$"
)
REQUIRED = {"hidden_size", "vocab_size", "num_hidden_layers"}
EPSILON_KEY = re.compile(r"(^|_)eps(ilon)?$")  # rms_norm_eps, layer_norm_epsilon, norm_eps


def config_problem(config: dict[str, Any]) -> str | None:
    """What is wrong with the sizes and dtype of a config (and of its `text_config`), if
    anything: one sentence naming the key and the value."""
    scopes = [("", config)]
    if isinstance(config.get("text_config"), dict):
        scopes.append(("text_config.", config["text_config"]))
    for prefix, scope in scopes:
        for key, value in scope.items():
            problem = _size_problem(key, value) or _dtype_problem(key, value)
            problem = problem or _number_problem(key, value)
            if problem:
                return f"{prefix}{key} is {json.dumps(value)}: {problem}"
    return None


def _number_problem(key: str, value: Any) -> str | None:
    """NaN, anywhere in a value (a rope theta inside rope_parameters too), makes every logit
    NaN; so does a negative epsilon under a square root. (Infinity is a real setting: no
    softcap.)"""
    if _holds_nan(value):
        return "NaN is not a setting; give a number"
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if EPSILON_KEY.search(key) and is_number and not 0 <= value < math.inf:
        return "an epsilon must be a finite number >= 0"
    return None


def _holds_nan(value: Any) -> bool:
    if isinstance(value, float):
        return math.isnan(value)
    if isinstance(value, dict):
        return any(map(_holds_nan, value.values()))
    return isinstance(value, list) and any(map(_holds_nan, value))


def _size_problem(key: str, value: Any) -> str | None:
    positive = POSITIVE_KEY.search(key)
    # lists (per-layer sizes) and objects are the model code's; true/false are flags
    # (cross_attn_all_layers), except where a width must be
    if not SIZE_KEY.search(key) or isinstance(value, (list, dict)):
        return None
    if isinstance(value, bool) and not positive:
        return None
    if value is None:
        return "a model needs it" if key in REQUIRED else None
    whole_float = isinstance(value, float) and math.isfinite(value) and value.is_integer()
    if not (type(value) is int or whole_float):  # 1200.0 is in real configs
        return "a size or count must be a whole number"
    low = 1 if positive else -1
    if value < low:
        return f"a size or count must be >= {low}"
    limit = MAX_LAYERS if LAYERS_KEY.search(key) else MAX_SIZE
    if value > limit:
        return f"over tpviz's limit of {limit}, more than any real model has"
    return None


def _dtype_problem(key: str, value: Any) -> str | None:
    """`dtype` (5.x) / `torch_dtype` (4.x): floating-point weights are cast to it."""
    if key not in ("dtype", "torch_dtype") or value is None or value == "auto":
        return None
    if not isinstance(value, str):
        return 'give a dtype\'s name, such as "bfloat16"'
    dtype = getattr(torch, value.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        return "not a torch dtype"
    if not dtype.is_floating_point:
        return "weights load as a floating-point dtype (float32, bfloat16 or float16)"
    return None
