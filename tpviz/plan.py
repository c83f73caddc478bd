"""Plan patterns -> ResolvedPlan: which style each tensor gets and what every rank holds.

Pure: a meta skeleton and checkpoint headers in, plain JSON-serialisable data out. The ranks
execute this very object, so the picture a user sees is what gets loaded.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import heads, styles
from .checkpoint import Checkpoint, dtype_name, torch_dtype
from .chunks import Block, local_shape, shard_blocks
from .chunks import chunk_offsets as chunk_offsets  # re-exported
from .chunks import chunk_sizes as chunk_sizes  # re-exported
from .format import fold_layers
from .inputs import read_json
from .keymap import Source, match_checkpoint
from .models import (
    ModelAdapter,
    adapter_for_module,
    build_skeleton,
    get_adapter,
    read_config,
)
from .models.config import config_dtype
from .strategies import STRATEGIES as STRATEGIES  # re-exported
from .strategies import Forecast as Forecast  # re-exported
from .strategies import Ledger as Ledger  # re-exported
from .strategies import forecast

MAX_ISSUES_PER_CODE = 10
MOSTLY_REPLICATED = 0.5  # above this share of replicated bytes, a plan gets a warning


class PlanError(ValueError):
    """A plan that cannot be executed; `errors` are the plan's error entries."""

    def __init__(self, errors: list[PlanIssue]):
        self.errors = errors
        first = errors[0].message if errors else "invalid plan"
        n = len(errors) - 1
        # said apart from the first message, whose own list (world sizes) it must not extend
        more = f"; and {n} more plan error{'s' if n > 1 else ''}" if n else ""
        super().__init__(first + more)


@dataclass(slots=True)
class RankShard:
    rank: int
    shape: list[int]
    bytes: int
    blocks: list[Block]


@dataclass(slots=True)
class TensorPlan:
    name: str
    module: str
    style: str
    style_given: str
    placement: str  # "replicate" or "shard(D)"
    global_shape: list[int]
    dtype: str  # target dtype
    tied_to: list[str]
    ranks: list[RankShard]
    kind: str = "parameter"  # or "buffer"
    origin: str = "checkpoint"  # or "computed" (non-persistent buffers such as inv_freq)
    source_dtype: str | None = None  # dtype in the checkpoint, None without weights
    # checkpoint tensors it is read from: one (its name, a tied alias or a renamed key), or
    # several assembled into it, each filling the box in `sources`, combined as `combine` says
    checkpoint_keys: list[str] = field(default_factory=list)
    sources: list[Source] = field(default_factory=list)
    combine: str | None = None
    pattern: str | None = None  # the plan key that decided the style

    @property
    def shard_dim(self) -> int | None:
        return None if self.placement == "replicate" else int(self.placement[6:-1])

    @property
    def nbytes(self) -> int:
        return math.prod(self.global_shape) * torch_dtype(self.dtype).itemsize

    def source_nbytes(self, elements: int | None = None) -> int:
        n = math.prod(self.global_shape) if elements is None else elements
        return n * torch_dtype(self.source_dtype or self.dtype).itemsize


@dataclass(slots=True)
class PlanIssue:
    code: str
    name: str
    message: str


@dataclass
class ResolvedPlan:
    world_size: int
    dtype: str
    source: str | None
    params: list[TensorPlan]
    per_rank_bytes: list[int]
    total_bytes: int
    forecast: dict[str, dict[str, list[int]]]
    warnings: list[PlanIssue] = field(default_factory=list)
    errors: list[PlanIssue] = field(default_factory=list)
    model: str = "builtin"  # the adapter that built the skeleton
    module_styles: dict[str, str] = field(default_factory=dict)  # module -> forward style
    has_weights: bool = True
    patterns: dict[str, str] = field(default_factory=dict)  # the plan keys that were resolved

    def tensor(self, name: str) -> TensorPlan:
        if not hasattr(self, "_by_name"):
            self._by_name = {}
            for t in self.params:
                self._by_name.update(dict.fromkeys([t.name, *t.tied_to], t))
        return self._by_name[name]

    def units(self) -> list[tuple[str, list[TensorPlan]]]:
        """Units of loading in order: (module, the tensors it loads from the checkpoint)."""
        grouped: dict[str, list[TensorPlan]] = {}
        for t in self.params:
            if t.origin == "checkpoint":
                grouped.setdefault(t.module, []).append(t)
        return list(grouped.items())

    def raise_for_errors(self) -> None:
        if self.errors:
            raise PlanError(self.errors)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ResolvedPlan:
        data = dict(data)
        data["params"] = [
            TensorPlan(
                **{
                    **p,
                    "ranks": [
                        RankShard(**{**r, "blocks": [Block(**b) for b in r["blocks"]]})
                        for r in p["ranks"]
                    ],
                    "sources": [Source(**s) for s in p.get("sources", [])],
                }
            )
            for p in data["params"]
        ]
        data["warnings"] = [PlanIssue(**w) for w in data.get("warnings", [])]
        data["errors"] = [PlanIssue(**e) for e in data.get("errors", [])]
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> ResolvedPlan:
        return cls.from_dict(json.loads(text))


