"""Plan patterns -> ResolvedPlan: which style each tensor gets and what every rank holds.

Pure: a meta skeleton and checkpoint headers in, plain JSON-serialisable data out. The walk
(walk.py) places every tensor; the checks that need all of them (heads, checkpoint keys,
replication) run after it.
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

from ..checkpoint import Checkpoint, dtype_name, torch_dtype
from ..choices import COMPUTE_DTYPES
from ..inputs import check_path_argument, check_world_size
from ..models import ModelAdapter, adapter_for_module, build_skeleton, get_adapter, read_config
from ..models.config import check_unquantized, config_dtype, naming_config_file
from ..strategies import STRATEGIES, forecast
from .experts import (
    check_expert_parallel,
    check_expert_tensor_parallel,
    check_layout,
    expert_count,
    expert_parallel_plan,
    expert_tensor_parallel_plan,
    find_experts,
)
from .issues import (
    PlanIssues,
    check_heads,
    report_unmatched,
    report_unsupported,
    warn_if_mostly_replicated,
)
from .match import match_checkpoint
from .patterns import CompiledPlan, load_plan_patterns
from .types import ResolvedPlan, TensorPlan
from .walk import Walk


def resolve_plan(
    source: str | os.PathLike | nn.Module,
    world_size: int,
    plan: Mapping[str, str] | str | os.PathLike | ResolvedPlan | None = None,
    dtype: str | torch.dtype | None = None,
    model: str | None = None,
    checkpoint: str | os.PathLike | None = None,
    kv_replication: bool = True,
    experts: str | None = None,
) -> ResolvedPlan:
    """Resolve a TP plan against a model and (optionally) its checkpoint, allocating nothing.

    `source` is a checkpoint directory or file, a directory holding only config.json, or an
    `nn.Module` (meta is fine) with an optional `checkpoint`. `plan` defaults to the model
    family's plan. With more ranks than key-value heads, `kv_replication` replicates each
    key-value head over the ranks that use it (False: a `head_alignment` error). `experts`:
    "tp" (default) places mixture-of-experts tensors as the plan says; "ep" gives every rank
    whole experts (expert parallelism), the rest as the plan says; None with a ResolvedPlan: as
    it was resolved. Problems are returned in `errors` / `warnings`, not raised.
    """
    world_size = check_world_size(world_size)
    _check_arguments(source, model, checkpoint, kv_replication)
    if experts is not None:
        check_layout(experts)
    if isinstance(plan, ResolvedPlan):
        _check_resolved(plan, source, world_size, dtype, model, experts)
        return plan
    with _gc_paused():
        return _resolve_source(
            source, world_size, plan, dtype, model, checkpoint, kv_replication, experts or "tp"
        )[0]


def _check_arguments(
    source: object, model: object, checkpoint: object, kv_replication: object
) -> None:
    """The arguments' kinds, said by name (an int source would be read as a file descriptor,
    "no" as true)."""
    if not isinstance(source, nn.Module):
        check_path_argument(
            "source", source, "a checkpoint's path (str or os.PathLike) or an nn.Module"
        )
    if checkpoint is not None:
        check_path_argument("checkpoint", checkpoint, "a checkpoint's path (str or os.PathLike)")
    if model is not None and not isinstance(model, str):
        raise ValueError(
            f"model must be a name (auto, builtin, hf, hf-remote-code or PKG.MOD:FN), not {model!r}"
        )
    if not isinstance(kv_replication, bool):
        raise ValueError(f"kv_replication must be True or False, not {kv_replication!r}")


def _check_resolved(
    plan: ResolvedPlan,
    source: str | os.PathLike | nn.Module,
    world_size: int,
    dtype: str | torch.dtype | None,
    model: str | None,
    experts: str | None,
) -> None:
    """A plan already resolved is executed as it is: refuse arguments it contradicts, rather
    than load other weights or another dtype than the ones asked for."""
    asked = {
        "world size": (world_size, plan.world_size),
        "experts": (experts, plan.experts),
        "model": (None if model == "auto" else model, plan.model),
        "dtype": (
            dtype and dtype_name(torch_dtype(dtype) if isinstance(dtype, str) else dtype),
            plan.dtype,
        ),
    }
    if not isinstance(source, nn.Module) and plan.source is not None:
        asked["source"] = (str(Path(source).resolve()), plan.source)
    for what, (given, resolved) in asked.items():
        if given is not None and given != resolved:
            raise ValueError(
                f"the plan was resolved for {what} {resolved}, not {given}: resolve it again "
                "(or pass the plan's own)"
            )


def resolve_and_keep(
    source: str | os.PathLike,
    world_size: int,
    plan: Mapping[str, str] | str | os.PathLike | None = None,
    dtype: str | torch.dtype | None = None,
    model: str | None = None,
    kv_replication: bool = True,
    experts: str | None = None,
) -> tuple[ResolvedPlan, SourceModel]:
    """`resolve_plan` of a checkpoint (or config) directory that also hands back what it
    read: a process that goes on to load the source (load_sharded's rank 0) then builds the
    skeleton and reads the headers once, not twice."""
    experts = experts or "tp"
    check_layout(experts)
    with _gc_paused():
        return _resolve_source(
            source, world_size, plan, dtype, model, None, kv_replication, experts
        )


@dataclass
class SourceModel:
    """What resolution reads: the meta skeleton, its adapter and config, the checkpoint."""

    skeleton: nn.Module
    adapter: ModelAdapter
    config: dict[str, Any]
    ckpt: Checkpoint | None
    source: str | None  # the resolved source path; None for a module given directly
    dtype: torch.dtype  # the target dtype: of the plan, and the skeleton's build


def read_source(
    source: str | os.PathLike,
    model: str | None,
    weights: str | os.PathLike | None,
    dtype: str | torch.dtype | None = None,
) -> SourceModel:
    """What resolving or loading a checkpoint (or config) directory reads first: its config,
    the adapter `model` chooses for it, the headers of the checkpoint at `weights` (None: none
    read), and the meta skeleton built for the target dtype (`dtype`, else the source's)."""
    # the weights first: a file that is no checkpoint is said so, not that no config is beside it
    ckpt = Checkpoint.open(weights) if weights is not None else None
    config = read_config(source)
    with naming_config_file(source):
        adapter = get_adapter(config, model, source)
        if ckpt is not None and ckpt.has_weights:
            check_unquantized(config, ckpt.path)
        target = _target_dtype(dtype, config, ckpt)
        skeleton = build_skeleton(adapter, config, target)
    return SourceModel(skeleton, adapter, config, ckpt, str(Path(source).resolve()), target)


def _resolve_source(
    source: str | os.PathLike | nn.Module,
    world_size: int,
    plan: Mapping[str, str] | str | os.PathLike | None,
    dtype: str | torch.dtype | None,
    model: str | None,
    checkpoint: str | os.PathLike | None,
    kv_replication: bool,
    experts: str,
) -> tuple[ResolvedPlan, SourceModel]:
    if isinstance(source, nn.Module):
        adapter = adapter_for_module(source)
        ckpt = Checkpoint.open(checkpoint) if checkpoint is not None else None
        config = adapter.config_of(source)
        target = _target_dtype(dtype, config, ckpt)
        found = SourceModel(source, adapter, config, ckpt, None, target)
    else:
        weights = checkpoint if checkpoint is not None else source
        found = read_source(source, model, weights, dtype)
    patterns = load_plan_patterns(plan)
    given = patterns is not None
    if not given:
        patterns = found.adapter.default_plan(found.skeleton)
    resolved = _resolve(found, world_size, patterns, kv_replication, experts, given)
    resolved.given_patterns = dict(patterns) if given else None
    return resolved, found


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
    if dtype is not None:
        if not isinstance(dtype, (str, torch.dtype)) or dtype == "":
            raise ValueError(
                f"dtype must be a name such as 'bfloat16' or a torch.dtype, not {dtype!r}"
            )
        name = dtype_name(dtype) if isinstance(dtype, torch.dtype) else dtype
        return _computable(name.removeprefix("torch."), f"dtype {name}")
    declared = config_dtype(config)
    if declared and declared != "auto":
        return _computable(declared, f"config.json's dtype {declared}", " with --dtype (dtype=)")
    if ckpt and ckpt.has_weights:
        floats = [t.dtype for t in ckpt.tensors.values() if torch_dtype(t.dtype).is_floating_point]
        if floats:
            common = max(set(floats), key=floats.count)
            return _computable(common, f"the weights' dtype {common}", " with --dtype (dtype=)")
    return torch.float32


def _computable(name: str, what: str, how: str = "") -> torch.dtype:
    """The dtype `name` if a model can compute in it: fp8 weights, say, are a quantised
    format whose scales tpviz does not apply, and no CPU kernel computes in them."""
    if name not in COMPUTE_DTYPES:
        raise ValueError(
            f"{what}: a model computes in {', '.join(COMPUTE_DTYPES)}; choose one{how}"
        )
    return torch_dtype(name)


def _resolve(
    found: SourceModel,
    world_size: int,
    patterns: Mapping[str, str],
    kv_replication: bool,
    experts: str,
    given: bool,
) -> ResolvedPlan:
    """`patterns` resolved against the model; `given`: a plan the caller chose, whose keys
    that match nothing are warned about. A model's default plan is written for every variant
    of its architecture (transformers' `base_model_tp_plan`): its keys for modules this
    variant lacks (the dense MLP of an all-sparse MoE, the q_proj of a low-rank query) are no
    mistake of the caller's."""
    _check_world_size_fits(found.skeleton, world_size)
    issues = PlanIssues()
    moes = find_experts(found.skeleton, patterns, expert_count(found.config))
    if experts == "ep":
        patterns = _expert_parallel(found, patterns, moes, issues)
    else:
        patterns = expert_tensor_parallel_plan(patterns, found.skeleton, moes, issues.warnings)
    compiled = CompiledPlan(patterns)
    for issue in compiled.errors:
        issues.errors.add(issue.code, issue.name, issue.message)
    kept = found.adapter.kept_in_float32(found.skeleton, found.dtype)
    walk = Walk(compiled, world_size, found.dtype, issues.errors, kept)
    for mod_name, module in found.skeleton.named_modules():
        walk.visit(mod_name, module)
    report_unsupported(walk.unsupported, issues.errors)
    if given:
        modules = [name for name, _ in found.skeleton.named_modules()]
        report_unmatched(compiled, modules, issues.warnings)
    counts = found.adapter.head_counts(found.config)
    kv_groups = check_heads(
        found.skeleton, counts, walk.entries, walk.module_styles, world_size, issues, kv_replication
    )
    check_expert_parallel(walk.entries, walk.module_styles, world_size, issues.errors)
    check_expert_tensor_parallel(
        found.skeleton, moes, walk.entries, walk.module_styles, issues.errors
    )
    _check_checkpoint(found, walk.entries, issues)
    warn_if_mostly_replicated(walk.entries, world_size, issues.warnings)
    plan = _plan(found, walk, world_size, patterns, issues)
    plan.local_kv_groups = kv_groups
    plan.experts = experts
    plan.kv_replication = kv_replication
    return plan


def _check_world_size_fits(skeleton: nn.Module, world_size: int) -> None:
    """Refuse, before planning (whose work grows with ranks x tensors), a world size larger
    than every dimension of every tensor: no style could give each rank a part of anything."""
    largest = max((max(t.shape, default=1) for t in skeleton.state_dict().values()), default=1)
    if world_size > largest:
        raise ValueError(
            f"world size {world_size} is larger than every dimension of the model's tensors "
            f"(the largest is {largest}), so no tensor can be cut over that many ranks; use at "
            f"most {largest}"
        )


def _expert_parallel(
    found: SourceModel,
    patterns: Mapping[str, str],
    moes: Mapping[str, list[str]],
    issues: PlanIssues,
) -> Mapping[str, str]:
    """The plan with whole experts per rank, or as given (with a warning) without experts."""
    if not moes:
        issues.warnings.add(
            "no_experts",
            "",
            "experts='ep': no experts module found (none follows transformers' experts "
            "interface and is given an experts style or holds stacked tensors whose first dim "
            "is the config's expert count); planned as given",
        )
        return patterns
    return expert_parallel_plan(patterns, found.skeleton, moes)


def _check_checkpoint(found: SourceModel, entries: list[TensorPlan], issues: PlanIssues) -> None:
    """Files the checkpoint skips, and each loaded tensor's keys checked against the headers."""
    ckpt = found.ckpt
    if ckpt is None:
        return
    for why in dict.fromkeys(ckpt.unused.values()):  # one warning per reason
        files = [file for file, reason in ckpt.unused.items() if reason == why]
        named = files[0] if len(files) == 1 else f"{{{files[0]}, ... ({len(files)} files)}}"
        issues.warnings.add(
            "unused_weights",
            files[0],
            f"{ckpt.path}/{named}: {why}; planned without {'it' if len(files) == 1 else 'them'}",
        )
    if ckpt.has_weights:
        shapes = {k: info.shape for k, info in ckpt.tensors.items()}
        keymap = found.adapter.checkpoint_map(found.skeleton, shapes)
        advice = _advice_on_missing(found)
        match_checkpoint(entries, ckpt, keymap, issues.errors, issues.warnings, advice)


def _advice_on_missing(found: SourceModel) -> str:
    """What to do about tensors the checkpoint lacks: where config.json names another class
    than the one built, say so (a base model's checkpoint lacks the LM head a causal LM
    reads)."""
    named = found.config.get("architectures")
    built = type(found.skeleton).__name__
    if not isinstance(named, list) or not named or built in named:
        return "check that the checkpoint matches config.json (or pass --model)"
    return (
        f"config.json names {', '.join(map(str, named))}, and tpviz builds {built} (a model "
        f"that makes logits): use a checkpoint saved from {built} (or pass --model)"
    )


def _plan(
    found: SourceModel,
    walk: Walk,
    world_size: int,
    patterns: Mapping[str, str],
    issues: PlanIssues,
) -> ResolvedPlan:
    entries = walk.entries
    plan = ResolvedPlan(
        world_size=world_size,
        dtype=dtype_name(found.dtype),
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
    if not plan.errors:  # a plan with errors never runs: nothing to forecast
        init = "checkpoint" if plan.has_weights else "random"
        plan.forecast = {s: forecast(plan, s, init=init).to_dict() for s in STRATEGIES}
    return plan
