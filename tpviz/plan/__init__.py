"""The TP plan: patterns (patterns.py) resolved against a model (resolve.py), checked
(issues.py), into plain JSON-serialisable data (types.py) that the ranks execute; with each
loading strategy's forecast (forecast.py).
"""

from ..chunks import Block, chunk_offsets, chunk_sizes, local_shape, shard_blocks
from .forecast import (
    STRATEGIES,
    Forecast,
    Ledger,
    forecast,
    needs_staging,
    read_pieces,
    sends_a_view,
    staged_reads,
)
from .patterns import CompiledPlan, load_plan_patterns
from .resolve import resolve_plan
from .types import PlanError, PlanIssue, RankShard, ResolvedPlan, TensorPlan

__all__ = [
    "STRATEGIES",
    "Block",
    "CompiledPlan",
    "Forecast",
    "Ledger",
    "PlanError",
    "PlanIssue",
    "RankShard",
    "ResolvedPlan",
    "TensorPlan",
    "chunk_offsets",
    "chunk_sizes",
    "forecast",
    "load_plan_patterns",
    "local_shape",
    "needs_staging",
    "read_pieces",
    "resolve_plan",
    "sends_a_view",
    "shard_blocks",
    "staged_reads",
]
