"""The walk over the skeleton: one TensorPlan per tensor, in module order.

A module's style (the one that runs its forward) comes from its weight's key, else its own
key; a tensor's from its own key, else its module's, else `replicate`. The style's cut says
what each rank holds. A tensor tied to an earlier one is listed once, under the first name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from .. import styles
from ..checkpoint import dtype_name
from .issues import Issues, check_tie
from .patterns import CompiledPlan, PlanKey
from .types import TensorPlan


@dataclass(slots=True)
class _Tensor:
    """A tensor that a module owns directly, as the walk meets it."""

    name: str  # fully qualified
    module: str
    leaf: str
    value: torch.Tensor  # on meta, or computed (non-persistent buffers)
    kind: str  # "parameter" or "buffer"
    persistent: bool
    transposed: bool  # stacked experts stored (experts, in, out), as the module declares

    @property
    def ndim(self) -> int:
        return self.value.dim()

    @property
    def origin(self) -> str:
        return "checkpoint" if self.persistent else "computed"


def _direct_tensors(mod_name: str, module: nn.Module) -> list[_Tensor]:
    """The tensors `module` owns directly, parameters first."""
    # transformers' experts interface declares the layout of its stacked tensors
    transposed = getattr(module, "is_transposed", False) is True
    found = [
        _Tensor(_join(mod_name, leaf), mod_name, leaf, p, "parameter", True, transposed)
        for leaf, p in module._parameters.items()
        if p is not None
    ]
    for leaf, buf in module._buffers.items():
        if buf is not None:
            persistent = leaf not in module._non_persistent_buffers_set
            name = _join(mod_name, leaf)
            found.append(_Tensor(name, mod_name, leaf, buf, "buffer", persistent, transposed))
    return found


def _join(module: str, leaf: str) -> str:
    return f"{module}.{leaf}" if module else leaf


class Walk:
    """One walk over the skeleton: a TensorPlan per tensor (a tied tensor once), the forward
    style of every module that has one, and the modules given each unexecutable style."""

    def __init__(
        self,
        compiled: CompiledPlan,
        world_size: int,
        target: torch.dtype,
        errors: Issues,
        kept_in_float32: re.Pattern | None = None,
    ) -> None:
        self.compiled = compiled
        self.world_size = world_size
        self.target = target
        self.kept_in_float32 = kept_in_float32  # names the model keeps float32 (adapter's)
        self.errors = errors
        self.entries: list[TensorPlan] = []
        self.by_id: dict[int, TensorPlan] = {}  # parameter storage -> its entry, for ties
        self.module_styles: dict[str, str] = {}
        self.unsupported: dict[str, list[str]] = {}  # style given -> modules

    def visit(self, mod_name: str, module: nn.Module) -> None:
        direct = _direct_tensors(mod_name, module)
        if not direct:
            self._visit_tensorless(mod_name, module)
            return
        module_key = self.compiled.best(mod_name)  # looked up even when unused: marks it used
        weight_key = None
        if "weight" in module._parameters:
            weight_key = self.compiled.best(_join(mod_name, "weight"))
        forward_key = weight_key or module_key  # a parameter key beats a module key
        forward = self._forward_style(forward_key, mod_name, module)
        for t in direct:
            tied = self.by_id.get(id(t.value)) if t.kind == "parameter" else None
            if tied is not None:
                tied.tied_to.append(t.name)
                dim = forward.placement_dim(t.leaf, t.ndim, t.transposed) if forward else None
                check_tie(tied, t.name, dim, self.errors)
                continue
            own_key = None
            if t.kind == "parameter":
                own_key = weight_key if t.leaf == "weight" else self.compiled.best(t.name)
            entry = self._place(t, own_key, forward_key, forward)
            self.entries.append(entry)
            if t.kind == "parameter":
                self.by_id[id(t.value)] = entry

    def _visit_tensorless(self, mod_name: str, module: nn.Module) -> None:
        """A module without tensors of its own (an identity expert, shared experts holding
        only submodules) still runs a forward its style may act on around it: one that sums
        or splits partial outputs (`all_reduce`, `moe_identity_expert`). Other styles on it
        stay unused, as before (their keys are reported unmatched)."""
        key = self.compiled.peek(mod_name)
        style = styles.executable(key.style_given) if key else None
        if style and style.forward and not style.forward.on_dtensors:
            self.compiled.best(mod_name)  # marks the key used
            self.module_styles[mod_name] = style.name

    def _forward_style(
        self, key: PlanKey | None, mod_name: str, module: nn.Module
    ) -> styles.Style | None:
        """The style that runs the module's forward, if it applies to the module's kind."""
        forward = self._style_of(key, mod_name)
        if forward and not forward.applies_to(module):
            self.errors.add(
                "unsupported_style",
                mod_name,
                f"{mod_name}: style {forward.name!r} applies to {forward.wanted_module()}, but "
                f"this module is {type(module).__name__}; give it another style",
            )
            return None
        if forward and forward.name != styles.DEFAULT_STYLE:
            self.module_styles[mod_name] = forward.name
        return forward

    def _style_of(self, key: PlanKey | None, mod_name: str) -> styles.Style | None:
        if key is None:
            return None
        try:
            return styles.canonical(key.style_given)
        except styles.UnsupportedStyle:
            mods = self.unsupported.setdefault(key.style_given, [])
            if mod_name not in mods:
                mods.append(mod_name)
        except styles.UnknownStyle:
            pass  # reported once, for the key
        return None

    def _place(
        self,
        t: _Tensor,
        own_key: PlanKey | None,
        forward_key: PlanKey | None,
        forward: styles.Style | None,
    ) -> TensorPlan:
        """The entry of tensor `t`: its own key's style, else its module's, else replicate."""
        style = self._style_of(own_key, t.module) if own_key else forward
        style = style or styles.STYLES[styles.DEFAULT_STYLE]
        ndim = t.ndim
        cut = style.cut(t.leaf, ndim, t.transposed) if t.kind == "parameter" else styles.Cut(None)
        # a module whose forward uses its parameters as placed needs them all placed its way
        if own_key and forward and forward.places_params:
            if cut.dim != forward.placement_dim(t.leaf, ndim, t.transposed):
                self.errors.add(
                    "conflicting_style",
                    t.name,
                    f"{t.name}: its own style {style.name!r} places it differently from its "
                    f"module's style {forward.name!r}; give both the same style",
                )
        shape = list(t.value.shape)
        if not cut.splits_evenly(shape):
            self.errors.add(
                "unsupported_style",
                t.name,
                f"{t.name}: packed style {style.name!r} needs dim {cut.dim} ({shape[cut.dim]}) "
                f"to split into {cut.parts} equal parts",
            )
            cut = styles.Cut(cut.dim)
        if forward and forward.needs_even_split and cut.dim is not None:
            self._check_expert_split(t.name, shape[cut.dim] // cut.parts, shape[0])
        key = own_key or forward_key
        return self._entry(t, style, key, cut, shape)

    def _check_expert_split(self, name: str, features: int, experts: int) -> None:
        """Experts cut by TP run transformers' experts kernel on every rank's slices; its
        grouped matmul needs equal, aligned slices, so an uneven split is refused before launch
        (the plan itself would follow torch.chunk semantics). `experts`: how many the tensor
        stacks; whole experts per rank is advised only where they split evenly."""
        self.errors.require_divisor_of(features)
        if features % self.world_size == 0:
            return
        module = ".".join("*" if s.isdigit() else s for s in name.split(".")[:-1])
        by_expert = "give each rank whole experts (--experts ep), or " * (
            experts % self.world_size == 0
        )
        self.errors.add(
            "uneven_experts",
            name,
            f"{name}: {features} intermediate features of every expert cannot be split evenly "
            f"over {self.world_size} ranks (transformers' experts kernel needs equal slices): "
            f"{by_expert}keep them whole ({module!r}: 'replicate' in the plan)",
            lists_world_sizes=True,
        )

    def _dtype(self, t: _Tensor) -> torch.dtype:
        """The target dtype, but computed buffers (rotary frequencies) keep the dtype the model
        computes them in, and what the model keeps float32 stays float32."""
        if not (t.value.dtype.is_floating_point and t.persistent):
            return t.value.dtype
        if self.kept_in_float32 and self.kept_in_float32.search(t.name):
            return torch.float32
        return self.target

    def _entry(
        self,
        t: _Tensor,
        style: styles.Style,
        key: PlanKey | None,
        cut: styles.Cut,
        shape: list[int],
    ) -> TensorPlan:
        dtype = self._dtype(t)
        return TensorPlan(
            name=t.name,
            module=t.module,
            style=style.name,
            style_given=key.style_given if key else styles.DEFAULT_STYLE,
            placement=cut.placement,
            global_shape=shape,
            dtype=dtype_name(dtype),
            tied_to=[],
            ranks=cut.rank_shards(shape, self.world_size, dtype.itemsize),
            kind=t.kind,
            origin=t.origin,
            pattern=key.pattern if key else None,
        )
