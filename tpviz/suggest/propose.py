"""Suggested TP plans: candidates from the model's dataflow, kept only where simulated ranks
reproduce the unsharded logits.

The candidates, each a unit with styles to try in turn: first the mixture-of-experts modules
(the cut of their intermediate features that the `tp` layout derives, then whole experts per
rank, then the experts left whole: a plan holds them whatever else it places), then in forward
order:

- an embedding: `embedding_rowwise` (by vocabulary);
- a col/row pair (dataflow.py): `colwise` + `rowwise` (Megatron: one all-reduce), then
  `packed_colwise` + `rowwise` (fused [gate; up] that the forward splits in two), then
  `colwise_gather_output` + `rowwise_split_input` (each weight sharded, every activation the
  model sees whole: for forward code that cannot run on a rank's features);
- any other Linear (the LM head): `colwise_gather_output` (by output features).

A unit's styles are tried on top of the units already kept: resolved for the source (so head
alignment, per-head parameters and tied tensors are checked as for any plan) and for a small
random instance of the model (its config with at most prove.CHECK_LAYERS layers), which runs on
simulated ranks (simulate.py, prove.py) against itself run whole. The first that resolves without
errors and matches is kept; a unit none of whose styles does stays replicated, with the
reasons. Modules sharing a tensor (a tied embedding and head) are one unit.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

from ..inputs import check_world_size
from ..plan import ResolvedPlan, resolve_plan
from ..plan.experts import EP_MODULE, EXPERT_STYLES, TP_MODULE
from ..styles import EMBEDDING, MODULE_NAMES, module_kind
from .dataflow import trace
from .prove import Proof

PAIR_STYLES = (
    ("colwise", "rowwise"),
    ("packed_colwise", "rowwise"),
    ("colwise_gather_output", "rowwise_split_input"),
)


@dataclass
class Decision:
    """What the suggestion does with one unit of modules (patterns) and why."""

    kind: str  # "embedding", "pair" or "linear"
    patterns: list[str]
    styles: dict[str, str]  # pattern -> style kept; empty: replicated
    tried: list[str] = field(default_factory=list)  # why each refused style set failed


@dataclass
class Suggestion:
    """A suggested plan (`plan`, the `{pattern: style}` that `--plan` accepts), resolved for
    the source, with each unit's decision and how much of the decoder layers it shards."""

    plan: dict[str, str]
    resolved: ResolvedPlan
    decisions: list[Decision]
    layers: str  # the decoder layers' prefix, e.g. "model.layers."
    max_abs_diff: float  # simulated ranks against the whole instance
    tolerance: float

    @property
    def decoder_bytes(self) -> int:
        return sum(e.nbytes for e in self.resolved.params if e.name.startswith(self.layers))

    @property
    def decoder_sharded_bytes(self) -> int:
        return sum(
            e.nbytes
            for e in self.resolved.params
            if e.name.startswith(self.layers) and e.placement != "replicate"
        )

    @property
    def decoder_share(self) -> float:
        return self.decoder_sharded_bytes / self.decoder_bytes if self.decoder_bytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        """A plan file (`tp_plan`) with the reasoning beside it (ignored by `--plan`)."""
        return {
            "tp_plan": self.plan,
            "suggestion": {
                "world_size": self.resolved.world_size,
                "decoder_layers": self.layers.rstrip("."),
                "decoder_bytes": self.decoder_bytes,
                "decoder_sharded_bytes": self.decoder_sharded_bytes,
                "decoder_share": round(self.decoder_share, 4),
                "simulated_max_abs_diff": self.max_abs_diff,
                "tolerance": self.tolerance,
                "decisions": [asdict(d) for d in self.decisions],
            },
        }


def suggest_plan(
    source: str | os.PathLike,
    world_size: int,
    model: str | None = None,
    dtype: str | None = None,
    kv_replication: bool = True,
) -> Suggestion:
    """Suggest a TP plan for the model at `source` (a checkpoint or config.json directory).
    `kv_replication=False`: only plans that need no key-value head replicated (as
    `resolve_plan`'s)."""
    world_size = check_world_size(world_size)
    choices: dict[str, Any] = dict(dtype=dtype, model=model, kv_replication=kv_replication)
    proof = Proof.of(
        source,
        world_size,
        model,
        lambda patterns: resolve_plan(source, world_size, patterns, **choices),
        kv_replication=kv_replication,
    )
    instance = proof.instance

    def ep_keys() -> dict[str, str]:  # the keys that give each rank whole experts
        ep = resolve_plan(source, world_size, {}, experts="ep", **choices)
        return dict(ep.patterns)

    kept, decisions, diff = _experts_first(proof, ep_keys)
    for unit in _units(instance, proof.run):
        kind = "+".join(dict.fromkeys(kind for kind, _, _ in unit))
        # parts joined by a shared module name each layer's modules alike: list each once
        patterns = list(dict.fromkeys(n for _, cols, rows in unit for n in cols + rows))
        decision = Decision(kind, patterns, {})
        for styles in _style_sets(unit):
            trial = {**kept, **styles}
            why, d = proof.check(trial)
            if why is None:
                kept, decision.styles, diff = trial, styles, d
                break
            decision.tried.append(f"{', '.join(sorted(set(styles.values())))}: {why}")
        decisions.append(decision)
    resolved = proof.resolve(kept)
    covered = {p for d in decisions for p in d.patterns}
    decisions += _not_candidates(instance, covered)
    # the plan as resolved: the kept keys and those the experts layout derived (experts cut)
    plan = dict(resolved.patterns)
    return Suggestion(plan, resolved, decisions, _layers_prefix(instance), diff, proof.tolerance)