# --- patterns ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Key:
    pattern: str
    style_given: str
    regex: re.Pattern[str]
    specificity: tuple[int, int]  # (explicit indices, length): higher wins


class CompiledPlan:
    """Plan patterns compiled once. `*` matches one numeric path segment; a key matches a name
    that equals it or ends with it at a segment boundary."""

    def __init__(self, patterns: Mapping[str, str]):
        self.keys: list[_Key] = []
        self.errors: list[PlanIssue] = []
        for pattern, style_given in patterns.items():
            if not isinstance(style_given, str):
                self.errors.append(
                    PlanIssue(
                        "invalid_plan",
                        pattern,
                        f"plan key {pattern!r}: style must be a string, got {style_given!r}",
                    )
                )
                continue
            try:
                styles.canonical(style_given)
            except styles.UnknownStyle as e:
                self.errors.append(
                    PlanIssue("unknown_style", pattern, f"plan key {pattern!r}: {e}")
                )
            except styles.UnsupportedStyle:
                pass  # reported per module once we know which modules it hits
            body = r"\.".join(r"\d+" if s == "*" else re.escape(s) for s in pattern.split("."))
            regex = re.compile(rf"(?:^|\.){body}$")
            # explicit layer indices beat wildcards; then the longer pattern wins
            specificity = (sum(seg.isdigit() for seg in pattern.split(".")), len(pattern))
            self.keys.append(_Key(pattern, style_given, regex, specificity))
        self.used: set[str] = set()

    def best(self, name: str) -> _Key | None:
        found = [k for k in self.keys if k.regex.search(name)]
        for k in found:
            self.used.add(k.pattern)
        return max(found, key=lambda k: k.specificity) if found else None


def load_plan_patterns(plan: Mapping[str, str] | str | os.PathLike | None) -> dict[str, str] | None:
    """A pattern dict from a dict or a JSON file (`{pattern: style}` or transformers' form
    `{"tp_plan": {...}, "base_model_tp_plan": {...}}`)."""
    if plan is None:
        return None
    where = "the plan"
    if isinstance(plan, (str, os.PathLike)):
        where = f"plan file {plan}"
        plan = read_json(plan, "plan file", unique_keys=True)
    parts = [plan]
    if isinstance(plan, Mapping) and ("tp_plan" in plan or "base_model_tp_plan" in plan):
        parts = [plan.get("base_model_tp_plan") or {}, plan.get("tp_plan") or {}]
    merged: dict[str, str] = {}
    for part in parts:
        if not isinstance(part, Mapping) or not all(isinstance(k, str) for k in part):
            raise ValueError(
                f"{where}: a plan must be a JSON object of pattern -> style (or transformers' "
                f'{{"tp_plan": {{...}}, "base_model_tp_plan": {{...}}}}), got '
                f"{type(part).__name__} {_short(part)}"
            )
        merged.update(part)
    return merged


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# --- resolution -------------------------------------------------------------------------------


def _module_kind(module: nn.Module) -> str:
    if isinstance(module, nn.Linear):
        return styles.LINEAR
    if isinstance(module, nn.Embedding):
        return styles.EMBEDDING
    return type(module).__name__


