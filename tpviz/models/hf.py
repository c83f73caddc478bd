"""transformers models: skeleton from config.json, the TP plan transformers computes, HF init.

An optional extra (`pip install 'tpviz[hf]'`). Nothing is downloaded; code shipped with a
checkpoint (`auto_map` in config.json) runs only with `--model hf-remote-code`.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import re
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..keymap import KeyMap
from ..tempdirs import keep_torch_cache_out_of_tmpdir
from .adapter import HeadCounts, ModelAdapter, local_of
from .config import ConfigError, error_text
from .hf_keys import checkpoint_map


def _transformers(config: dict[str, Any]):
    keep_torch_cache_out_of_tmpdir()  # its model classes import torch._dynamo
    try:
        import transformers
    except ImportError:
        arch = ", ".join(config.get("architectures") or [config.get("model_type", "?")])
        raise ConfigError(
            f"{arch} needs transformers: pip install 'tpviz[hf]' (tpviz's built-in model "
            "covers the Llama family only)"
        ) from None
    return transformers


@contextlib.contextmanager
def _judged_by_transformers() -> Iterator[None]:
    """Run transformers on config.json's content. Its config and model classes check a value by
    using it, so what they raise here (KeyError, TypeError, ValueError, huggingface_hub's
    StrictDataclassError, ...) is that content refused: said as a one-line ConfigError."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - anything transformers raises on the config's values
        raise ConfigError(f"config.json: transformers refused it: {error_text(e)}") from None


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
        self._tree: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._drawn_without_init: set[str] = set()  # Class.param, for init="random"'s report
        self.hf_config = self._config(config)

    def _config(self, config: dict[str, Any]):
        auto = self.transformers.AutoConfig
        if self.trust_remote_code:
            if self.source is None:
                raise ConfigError("custom model code needs the checkpoint directory")
            with _judged_by_transformers():
                return auto.from_pretrained(self.source, trust_remote_code=True)
        model_type = self._model_type(config)
        # as transformers reads config.json: floats JSON cannot hold (a default infinity) are
        # saved tagged, {"__float__": "Infinity"}, and decoded on reading
        fields = self.transformers.PreTrainedConfig._decode_special_floats(config)
        with _judged_by_transformers():
            return auto.for_model(
                model_type, **{k: v for k, v in fields.items() if k != "model_type"}
            )

    def _model_type(self, config: dict[str, Any]) -> str:
        """config.json's `model_type`, one transformers has a config class for."""
        model_type = config.get("model_type")
        if not model_type:
            raise ConfigError(
                'config.json has no model_type; add the model\'s (such as "llama"): '
                "transformers builds a model by it"
            )
        if not isinstance(model_type, str):
            raise ConfigError(
                f"config.json: model_type must be a string naming a model type (such as "
                f'"llama"), not {json.dumps(model_type)}'
            )
        known = self.transformers.CONFIG_MAPPING
        if model_type not in known:
            # transformers' own error lists all of its ~800 types: name the closest instead
            close = difflib.get_close_matches(model_type, list(known.keys()), n=3)
            hint = f" (close: {', '.join(close)})" if close else ""
            raise ConfigError(
                f"config.json: transformers {self.transformers.__version__} does not know "
                f"model_type {model_type!r}{hint}; fix it, or use a transformers that knows it"
            )
        return model_type

    def build(self, config: dict[str, Any], dtype: torch.dtype) -> nn.Module:
        auto = self._auto_class()
        with _judged_by_transformers():
            return auto.from_config(
                self.hf_config, dtype=dtype, trust_remote_code=self.trust_remote_code
            )

    def _auto_class(self):
        """The transformers class that makes logits from token ids for this config: a causal
        LM, else a multimodal LM (LLaVA, Qwen2-VL, Voxtral: their text runs without an image
        or audio). A config with its own code (`auto_map`) names its class itself."""
        hf = self.transformers
        if self.trust_remote_code:
            return hf.AutoModelForCausalLM
        for auto, mapping in (
            (hf.AutoModelForCausalLM, hf.MODEL_FOR_CAUSAL_LM_MAPPING),
            (hf.AutoModelForMultimodalLM, hf.MODEL_FOR_MULTIMODAL_LM_MAPPING),
        ):
            if type(self.hf_config) in mapping:
                return auto
        raise ConfigError(
            f"config.json: transformers builds model_type {self.hf_config.model_type!r} neither "
            "as a causal LM nor as a multimodal LM, the two that make logits from token ids; "
            "tpviz loads those only"
        )

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
        transformers' own `_init_weights` gives them: that of the module holding them, or,
        where that leaves them unset, of its nearest ancestor that sets them (Falcon-H1 sets
        each layer's `mup_vector` from the base model). Floating-point storage starts as NaN,
        so that a buffer no init sets is found, not read as whatever memory held."""
        for module in model.modules():
            meta = [
                n
                for n, b in module._buffers.items()
                if b is not None and b.is_meta and n in module._non_persistent_buffers_set
            ]
            if not meta:
                continue
            for name in meta:
                module._buffers[name] = _unset_like(module._buffers[name], device)
            with torch.no_grad():
                unset = self._init_until_set(model, module, meta)
            if unset:
                raise ConfigError(
                    f"{type(module).__name__}.{', '.join(unset)}: transformers' _init_weights "
                    "gives this computed buffer no value; tpviz cannot make it"
                )

    def init_module(self, model: nn.Module, module: nn.Module) -> None:
        """`module`'s own tensors drawn as transformers' `initialize_weights` draws them: by its
        init, then, where that leaves one unset, by its ancestors', outward, until none is
        (transformers runs a module's init after its children's, and some set their children's
        tensors: Qwen3.5-MoE's sparse block draws its router's weight). An ancestor's init runs
        only when needed: it may draw numbers for tensors of other units too, which would
        shift every later draw. The tensors are then flagged initialised, as transformers
        flags them, so that the ancestors of a module initialised later leave them as they
        are. They start as NaN, so that one no init draws is found, not left holding whatever
        memory held: it is drawn by tpviz's default, and the report names it."""
        from transformers.initialization import guard_torch_init_functions

        own = {  # a tensor tied to one initialised before, or one still on meta (another
            # unit's, tied here), is left as it is; computed buffers have their values
            n: t
            for n, t in module.named_parameters(recurse=False)
            if not getattr(t, "_is_hf_initialized", False) and not t.is_meta
        } | {
            n: b
            for n, b in module.named_buffers(recurse=False)
            if n not in module._non_persistent_buffers_set and not b.is_meta
        }
        with torch.no_grad(), guard_torch_init_functions():
            for tensor in own.values():
                local_of(tensor).fill_(float("nan") if tensor.is_floating_point() else 0)
            unset = self._init_until_set(model, module, list(own))
            for name in unset:
                self._draw_without_init(_own_tensor(module, name), name)
        self._drawn_without_init.update(f"{type(module).__name__}.{n}" for n in unset)
        for tensor in own.values():
            tensor._is_hf_initialized = True

    def _draw_without_init(self, tensor: torch.Tensor, name: str) -> None:
        """A value for a parameter or saved buffer no `_init_weights` sets (its class sets it
        as it is built, which a meta build never ran: GPT-1's Conv1D weights, Apertus' xIELU
        slopes), drawn as transformers' default init draws a tensor of its kind: a matrix
        from normal(0, the config's `initializer_range`), a bias zero, any other one."""
        local = local_of(tensor)
        if tensor.dim() >= 2:
            local.normal_(0.0, self._initializer_range())
        else:
            local.fill_(0.0 if "bias" in name else 1.0)

    def _initializer_range(self) -> float:
        std = getattr(self.hf_config.get_text_config(), "initializer_range", None)
        return float(std) if isinstance(std, int | float) and std > 0 else 0.02

    def drawn_without_init(self) -> list[str]:
        return sorted(self._drawn_without_init)

    def _init_until_set(
        self,
        model: nn.Module,
        module: nn.Module,
        names: list[str],
    ) -> list[str]:
        """Run the init of `module`, then of each ancestor outward, until none of its tensors
        `names` (filled with NaN; read after each init, which may replace them) holds NaN;
        the names of those still unset."""
        for owner, init in self._inits_outward(model, module):
            init(owner)
            unset = [n for n in names if _unset(_own_tensor(module, n))]
            if not unset:
                break
        return unset

    def _inits_outward(
        self, model: nn.Module, module: nn.Module
    ) -> Iterator[tuple[nn.Module, Callable[[nn.Module], None]]]:
        """`module`, then each of its ancestors, with the `_init_weights` transformers gives
        it: that of the innermost transformers model holding it, as its `initialize_weights`
        dispatches a composite model (PaliGemma's own does not set the scale of the Gemma
        embedding its language model holds)."""
        if model not in self._tree:
            tree: dict[nn.Module, tuple[Callable, nn.Module | None]] = {}
            pretrained = self.transformers.PreTrainedModel

            def walk(m: nn.Module, init: Callable, parent: nn.Module | None) -> None:
                init = m._init_weights if isinstance(m, pretrained) else init
                tree[m] = (init, parent)
                for child in m.children():
                    walk(child, init, m)

            walk(model, model._init_weights, None)
            self._tree[model] = tree
        at: nn.Module | None = module
        while at is not None:
            init, parent = self._tree[model][at]
            yield at, init
            at = parent

    def vocab_size(self, config: dict[str, Any]) -> int:
        return int(self.hf_config.get_text_config().vocab_size)

    def logits(self, model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=input_ids, use_cache=False).logits


def _own_tensor(module: nn.Module, name: str) -> torch.Tensor:
    """`module`'s own parameter or buffer `name` (a name is one or the other, never both)."""
    held = module._parameters if name in module._parameters else module._buffers
    return held[name]


def _unset(tensor: torch.Tensor) -> bool:
    """Whether a floating-point tensor filled with NaN still holds one (no init set it)."""
    return tensor.is_floating_point() and bool(local_of(tensor).isnan().any())


def _unset_like(meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Real storage for a meta buffer: NaN where it can hold NaN (an unset value shows)."""
    if meta.is_floating_point():
        return torch.full_like(meta, float("nan"), device=device)
    return torch.zeros_like(meta, device=device)
