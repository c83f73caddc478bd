"""The TP plan: patterns (patterns.py) resolved against a model (resolve.py), checked
(issues.py), into plain JSON-serialisable data (types.py) that the ranks execute; each loading
strategy's forecast comes from tpviz.strategies.
"""

from ..chunks import Block, chunk_offsets, chunk_sizes, local_shape, shard_blocks
from ..strategies import STRATEGIES, Forecast, Ledger, forecast
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
    "resolve_plan",
    "shard_blocks",
]