class _Issues:
    """Collects issues, keeping at most MAX_ISSUES_PER_CODE of each code plus a count."""

    def __init__(self) -> None:
        self.items: list[PlanIssue] = []
        self.dropped: dict[str, int] = {}

    def add(self, code: str, name: str, message: str) -> None:
        if sum(i.code == code for i in self.items) < MAX_ISSUES_PER_CODE:
            self.items.append(PlanIssue(code, name, message))
        else:
            self.dropped[code] = self.dropped.get(code, 0) + 1

    def finish(self) -> list[PlanIssue]:
        for code, n in self.dropped.items():
            self.items.append(PlanIssue(code, "", f"... and {n} more {code} issue(s)"))
        return self.items


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


def _resolve_source(source, world_size, plan, dtype, model, checkpoint) -> ResolvedPlan:
    if isinstance(source, nn.Module):
        skeleton, source_name = source, None
        adapter = adapter_for_module(source)
        config = adapter.config_of(source)
        ckpt = Checkpoint.open(checkpoint) if checkpoint is not None else None
    else:
        config = read_config(source)
        adapter = get_adapter(config, model, source)
        skeleton = build_skeleton(adapter, config)
        ckpt = Checkpoint.open(checkpoint if checkpoint is not None else source)
        source_name = str(Path(source).resolve())
    patterns = load_plan_patterns(plan)
    if patterns is None:
        patterns = adapter.default_plan(skeleton)
    target = _target_dtype(dtype, config, ckpt)
    return _resolve(skeleton, adapter, config, world_size, patterns, target, ckpt, source_name)


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


def _direct_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor, str, bool]]:
    """(leaf name, tensor, kind, persistent) for tensors `module` owns directly."""
    for leaf, param in module._parameters.items():
        if param is not None:
            yield leaf, param, "parameter", True
    for leaf, buf in module._buffers.items():
        if buf is not None:
            yield leaf, buf, "buffer", leaf not in module._non_persistent_buffers_set


