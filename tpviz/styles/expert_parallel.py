"""`ep_dispatch_experts` and `grouped_gemm`: expert parallelism, whole experts per rank (the
names of transformers' `base_model_ep_plan`)."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from .base import EXPERTS, PARTIAL, REPLICATE, ROUTED, Forward, Style


class GroupedGemm(Style):
    name = "grouped_gemm"
    summary = (
        "stacked expert tensor (experts, ...) cut along its expert dim: a rank holds whole "
        "experts (a tensor's own style: its module's style runs the forward)"
    )

    def placement_dim(self, param_name: str, ndim: int, transposed: bool = False) -> int | None:
        """Every stacked expert tensor, weights and biases alike, is cut along dim 0: the
        experts."""
        return 0 if ndim >= 1 else None


class EpDispatchExperts(Style):
    name = "ep_dispatch_experts"
    summary = (
        "experts module under expert parallelism: the replicated router's choice is remapped "
        "to each rank's own experts (others masked), and the partial outputs all-reduced"
    )
    modules = (EXPERTS,)
    places_params = False
    # every rank holds the same tokens and the same routing; a rank's output is the sum of its
    # own experts' weighted outputs, one term of the sum over all experts
    forward = Forward(ROUTED, PARTIAL, REPLICATE, collective="all-reduce of the output")


def route_to_local_experts(module: nn.Module, first: int, count: int) -> None:
    """An experts module made to run only this rank's experts `first`..`first + count`.

    Every rank gets the whole batch and the replicated router's choice (global expert ids);
    the pre-hook makes them local ids, and a route to another rank's expert gets the id
    `count` with weight 0: transformers' expert-parallel convention, whose experts kernels skip
    that id when the module is marked expert-parallel (`num_experts` = its local count,
    `_is_expert_parallel`). Each token's output is then this rank's term of the sum over all
    experts, which the all-reduce after the module completes: exact, with no tokens moved."""
    if hasattr(module, "num_experts"):
        module.num_experts = count
    if hasattr(module, "_is_expert_parallel"):
        module._is_expert_parallel = True
    # (hidden_states, expert ids, routing weights), passed by position or by name
    signature = inspect.signature(module.forward)
    _, ids_arg, weights_arg = list(signature.parameters)[:3]

    def route(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        bound = signature.bind(*args, **kwargs)
        local = bound.arguments[ids_arg] - first
        elsewhere = (local < 0) | (local >= count)
        bound.arguments[ids_arg] = torch.where(elsewhere, count, local)
        bound.arguments[weights_arg] = bound.arguments[weights_arg].masked_fill(elsewhere, 0)
        return bound.args, bound.kwargs

    module.register_forward_pre_hook(route, with_kwargs=True)
