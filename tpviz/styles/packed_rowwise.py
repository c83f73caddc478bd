"""`packed_rowwise`: a fused weight packed along its input features (e.g. experts' gate_up_proj
stored (experts, hidden, 2 * intermediate)), one block of every part a rank."""

from __future__ import annotations

from .base import Style


class PackedRowwise(Style):
    name = "packed_rowwise"
    summary = (
        "fused weight packed along its last dim split part by part; a rank holds one block of "
        "every part (a tensor's own style: its module's style runs the forward)"
    )
    weight_dim = 1
    packed_parts = 2
    # no forward: the tensor is placed by its own key inside a module (moe_tp_experts) that
    # computes on plain local tensors
