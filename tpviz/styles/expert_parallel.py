"""`ep_dispatch_experts` and `grouped_gemm`: expert parallelism, whole experts per rank (the
names of transformers' `base_model_ep_plan`)."""

from __future__ import annotations

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