def _resolve(
    skeleton: nn.Module,
    adapter: ModelAdapter,
    config: dict[str, Any],
    world_size: int,
    patterns: Mapping[str, str],
    target: torch.dtype,
    ckpt: Checkpoint | None,
    source: str | None,
) -> ResolvedPlan:
    compiled = CompiledPlan(patterns)
    errors, warnings = _Issues(), _Issues()
    for issue in compiled.errors:
        errors.add(issue.code, issue.name, issue.message)
    entries: list[TensorPlan] = []
    by_id: dict[int, TensorPlan] = {}
    module_styles: dict[str, str] = {}
    unsupported: dict[str, list[str]] = {}

    for mod_name, module in skeleton.named_modules():
        direct = list(_direct_tensors(module))
        if not direct:
            continue
        module_key = compiled.best(mod_name)
        weight_key = (
            compiled.best(_join(mod_name, "weight")) if "weight" in module._parameters else None
        )
        forward_key = weight_key or module_key  # a parameter key beats a module key
        forward = _style_of(forward_key, mod_name, unsupported)
        kind = _module_kind(module)
        if forward and styles.ANY not in forward.modules and kind not in forward.modules:
            wanted = "nn.Linear" if styles.LINEAR in forward.modules else "nn.Embedding"
            errors.add(
                "unsupported_style",
                mod_name,
                f"{mod_name}: style {forward.name!r} applies to {wanted}, but this module is "
                f"{type(module).__name__}; give it another style",
            )
            forward = None
        if forward and forward.name != styles.DEFAULT_STYLE:
            module_styles[mod_name] = forward.name
        for leaf, tensor, tensor_kind, persistent in direct:
            name = _join(mod_name, leaf)
            if tensor_kind == "parameter" and id(tensor) in by_id:
                _tie(by_id[id(tensor)], name, forward, leaf, tensor.dim(), errors)
                continue
            own_key = None
            if tensor_kind == "parameter":
                own_key = weight_key if leaf == "weight" else compiled.best(name)
            key = own_key or forward_key
            style = (_style_of(own_key, mod_name, unsupported) if own_key else forward) or (
                styles.STYLES[styles.DEFAULT_STYLE]
            )
            ndim = tensor.dim()
            dim = style.placement_dim(leaf, ndim) if tensor_kind == "parameter" else None
            if (
                forward
                and forward.places_params
                and own_key
                and dim != forward.placement_dim(leaf, ndim)
            ):
                errors.add(
                    "conflicting_style",
                    name,
                    f"{name}: its own style {style.name!r} places it differently from its "
                    f"module's style {forward.name!r}; give both the same style",
                )
            shape = list(tensor.shape)
            parts = 2 if style.packed and dim is not None else 1
            if parts > 1 and shape[dim] % parts:
                errors.add(
                    "unsupported_style",
                    name,
                    f"{name}: packed style {style.name!r} needs dim {dim} ({shape[dim]}) to split "
                    f"into {parts} equal parts",
                )
                parts = 1
            entry = _entry(
                name,
                mod_name,
                style,
                key.style_given if key else styles.DEFAULT_STYLE,
                shape,
                dim,
                parts,
                tensor,
                target,
                world_size,
                tensor_kind,
                "checkpoint" if persistent else "computed",
                key.pattern if key else None,
            )
            entries.append(entry)
            if tensor_kind == "parameter":
                by_id[id(tensor)] = entry

    for style_name, mods in unsupported.items():
        shown = ", ".join(mods[:3]) + (f" and {len(mods) - 3} more" if len(mods) > 3 else "")
        errors.add(
            "unsupported_style",
            mods[0],
            f"style {style_name!r} is not executable by tpviz (modules: {shown}); give these "
            "modules another style, e.g. replicate",
        )
    for pattern in (k.pattern for k in compiled.keys if k.pattern not in compiled.used):
        warnings.add(
            "unmatched_pattern", pattern, f"plan key {pattern!r} matches no module or tensor"
        )

    cuts = heads.head_cuts(skeleton, module_styles, adapter.head_counts(config))
    for module, message in heads.alignment_errors(cuts, world_size):
        errors.add("head_alignment", module, message)
    found = heads.head_params(skeleton, cuts)
    _place_head_params(found, entries, module_styles, world_size, errors, warnings)
    for file, why in ckpt.unused.items() if ckpt is not None else ():
        warnings.add("unused_weights", file, f"{ckpt.path}/{file}: {why}; planned without it")
    if ckpt is not None and ckpt.has_weights:
        shapes = {k: info.shape for k, info in ckpt.tensors.items()}
        match_checkpoint(entries, ckpt, adapter.checkpoint_map(skeleton, shapes), errors)

    per_rank = [sum(e.ranks[r].bytes for e in entries) for r in range(world_size)]
    _warn_if_mostly_replicated(entries, world_size, warnings)
    plan = ResolvedPlan(
        world_size=world_size,
        dtype=dtype_name(target),
        source=source,
        params=entries,
        per_rank_bytes=per_rank,
        total_bytes=sum(e.nbytes for e in entries),
        forecast={},
        warnings=warnings.finish(),
        errors=errors.finish(),
        model=adapter.name,
        module_styles=module_styles,
        has_weights=bool(ckpt and ckpt.has_weights),
        patterns=dict(patterns),
    )
    init = "checkpoint" if plan.has_weights else "random"
    plan.forecast = {s: forecast(plan, s, init=init).to_dict() for s in STRATEGIES}
    return plan


def _warn_if_mostly_replicated(
    entries: list[TensorPlan], world_size: int, warnings: _Issues
) -> None:
    """A plan that shards nothing, or leaves over half of the bytes whole on every rank, saves
    little memory: say so (transformers gives some architectures no TP plan at all)."""
    total = sum(e.nbytes for e in entries)
    if world_size < 2 or not total:
        return
    replicated = sum(e.nbytes for e in entries if e.shard_dim is None)
    share = replicated / total
    if replicated < total and share <= MOSTLY_REPLICATED:
        return
    what = "the plan shards nothing: " if replicated == total else ""
    warnings.add(
        "mostly_replicated",
        "",
        f"{what}{share:.0%} of the model's bytes ({replicated} of {total}) are replicated, "
        f"so every one of the {world_size} ranks holds them whole; give a plan that shards "
        "the large tensors with --plan FILE.json (plan=...)",
    )


def _join(module: str, leaf: str) -> str:
    return f"{module}.{leaf}" if module else leaf


def _style_of(
    key: _Key | None, mod_name: str, unsupported: dict[str, list[str]]
) -> styles.Style | None:
    if key is None:
        return None
    try:
        return styles.canonical(key.style_given)
    except styles.UnsupportedStyle:
        mods = unsupported.setdefault(key.style_given, [])
        if mod_name not in mods:
            mods.append(mod_name)
    except styles.UnknownStyle:
        pass  # reported once, for the key
    return None


