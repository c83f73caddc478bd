"""Model families: config.json -> skeleton, default TP plan, head alignment, init and forward.

An adapter is chosen by `--model`: `builtin` (tpviz's Llama family), `hf` (transformers, an
optional extra), `pkg.mod:fn` (a user factory `fn(config: dict) -> nn.Module`), or `auto`
(built-in for the Llama family, transformers otherwise).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..choices import model_family
from .adapter import HeadCounts, ModelAdapter
from .config import ConfigError, LlamaDims, read_config

__all__ = ["HeadCounts", "ModelAdapter", "ConfigError", "get_adapter", "read_config"]


# Verification and profiled forwards run this prompt (taken modulo the vocabulary).
FIXED_PROMPT = [[1, 5, 42, 7, 99, 3, 250, 17]]


def prompt_ids(adapter: ModelAdapter, config: dict[str, Any]) -> torch.Tensor:
    return torch.tensor(FIXED_PROMPT) % adapter.vocab_size(config)


class BuiltinLlama(ModelAdapter):
    name = "builtin"

    def build(self, config: dict[str, Any]) -> nn.Module:
        from .llama import LlamaForCausalLM

        return LlamaForCausalLM(LlamaDims.from_config(config), config)

    def default_plan(self, model: nn.Module) -> dict[str, str]:
        from .llama import DEFAULT_PLAN

        return dict(DEFAULT_PLAN)


class FactoryAdapter(ModelAdapter):
    """A user factory `pkg.mod:fn`; its model's `tp_plan` attribute, if any, is the default."""

    def __init__(self, spec: str):
        self.name = spec
        module_name, _, attr = spec.partition(":")
        try:
            self.factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"--model {spec}: cannot import the factory ({e})") from None

    def build(self, config: dict[str, Any]) -> nn.Module:
        return self.factory(config)


def get_adapter(
    config: dict[str, Any], model: str | None = "auto", source: str | os.PathLike | None = None
) -> ModelAdapter:
    """The adapter `model` names for this config (`source`: the checkpoint directory)."""
    choice = model_family(config, model)
    if choice == "builtin":
        return BuiltinLlama()
    if choice in ("hf", "hf-remote-code"):
        from .hf import HFAdapter

        return HFAdapter(config, source, trust_remote_code=choice == "hf-remote-code")
    if ":" in choice:
        return FactoryAdapter(choice)
    raise ConfigError(
        f"--model {choice!r}: expected auto, builtin, hf, hf-remote-code or PKG.MOD:FN"
    )


def adapter_for_module(model: nn.Module) -> ModelAdapter:
    """The adapter for a model given as a module (resolve_plan on an in-memory model)."""
    from .llama import LlamaForCausalLM

    if isinstance(model, LlamaForCausalLM):
        return BuiltinLlama()
    if type(model).__module__.startswith("transformers."):
        from .hf import HFAdapter

        return HFAdapter(ModelAdapter().config_of(model))
    return ModelAdapter()


@contextlib.contextmanager
def _skip_meta_init() -> Iterator[None]:
    """Make torch.nn.init's in-place initialisers return meta tensors untouched. On meta they
    do nothing, but some of them import torch._dynamo on first use (over a second)."""

    def skipping(original):
        @functools.wraps(original)
        def init(tensor, *args, **kwargs):
            return tensor if tensor.is_meta else original(tensor, *args, **kwargs)

        return init

    names = [n for n in vars(nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(nn.init, n) for n in names}
    with _INIT_PATCH_LOCK:
        for name, original in saved.items():
            setattr(nn.init, name, skipping(original))
        try:
            yield
        finally:
            for name, original in saved.items():
                setattr(nn.init, name, original)


_INIT_PATCH_LOCK = threading.Lock()


def build_skeleton(
    adapter: ModelAdapter, config: dict[str, Any], device: str = "meta"
) -> nn.Module:
    """The model with every parameter and buffer on `device` (meta: nothing allocated)."""
    skip = _skip_meta_init() if device == "meta" else contextlib.nullcontext()
    with torch.device(device), skip:
        model = adapter.build(config)
    return model.eval().requires_grad_(False)
