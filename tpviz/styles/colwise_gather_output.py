"""`colwise_gather_output` (v4 `colwise_rep`): colwise, with the output gathered again."""

from __future__ import annotations

from .base import LINEAR, REPLICATE, Forward, Style


class ColwiseGatherOutput(Style):
    name = "colwise_gather_output"
    summary = "weight rows split; output all-gathered so every rank sees all features"
    modules = (LINEAR,)
    weight_dim = 0
    bias_sharded = True
    forward = Forward(REPLICATE, REPLICATE, REPLICATE, collective="all-gather of the output")
