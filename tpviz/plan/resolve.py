"""Plan patterns -> ResolvedPlan: which style each tensor gets and what every rank holds.

Pure: a meta skeleton and checkpoint headers in, plain JSON-serialisable data out. The walk
visits the skeleton's modules in order; a module's style comes from its weight's key or its
own key, a tensor's from its own key or its module's; the style's cut says what each rank
holds. Checks that need the whole walk (heads, checkpoint keys, replication) run after it.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import styles
from ..checkpoint import Checkpoint, dtype_name, torch_dtype
from ..keymap import match_checkpoint
from ..models import ModelAdapter, adapter_for_module, build_skeleton, get_adapter, read_config
from ..models.config import config_dtype
from .forecast import STRATEGIES, forecast
from .issues import (
    Issues,
    PlanIssues,
    check_heads,
    check_tie,
    report_unmatched,
    report_unsupported,
    warn_if_mostly_replicated,
)
from .patterns import CompiledPlan, PlanKey, load_plan_patterns
from .types import ResolvedPlan, TensorPlan, rank_shards


def resolve_plan(
    source: str | os.PathLike | nn.Module,
    world_size: int,
    plan: Mapping[str, str] | str | os.PathLike | ResolvedPlan | None = None,
    dtype: str | torch.dtype | None = None,
    model: str | None = None,
    checkpoint: str | os.PathLike | None = None,
) -> ResolvedPlan:
    """Resolve a TP plan against a model and (optionally) its checkpoint, allocating nothing.

    `source` is a checkpoint directory or file, a directory holding only config.json, or an
    `nn.Module` (meta is fine) with an optional `checkpoint`. `plan` defaults to the model
    family's plan. Problems are returned in `errors` / `warnings`, not raised.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be a positive integer, got {world_size!r}")
    if isinstance(plan, ResolvedPlan):
        if plan.world_size != world_size:
            raise ValueError(
                f"the plan was resolved for world size {plan.world_size}, not {world_size}"
            )
        return plan
    with _gc_paused():
        return _resolve_source(source, world_size, plan, dtype, model, checkpoint)


@dataclass
class _Model:
    """What resolution reads: the meta skeleton, its adapter and config, the checkpoint."""

    skeleton: nn.Module
    adapter: ModelAdapter
    config: dict[str, Any]
    ckpt: Checkpoint | None
    source: str | None  # the resolved source path; None for a module given directly


def _resolve_source(
    source: str | os.PathLike | nn.Module,
    world_size: int,
    plan: Mapping[str, str] | str | os.PathLike | None,
    dtype: str | torch.dtype | None,
    model: str | None,
    checkpoint: str | os.PathLike | None,
) -> ResolvedPlan:
    if isinstance(source, nn.Module):
        adapter = adapter_for_module(source)
        ckpt = Checkpoint.open(checkpoint) if checkpoint is not None else None
        found = _Model(source, adapter, adapter.config_of(source), ckpt, None)
    else:
        config = read_config(source)
        adapter = get_adapter(config, model, source)
        skeleton = build_skeleton(adapter, config)
        ckpt = Checkpoint.open(checkpoint if checkpoint is not None else source)
        found = _Model(skeleton, adapter, config, ckpt, str(Path(source).resolve()))
    patterns = load_plan_patterns(plan)
    if patterns is None:
        patterns = found.adapter.default_plan(found.skeleton)
    target = _target_dtype(dtype, found.config, found.ckpt)
    return _resolve(found, world_size, patterns, target)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Resolution makes tens of thousands of small objects in a burst; right after importing
    torch, the collections they trigger cost more than the resolution itself."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _target_dtype(
    dtype: str | torch.dtype | None, config: dict[str, Any], ckpt: Checkpoint | None
) -> torch.dtype:
    if dtype:
        given = dtype if isinstance(dtype, torch.dtype) else torch_dtype(dtype)
        if not given.is_floating_point:
            raise ValueError(f"dtype {dtype_name(given)}: weights load as a floating-point dtype")
        return given
    declared = config_dtype(config)
    if declared and declared != "auto":
        return torch_dtype(declared)
    if ckpt and ckpt.has_weights:
        floats = [t.dtype for t in ckpt.tensors.values() if torch_dtype(t.dtype).is_floating_point]
        if floats:
            return torch_dtype(max(set(floats), key=floats.count))
    return torch.float32


def _resolve(
    found: _Model, world_size: int, patterns: Mapping[str, str], target: torch.dtype
) -> ResolvedPlan:
    compiled = CompiledPlan(patterns)
    issues = PlanIssues()
    for issue in compiled.errors:
        issues.errors.add(issue.code, issue.name, issue.message)
    walk = _Walk(compiled, world_size, target, issues.errors)
    for mod_name, module in found.skeleton.named_modules():
        walk.visit(mod_name, module)
    report_unsupported(walk.unsupported, issues.errors)
    report_unmatched(compiled, issues.warnings)
    counts = found.adapter.head_counts(found.config)
    check_heads(found.skeleton, counts, walk.entries, walk.module_styles, world_size, issues)
    _check_checkpoint(found, walk.entries, issues)
    warn_if_mostly_replicated(walk.entries, world_size, issues.warnings)
    return _plan(found, walk, world_size, target, patterns, issues)


