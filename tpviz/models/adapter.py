"""The adapter interface: what tpviz needs from a model family, and head counts.

Its own module so that adapters living in submodules (models/hf.py) import it without
importing the package that chooses among them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..keymap import KeyMap
from .config import ConfigError


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """A rank's own part of a model tensor: a DTensor's local shard, else the tensor."""
    # imported where ranks run, which have it already: at import it would slow the CLI's start
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass(frozen=True)
class HeadCounts:
    """The config's attention heads; an attention module's own attributes take precedence."""

    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: Any) -> HeadCounts | None:
        """From a config dict or object (transformers' maps `n_head` and such onto these)."""

        def get(key: str) -> Any:
            if isinstance(config, dict):
                return config.get(key)
            try:
                return getattr(config, key, None)
            except RuntimeError:
                # a heterogeneous transformers config (Gemma-4's head_dim) refuses a global
                # read of what it sets per layer: unknown here, each attention module says it
                return None

        heads = get("num_attention_heads")
        if not isinstance(heads, int) or heads < 1:
            return None
        hidden = get("hidden_size")
        head_dim = get("head_dim") or (hidden // heads if isinstance(hidden, int) else 0)
        return cls(heads, get("num_key_value_heads") or heads, int(head_dim))


class ModelAdapter:
    """What tpviz needs from a model family. Subclasses override what differs."""

    name = "module"

    def build(self, config: dict[str, Any], dtype: torch.dtype) -> nn.Module:
        """The model on the current default device (tpviz calls it under `torch.device`), built
        for `dtype`: what its code makes in the default dtype (transformers' buffers such as a
        causal mask or a sinusoid table) is made in `dtype`, as transformers builds it. The plan
        takes each computed buffer's dtype from this build; the rest it casts itself."""
        raise ConfigError("this model was given as a module; tpviz cannot rebuild it from a config")

    def default_plan(self, model: nn.Module) -> dict[str, str]:
        """The model's own `tp_plan` attribute, if it has one."""
        return dict(getattr(model, "tp_plan", None) or {})

    def config_of(self, model: nn.Module) -> dict[str, Any]:
        config = getattr(model, "config", None)
        return config.to_dict() if hasattr(config, "to_dict") else dict(config or {})

    def head_counts(self, config: dict[str, Any]) -> HeadCounts | None:
        return HeadCounts.from_config(config)

    def kept_in_float32(self, model: nn.Module, dtype: torch.dtype) -> re.Pattern | None:
        """The tensors (searched by name) that stay float32 when the model loads in `dtype`,
        because a 16-bit dtype would lose what they need (MoE routers, for one); None: none."""
        return None

    def checkpoint_map(
        self, model: nn.Module, shapes: Mapping[str, Sequence[int]]
    ) -> KeyMap | None:
        """How checkpoint keys become the model's tensors; None: each tensor is the key of
        its own name."""
        return None

    def compute_buffers(self, model: nn.Module, device: torch.device) -> None:
        """Give non-persistent buffers (rotary caches) real values after a meta build."""
        for module in model.modules():
            if hasattr(module, "tpviz_compute_buffers"):
                module.tpviz_compute_buffers(device)

    def init_module(self, model: nn.Module, module: nn.Module) -> None:
        """Random-initialise the tensors `module` owns directly, with its own init."""
        reset = getattr(module, "reset_parameters", None)
        if reset is None:
            raise ConfigError(
                f"{type(module).__name__} has no reset_parameters(); tpviz cannot random-"
                "initialise it"
            )
        reset()

    def drawn_without_init(self) -> list[str]:
        """The parameters (`Class.name`) `init_module` drew by a default of tpviz's because
        the model's own init gives them no value; the report of a random init names them."""
        return []

    def logits(self, model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """The model's logits: what it returns, or the `logits` of an output object (as a
        transformers model a factory built returns)."""
        out = model(input_ids)
        return out if isinstance(out, torch.Tensor) else out.logits

    def vocab_size(self, config: dict[str, Any]) -> int:
        return int(config.get("vocab_size") or config.get("text_config", {})["vocab_size"])
