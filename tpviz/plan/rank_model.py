"""What a rank's copy of the model's code needs beyond its shards, the same on real ranks
(runtime/parallelize.py) and simulated ones (suggest/simulate.py), so that a simulation runs
the code the ranks run."""

from __future__ import annotations

from torch import nn

from ..heads import set_local_kv_groups
from .experts import fit_expert_kernels, local_experts
from .types import ResolvedPlan


def fit_rank_model(model: nn.Module, plan: ResolvedPlan, rank: int) -> dict[str, tuple[int, int]]:
    """Give `rank`'s model its attention's local head ratio (key-value heads replicated) and
    experts a kernel that takes their local widths; returns the experts it holds whole
    (module -> its first expert, how many), for the routes its experts module remaps."""
    set_local_kv_groups(model, plan.local_kv_groups)
    fit_expert_kernels(model, plan, rank)
    return local_experts(plan, rank)