def _experts_first(
    proof: Proof, ep_keys: Callable[[], dict[str, str]]
) -> tuple[dict[str, str], list[Decision], float]:
    """The experts modules, placed before any other unit is tried (a plan gets a TP cut of
    every experts module no key places, so every trial holds them): that cut where simulated
    ranks prove it, else whole experts per rank, else the experts left whole. Returns the
    keys kept, the decision (none without experts) and the proof's difference."""
    derived = proof.resolve({}).module_styles
    modules = sorted({_patterns([n])[0] for n, s in derived.items() if s in EXPERT_STYLES})
    if not modules:
        return {}, [], 0.0
    decision = Decision("experts", modules, {})
    options = [
        (TP_MODULE, lambda: {}),
        (EP_MODULE, ep_keys),
        ("replicate", lambda: dict.fromkeys(modules, "replicate")),
    ]
    for label, keys in options:
        styles = keys()
        why, diff = proof.check(styles)
        if why is None:
            decision.styles = styles or dict.fromkeys(modules, TP_MODULE)
            return styles, [decision], diff
        decision.tried.append(f"{label}: {why}")
    decision.styles = styles
    return styles, [decision], diff  # left whole, with the reasons


Unit = list[tuple[str, list[str], list[str]]]  # parts: (kind, cols, rows), all tried together


def _units(instance: nn.Module, run: Callable) -> list[Unit]:
    """Every candidate unit as patterns, in forward order, each once. Modules that share a
    tensor (a tied embedding and head) are one unit: they must be placed alike."""
    flow = trace(instance, run)
    parts = [
        ("embedding", [n], [])
        for n, m in instance.named_modules()
        if module_kind(m) == EMBEDDING  # an nn.Embedding looking up the ids it is given
    ]
    parts += [("pair", cols, rows) for cols, rows in flow.pairs(instance)]
    paired = {n for kind, cols, rows in parts for n in cols + rows}
    parts += [("linear", [n], []) for n in flow.sources if n not in paired]
    units: list[Unit] = []
    owner: dict[int, Unit] = {}  # parameter id -> the unit holding it
    for part in parts:
        tensors = {id(p) for n in part[1] + part[2] for p in instance.get_submodule(n).parameters()}
        joined = next((owner[t] for t in tensors if t in owner), None)
        if joined is None:
            joined = []
            units.append(joined)
        joined.append(part)
        owner.update(dict.fromkeys(tensors, joined))
    seen: set[str] = set()
    unique = []
    for unit in units:
        named = [(kind, _patterns(cols), _patterns(rows)) for kind, cols, rows in unit]
        names = {n for _, cols, rows in named for n in cols + rows}
        if not seen & names:
            unique.append(named)
            seen |= names
    return unique


def _not_candidates(instance: nn.Module, covered: set[str]) -> list[Decision]:
    """The other modules holding tensors (norms, Conv1D, routers): replicated."""
    found: dict[str, Decision] = {}
    for name, module in instance.named_modules():
        (pattern,) = _patterns([name])
        if pattern in covered or pattern in found or not list(module.parameters(recurse=False)):
            continue
        why = f"{type(module).__name__} is not an nn.Linear or nn.Embedding, the modules cut here"
        if isinstance(module, nn.Embedding):  # one the embedding style cannot cut
            why = f"{type(module).__name__} is not {MODULE_NAMES[EMBEDDING]}"
        found[pattern] = Decision("other", [pattern], {}, [why])
    return list(found.values())


def _patterns(names: list[str]) -> list[str]:
    return [re.sub(r"(?<=\.)\d+(?=\.|$)", "*", n) for n in names]


def _style_sets(unit: Unit) -> list[dict[str, str]]:
    """Each part's styles to try; a unit of several parts tries their combinations."""
    options = []
    for kind, cols, rows in unit:
        if kind == "embedding":
            options.append([{cols[0]: "embedding_rowwise"}])
        elif kind == "linear":
            options.append([{cols[0]: "colwise_gather_output"}])
        else:
            options.append(
                [{**dict.fromkeys(cols, c), **dict.fromkeys(rows, r)} for c, r in PAIR_STYLES]
            )
    return [{k: v for d in combo for k, v in d.items()} for combo in itertools.product(*options)]


def _layers_prefix(model: nn.Module) -> str:
    """The ModuleList holding the most parameters: the decoder layers."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        return ""
    name, _ = max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))
    return f"{name}."
