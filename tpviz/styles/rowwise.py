"""`rowwise`: a Linear cut along its input features; the partial outputs are summed."""

from __future__ import annotations

from .base import LINEAR, REPLICATE, SHARD_FEATURES, Forward, Style


class Rowwise(Style):
    name = "rowwise"
    summary = (
        "weight columns (input features) split, bias replicated and added once; input sharded "
        "on its last dim; output all-reduced"
    )
    modules = (LINEAR,)
    weight_dim = 1
    local_input = True
    forward = Forward(
        SHARD_FEATURES, SHARD_FEATURES, REPLICATE, collective="all-reduce of the output"
    )