def _check_checkpoint(found: _Model, entries: list[TensorPlan], issues: PlanIssues) -> None:
    """Files the checkpoint skips, and each loaded tensor's keys checked against the headers."""
    ckpt = found.ckpt
    if ckpt is None:
        return
    for file, why in ckpt.unused.items():
        issues.warnings.add(
            "unused_weights", file, f"{ckpt.path}/{file}: {why}; planned without it"
        )
    if ckpt.has_weights:
        shapes = {k: info.shape for k, info in ckpt.tensors.items()}
        keymap = found.adapter.checkpoint_map(found.skeleton, shapes)
        match_checkpoint(entries, ckpt, keymap, issues.errors)


def _plan(
    found: _Model,
    walk: _Walk,
    world_size: int,
    target: torch.dtype,
    patterns: Mapping[str, str],
    issues: PlanIssues,
) -> ResolvedPlan:
    entries = walk.entries
    plan = ResolvedPlan(
        world_size=world_size,
        dtype=dtype_name(target),
        source=found.source,
        params=entries,
        per_rank_bytes=[sum(e.ranks[r].bytes for e in entries) for r in range(world_size)],
        total_bytes=sum(e.nbytes for e in entries),
        forecast={},
        warnings=issues.warnings.finish(),
        errors=issues.errors.finish(),
        model=found.adapter.name,
        module_styles=walk.module_styles,
        has_weights=bool(found.ckpt and found.ckpt.has_weights),
        patterns=dict(patterns),
    )
    init = "checkpoint" if plan.has_weights else "random"
    plan.forecast = {s: forecast(plan, s, init=init).to_dict() for s in STRATEGIES}
    return plan


@dataclass(slots=True)
class _Tensor:
    """A tensor that a module owns directly, as the walk meets it."""

    name: str  # fully qualified
    module: str
    leaf: str
    value: torch.Tensor  # on meta, or computed (non-persistent buffers)
    kind: str  # "parameter" or "buffer"
    persistent: bool

    @property
    def origin(self) -> str:
        return "checkpoint" if self.persistent else "computed"


def _direct_tensors(mod_name: str, module: nn.Module) -> list[_Tensor]:
    """The tensors `module` owns directly, parameters first."""
    found = [
        _Tensor(_join(mod_name, leaf), mod_name, leaf, p, "parameter", True)
        for leaf, p in module._parameters.items()
        if p is not None
    ]
    for leaf, buf in module._buffers.items():
        if buf is not None:
            persistent = leaf not in module._non_persistent_buffers_set
            found.append(_Tensor(_join(mod_name, leaf), mod_name, leaf, buf, "buffer", persistent))
    return found


def _join(module: str, leaf: str) -> str:
    return f"{module}.{leaf}" if module else leaf


class _Walk:
    """One walk over the skeleton: a TensorPlan per tensor (a tied tensor once), the forward
    style of every module that has one, and the modules given each unexecutable style."""

    def __init__(
        self, compiled: CompiledPlan, world_size: int, target: torch.dtype, errors: Issues
    ) -> None:
        self.compiled = compiled
        self.world_size = world_size
        self.target = target
        self.errors = errors
        self.entries: list[TensorPlan] = []
        self.by_id: dict[int, TensorPlan] = {}  # parameter storage -> its entry, for ties
        self.module_styles: dict[str, str] = {}
        self.unsupported: dict[str, list[str]] = {}  # style given -> modules

    def visit(self, mod_name: str, module: nn.Module) -> None:
        direct = _direct_tensors(mod_name, module)
        if not direct:
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
                dim = forward.placement_dim(t.leaf, t.value.dim()) if forward else None
                check_tie(tied, t.name, dim, self.errors)
                continue
            own_key = None
            if t.kind == "parameter":
                own_key = weight_key if t.leaf == "weight" else self.compiled.best(t.name)
            entry = self._place(t, own_key, forward_key, forward)
            self.entries.append(entry)
            if t.kind == "parameter":
                self.by_id[id(t.value)] = entry

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
        style = (self._style_of(own_key, t.module) if own_key else forward) or styles.STYLES[
            styles.DEFAULT_STYLE
        ]
        ndim = t.value.dim()
        cut = style.cut(t.leaf, ndim) if t.kind == "parameter" else styles.Cut(None)
        if forward and forward.places_params and own_key:
            if cut.dim != forward.placement_dim(t.leaf, ndim):
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
        key = own_key or forward_key
        return self._entry(t, style, key, cut, shape)

    def _entry(
        self,
        t: _Tensor,
        style: styles.Style,
        key: PlanKey | None,
        cut: styles.Cut,
        shape: list[int],
    ) -> TensorPlan:
        # computed buffers (rotary frequencies) keep the dtype the model computes them in
        cast = t.value.dtype.is_floating_point and t.persistent
        dtype = self.target if cast else t.value.dtype
        return TensorPlan(
            name=t.name,
            module=t.module,
            style=style.name,
            style_given=key.style_given if key else styles.DEFAULT_STYLE,
            placement=cut.placement,
            global_shape=shape,
            dtype=dtype_name(dtype),
            tied_to=[],
            ranks=rank_shards(cut, shape, self.world_size, dtype.itemsize),
            kind=t.kind,
            origin=t.origin,
            pattern=key.pattern if key else None,
        )