def _tie(first: TensorPlan, name: str, forward, leaf: str, ndim: int, errors: _Issues) -> None:
    """A tensor shared with an earlier one: listed once, and placed the same way."""
    first.tied_to.append(name)
    dim = forward.placement_dim(leaf, ndim) if forward else None
    if dim != first.shard_dim:
        errors.add(
            "tied_mismatch",
            name,
            f"{name} is tied to {first.name}, but its style places it as "
            f"{'replicate' if dim is None else f'shard({dim})'} while {first.name} is "
            f"{first.placement}; tied tensors need styles that place them alike",
        )


def _entry(
    name: str,
    module: str,
    style: styles.Style,
    style_given: str,
    shape: list[int],
    dim: int | None,
    parts: int,
    tensor: torch.Tensor,
    target: torch.dtype,
    world_size: int,
    kind: str,
    origin: str,
    pattern: str | None,
) -> TensorPlan:
    # computed buffers (rotary frequencies) keep the dtype the model computes them in
    cast = tensor.dtype.is_floating_point and origin == "checkpoint"
    dtype = target if cast else tensor.dtype
    ranks = _ranks(shape, dim, parts, world_size, dtype.itemsize)
    return TensorPlan(
        name=name,
        module=module,
        style=style.name,
        style_given=style_given,
        placement="replicate" if dim is None else f"shard({dim})",
        global_shape=shape,
        dtype=dtype_name(dtype),
        tied_to=[],
        ranks=ranks,
        kind=kind,
        origin=origin,
        pattern=pattern,
    )


def _ranks(
    shape: list[int], dim: int | None, parts: int, world_size: int, itemsize: int
) -> list[RankShard]:
    ranks = []
    for rank, blocks in enumerate(shard_blocks(shape, dim, world_size, parts)):
        lshape = local_shape(shape, dim, blocks)
        ranks.append(RankShard(rank, lshape, math.prod(lshape) * itemsize, blocks))
    return ranks


def _place_head_params(
    found: list[heads.HeadParam],
    entries: list[TensorPlan],
    module_styles: dict[str, str],
    world_size: int,
    errors: _Issues,
    warnings: _Issues,
) -> None:
    """Parameters that hold one row per head follow their heads (sharded by head where the
    plan left them whole); a norm spanning all heads of a cut projection is refused."""
    by_name = {e.name: e for e in entries}
    resharded: dict[str, list[TensorPlan]] = {}  # layer-folded name -> entries
    for hp in found:
        entry = by_name.get(hp.name)
        if entry is None:
            continue
        if hp.spans:
            errors.add(
                "head_parameter",
                hp.module,
                f"{hp.module}: {hp.name} {entry.global_shape} spans the features of all heads "
                f"of {hp.cut}, which the plan cuts by head, so no rank can apply it to its own "
                "heads; gather its output instead (colwise_gather_output, and rowwise_split_input "
                "on the output projection)",
            )
        elif entry.placement == "replicate" and module_styles.get(hp.module) in PLAIN_TENSOR_STYLES:
            _shard_rows(entry, world_size)
            module_styles[hp.module] = "local_params"
            resharded.setdefault(fold_layers(hp.name), []).append(entry)
    for folded, found in resharded.items():
        warnings.add(
            "sharded_by_head",
            found[0].name,
            f"{folded} ({len(found)} tensor(s), {found[0].global_shape}) holds one row per "
            "head of a projection the plan cuts by head; tpviz shards it by head too "
            "(shard(0)), so each rank applies its own heads' rows",
        )


# Module styles that compute with their parameters as plain tensors (None: no style given),
# so a parameter re-placed by head is used as the rank's own rows.
PLAIN_TENSOR_STYLES = {None, "replicate", "replicated_with_grad_allreduce", "local_params"}


def _shard_rows(entry: TensorPlan, world_size: int) -> None:
    """Re-place a replicated entry as shard(0), as colwise cuts it (the name given stays)."""
    entry.style = "colwise"
    entry.placement, entry.pattern = "shard(0)", None
    entry.ranks = _ranks(entry.global_shape, 0, 1, world_size, torch_dtype(entry.dtype).itemsize)
