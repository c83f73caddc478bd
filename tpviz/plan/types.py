"""The plan's JSON types: what every rank holds of every tensor, and the plan's issues.
(`RankShard` and `Block`, what one rank holds, live with the chunk math in chunks.py.)

Plain data; `ResolvedPlan.to_json()` is the plan JSON of the README, and the ranks execute
the object `from_json` gives back.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ..checkpoint import torch_dtype
from ..chunks import Block, RankShard
from ..keymap import Source
from ..styles import REPLICATE, is_bias


class PlanError(ValueError):
    """A plan that cannot be executed; `errors` are the plan's error entries."""

    def __init__(self, errors: list[PlanIssue]):
        self.errors = errors
        first = errors[0].message if errors else "invalid plan"
        n = sum(e.count for e in errors) - 1
        # said apart from the first message, whose own list (world sizes) it must not extend
        more = f"; and {n} more plan error{'s' if n > 1 else ''}" if n else ""
        super().__init__(first + more)


@dataclass(slots=True)
class TensorPlan:
    name: str
    module: str
    style: str
    style_given: str
    placement: str  # "replicate", "shard(D)" or "shard(D, groups=G)"
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
        return None if self.placement == "replicate" else int(_shard_args(self.placement)[0])

    @property
    def groups(self) -> int | None:
        """G of `shard(D, groups=G)`: chunks each held by world_size/G consecutive ranks."""
        args = _shard_args(self.placement) if self.placement != "replicate" else ()
        return int(args[1].partition("=")[2]) if len(args) > 1 else None

    @property
    def nbytes(self) -> int:
        return math.prod(self.global_shape) * torch_dtype(self.dtype).itemsize

    def source_nbytes(self, elements: int | None = None) -> int:
        n = math.prod(self.global_shape) if elements is None else elements
        return n * torch_dtype(self.source_dtype or self.dtype).itemsize


def _shard_args(placement: str) -> list[str]:
    """["D"] of "shard(D)", ["D", "groups=G"] of "shard(D, groups=G)"."""
    return [a.strip() for a in placement[6:-1].split(",")]


@dataclass(slots=True)
class PlanIssue:
    code: str
    name: str
    message: str
    count: int = 1  # the issues it stands for: one, or those past the listed ones of its code


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
    # the plan keys the caller gave, before resolution added or rewrote expert keys; None for
    # the model's default plan: what to resolve again for another world size, dtype or source
    # (resolving the default plan's keys as the caller's would warn of keys a variant lacks)
    given_patterns: dict[str, str] | None = None
    # attention module -> query heads per key-value head on each rank, where the key-value
    # heads are replicated (its `num_key_value_groups` on the ranks)
    local_kv_groups: dict[str, int] = field(default_factory=dict)
    experts: str = "tp"  # mixture-of-experts layout: "tp" (cut by the plan) or "ep" (whole)
    kv_replication: bool = True  # as resolved: key-value heads replicated past their count

    def tensor(self, name: str) -> TensorPlan:
        if not hasattr(self, "_by_name"):
            self._by_name = {}
            for t in self.params:
                self._by_name.update(dict.fromkeys([t.name, *t.tied_to], t))
        return self._by_name[name]

    def replicated_biases(self, module: str) -> list[str]:
        """The leaves of `module`'s biases that every rank holds whole: where the module's
        ranks each compute one term of a sum (experts cut by TP), rank 0 alone adds them."""
        return [
            leaf
            for t in self.params
            if t.module == module
            and t.placement == REPLICATE
            and is_bias(leaf := t.name.rpartition(".")[2])
        ]

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
