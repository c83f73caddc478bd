"""`moe_tp_experts` and `moe_identity_expert`: a mixture-of-experts block under TP, every
rank holding its slice of every expert (tensor parallelism, not expert parallelism)."""

from __future__ import annotations

from .base import EXPERTS, PARTIAL, REPLICATE, Forward, Style


class MoeTpExperts(Style):
    name = "moe_tp_experts"
    summary = (
        "experts module: each rank runs its slice of every expert (tensors placed by their own "
        "keys, e.g. packed_colwise / rowwise) on a replicated input; a replicated output bias "
        "added by rank 0 alone; partial outputs all-reduced"
    )
    modules = (EXPERTS,)
    places_params = False
    # transformers' experts kernel (a grouped matmul) needs equal slices on every rank
    needs_even_split = True
    # the router is replicated, so every rank picks the same experts; a rank's output is its
    # term of the sum over the cut intermediate features
    forward = Forward(REPLICATE, PARTIAL, REPLICATE, collective="all-reduce of the output")


class MoeIdentityExpert(Style):
    name = "moe_identity_expert"
    summary = (
        "an identity expert inside moe_tp_experts: its replicated input divided by the world "
        "size, so the experts' all-reduce adds it once"
    )
    forward = Forward(PARTIAL, PARTIAL, PARTIAL, collective="none")
