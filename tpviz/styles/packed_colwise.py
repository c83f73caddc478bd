"""`packed_colwise`: colwise over a fused weight ([gate; up]), one block of every part a rank."""

from __future__ import annotations

from .base import LINEAR, Style


class PackedColwise(Style):
    name = "packed_colwise"
    summary = (
        "fused weight (e.g. [gate; up]) split part by part along its rows; a rank holds one "
        "block of every part; output stays sharded"
    )
    modules = (LINEAR,)
    weight_dim = 0
    bias_sharded = True
    packed_parts = 2
    local_output = True
    # no forward placements: a rank's blocks are not one DTensor shard, so the module runs an
    # ordinary matmul on its plain local tensors and its output stays local, as colwise's
