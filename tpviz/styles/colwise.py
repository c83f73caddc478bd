"""`colwise`: a Linear cut along its output features; the output stays sharded."""

from __future__ import annotations

from .base import LINEAR, REPLICATE, SHARD_FEATURES, Forward, Style


class Colwise(Style):
    name = "colwise"
    summary = (
        "weight rows (output features) split; input replicated; output stays sharded on its "
        "last dim"
    )
    modules = (LINEAR,)
    weight_dim = 0
    bias_sharded = True
    local_output = True
    forward = Forward(REPLICATE, REPLICATE, SHARD_FEATURES, collective="none")
