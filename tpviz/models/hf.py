"""transformers models: skeleton from config.json, the TP plan transformers computes, HF init.

An optional extra (`pip install 'tpviz[hf]'`). Nothing is downloaded; code shipped with a
checkpoint (`auto_map` in config.json) runs only with `--model hf-remote-code`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..keymap import KeyMap
from .adapter import HeadCounts, ModelAdapter
from .config import ConfigError
from .hf_keys import checkpoint_map


def _transformers(config: dict[str, Any]):
    try:
        import transformers
    except ImportError:
        arch = ", ".join(config.get("architectures") or [config.get("model_type", "?")])
        raise ConfigError(
            f"{arch} needs transformers: pip install 'tpviz[hf]' (tpviz's built-in model "
            "covers the Llama family only)"
        ) from None
    return transformers


class HFAdapter(ModelAdapter):
    def __init__(
        self,
        config: dict[str, Any],
        source: str | Path | None = None,
        trust_remote_code: bool = False,
    ):
        self.transformers = _transformers(config)
        self.name = "hf-remote-code" if trust_remote_code else "hf"
        self.source = source
        self.trust_remote_code = trust_remote_code
        if config.get("auto_map") and not trust_remote_code:
            raise ConfigError(
                "config.json names custom model code (auto_map); tpviz runs it only when asked: "
                "--model hf-remote-code (model='hf-remote-code')"
            )
        self.hf_config = self._config(config)

    def _config(self, config: dict[str, Any]):
        auto = self.transformers.AutoConfig
        if self.trust_remote_code:
            if self.source is None:
                raise ConfigError("custom model code needs the checkpoint directory")
            return auto.from_pretrained(self.source, trust_remote_code=True)
        model_type = config.get("model_type")
        if not model_type:
            raise ConfigError("config.json has no model_type; transformers cannot build it")
        try:
            return auto.for_model(
                model_type, **{k: v for k, v in config.items() if k != "model_type"}
            )
        except (KeyError, ValueError) as e:
            raise ConfigError(
                f"transformers does not know model_type {model_type!r} ({e})"
            ) from None

    def build(self, config: dict[str, Any]) -> nn.Module:
        auto = self.transformers.AutoModelForCausalLM
        try:
            model = auto.from_config(self.hf_config, trust_remote_code=self.trust_remote_code)
        except ValueError as e:
            raise ConfigError(
                f"transformers cannot build a causal LM from this config ({e})"
            ) from None
        return model

    def kept_in_float32(self, model: nn.Module, dtype: torch.dtype) -> re.Pattern | None:
        """What transformers keeps float32 at load: the model's `_keep_in_fp32_modules` (under
        float16) and `_keep_in_fp32_modules_strict` (under any 16-bit dtype), its submodules'
        included, matched as transformers matches them (`*` any text, searched in the name)."""
        kept = getattr(model, "_get_dtype_plan", lambda _: {})(dtype)
        if not kept:
            return None
        return re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in kept))

    def head_counts(self, config: dict[str, Any]) -> HeadCounts | None:
        return HeadCounts.from_config(self.hf_config.get_text_config())

    def checkpoint_map(self, model: nn.Module, shapes: Mapping[str, Sequence[int]]) -> KeyMap:
        """The key renames and tensor assembly transformers applies when it loads this class."""
        return checkpoint_map(model, shapes)

    def compute_buffers(self, model: nn.Module, device: torch.device) -> None:
        """Non-persistent buffers (rotary frequencies) get real storage, then the values
        transformers' own `_init_weights` gives them."""
        for module in model.modules():
            meta = [
                n
                for n, b in module._buffers.items()
                if b is not None and b.is_meta and n in module._non_persistent_buffers_set
            ]
            if not meta:
                continue
            for name in meta:
                module._buffers[name] = torch.empty_like(module._buffers[name], device=device)
            with torch.no_grad():
                model._init_weights(module)

    def init_module(self, model: nn.Module, module: nn.Module) -> None:
        with torch.no_grad():
            model._init_weights(module)

    def vocab_size(self, config: dict[str, Any]) -> int:
        return int(self.hf_config.get_text_config().vocab_size)

    def logits(self, model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=input_ids, use_cache=False).logits
