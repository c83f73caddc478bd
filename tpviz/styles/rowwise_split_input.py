"""`rowwise_split_input` (v4 `rowwise_rep`): rowwise behind a replicated input."""

from __future__ import annotations

from .base import LINEAR, REPLICATE, SHARD_FEATURES, Forward, Style


class RowwiseSplitInput(Style):
    name = "rowwise_split_input"
    summary = "weight columns split; a replicated input is split locally; output all-reduced"
    modules = (LINEAR,)
    weight_dim = 1
    # splitting a replicated input is local: only the output is summed across ranks
    forward = Forward(REPLICATE, SHARD_FEATURES, REPLICATE, collective="all-reduce of the output")
