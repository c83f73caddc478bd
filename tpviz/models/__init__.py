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
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..choices import SIXTEEN_BIT_DTYPES, model_family
from ..keymap import KeyMap, prefixed_key_map
from .adapter import HeadCounts, ModelAdapter
from .config import ConfigError, LlamaDims, error_text, read_config

__all__ = ["HeadCounts", "ModelAdapter", "ConfigError", "get_adapter", "read_config"]


# Verification and profiled forwards run this prompt (taken modulo the vocabulary).
FIXED_PROMPT = [[1, 5, 42, 7, 99, 3, 250, 17]]


def vocab_size(source: str | os.PathLike, model: str | None) -> int:
    """The vocabulary of the model at `source`: config.json's `vocab_size`, which every family
    tpviz runs writes at its top, or where its adapter knows (nested: text_config)."""
    config = read_config(source)
    vocab = config.get("vocab_size")
    if isinstance(vocab, int):  # no adapter needed (it may import transformers)
        return vocab
    return get_adapter(config, model, source).vocab_size(config)


def prompt_ids(adapter: ModelAdapter, config: dict[str, Any]) -> torch.Tensor:
    return torch.tensor(FIXED_PROMPT) % adapter.vocab_size(config)


def logits_tolerance(dtype: str, scale: float) -> float:
    """How far sharded logits may be from the whole model's, whose largest magnitude is
    `scale`: the summation order differs (all-reduces), which a 16-bit dtype's rounding makes
    visible, and rounding grows with the values rounded (one bfloat16 step at a logit of 20
    is 0.125; real models' logits reach 10-40)."""
    relative = 5e-2 if dtype in SIXTEEN_BIT_DTYPES else 1e-4
    return relative * max(1.0, scale)


class BuiltinLlama(ModelAdapter):
    name = "builtin"

    def build(self, config: dict[str, Any], dtype: torch.dtype) -> nn.Module:
        from .llama import LlamaForCausalLM

        return LlamaForCausalLM(LlamaDims.from_config(config), config)

    def default_plan(self, model: nn.Module) -> dict[str, str]:
        from .llama import DEFAULT_PLAN

        return dict(DEFAULT_PLAN)

    def checkpoint_map(self, model: nn.Module, shapes: Mapping[str, Sequence[int]]) -> KeyMap:
        """As transformers' LlamaForCausalLM reads a checkpoint: a base-model checkpoint's
        keys lack `model.`, and older ones hold each layer's rotary `inv_freq` (computed here)."""
        return prefixed_key_map(model, shapes, "model", ignored_suffixes=[".rotary_emb.inv_freq"])


class FactoryAdapter(ModelAdapter):
    """A user factory `pkg.mod:fn`; its model's `tp_plan` attribute, if any, is the default.
    Whatever goes wrong with it is a ConfigError naming the spec: its code is the user's."""

    def __init__(self, spec: str):
        self.name = spec
        module_name, _, attr = spec.partition(":")
        if not all(part.isidentifier() for part in module_name.split(".")):
            raise ConfigError(f"--model {spec}: give an absolute module path (pkg.mod) before ':'")
        if not attr.isidentifier():
            raise ConfigError(f"--model {spec}: give the factory's name after ':'")
        self.attr = attr
        try:
            module = importlib.import_module(module_name)
        except Exception as e:  # noqa: BLE001 - importing the user's module runs its code
            raise ConfigError(
                f"--model {spec}: cannot import {module_name} ({error_text(e)})"
            ) from None
        if not hasattr(module, attr):
            raise ConfigError(f"--model {spec}: {module_name} has no {attr}")
        self.factory = getattr(module, attr)
        if not callable(self.factory):
            raise ConfigError(
                f"--model {spec}: {attr} is not callable (type {type(self.factory).__name__})"
            )

    def build(self, config: dict[str, Any], dtype: torch.dtype) -> nn.Module:
        try:  # the factory makes its tensors in the dtypes its code chooses
            model = self.factory(config)
        except Exception as e:  # noqa: BLE001 - the user's code, refusing the config or failing
            raise ConfigError(f"--model {self.name}: the factory raised {error_text(e)}") from None
        if not isinstance(model, nn.Module):
            got = "None" if model is None else f"a {type(model).__name__}"
            raise ConfigError(f"--model {self.name}: {self.attr} returned {got}, not an nn.Module")
        return model

    def compute_buffers(self, model: nn.Module, device: torch.device) -> None:
        """Computed buffers (rotary frequencies) lost to the meta build: a transformers model's
        as transformers' own init makes them, others' by their `tpviz_compute_buffers(device)`;
        one neither makes is refused, naming it, rather than loaded as nothing."""
        if type(model).__module__.startswith("transformers."):
            from .hf import HFAdapter

            HFAdapter(self.config_of(model)).compute_buffers(model, device)
        else:
            super().compute_buffers(model, device)
        for name, module in model.named_modules():
            for buffer, value in module.named_buffers(recurse=False):
                if value.is_meta:
                    raise ConfigError(
                        f"--model {self.name}: {name}.{buffer} ({type(module).__name__}) is a "
                        "buffer its code computes, and tpviz builds the model on meta: give "
                        "that module a tpviz_compute_buffers(device) method that fills it on "
                        "`device`"
                    )


def _refuse_shipped_code(config: dict[str, Any], model: str | None) -> None:
    """A config naming its own model code (`auto_map`) is refused under `auto`, before
    anything is imported, whichever adapter `auto` would pick: even where tpviz's Llama or
    transformers' own class could build it, the shipped code is what the checkpoint means.
    A model the user names runs: that code (hf-remote-code), or other code they choose."""
    if config.get("auto_map") and (model or "auto") == "auto":
        raise ConfigError(
            "config.json names its own model code (auto_map); tpviz runs it only when asked: "
            "--model hf-remote-code (model='hf-remote-code'), or name other code to build the "
            "model with: --model hf (transformers' class for its model_type), builtin or "
            "PKG.MOD:FN"
        )


def get_adapter(
    config: dict[str, Any], model: str | None = "auto", source: str | os.PathLike | None = None
) -> ModelAdapter:
    """The adapter `model` names for this config (`source`: the checkpoint directory)."""
    _refuse_shipped_code(config, model)
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
    adapter: ModelAdapter, config: dict[str, Any], dtype: torch.dtype, device: str = "meta"
) -> nn.Module:
    """The model built for `dtype` (see `ModelAdapter.build`) with every parameter and buffer
    on `device` (meta: nothing allocated)."""
    skip = _skip_meta_init() if device == "meta" else contextlib.nullcontext()
    with torch.device(device), skip:
        model = adapter.build(config, dtype)
    return model.eval().requires_grad_(False)
