"""A mixture-of-experts layer per rank: an experts x ranks grid of what each rank holds of each
expert (the whole expert under EP, a slice of every expert under TP), with the MoE block's
other modules (router, shared experts) as rows below it."""

from __future__ import annotations

import math

import plotly.graph_objects as go

from ...checkpoint import torch_dtype
from ...format import human_bytes
from ...plan import ResolvedPlan, TensorPlan
from ...plan.experts import EXPERT_STYLES
from .palette import titled


def experts_modules(plan: ResolvedPlan) -> list[str]:
    """The experts modules of the plan, in model order (`moe_tp_experts` or
    `ep_dispatch_experts`)."""
    return [m for m, style in plan.module_styles.items() if style in EXPERT_STYLES]


def expert_bytes(plan: ResolvedPlan, module: str) -> list[list[int]]:
    """[expert][rank]: bytes of the experts module's stacked tensors each rank holds of each
    expert, from the blocks the plan gives it."""
    stacked = [t for t in plan.params if t.module == module and t.global_shape]
    count = max((t.global_shape[0] for t in stacked if len(t.global_shape) >= 3), default=0)
    held = [[0] * plan.world_size for _ in range(count)]
    for t in stacked:
        if t.global_shape[0] != count:
            continue
        itemsize = torch_dtype(t.dtype).itemsize
        for shard in t.ranks:
            for block in shard.blocks:
                per_expert = math.prod(block.shape[1:]) * itemsize
                start = block.offset[0]
                for expert in range(start, start + block.shape[0]):
                    held[expert][shard.rank] += per_expert
    return held


def _siblings(plan: ResolvedPlan, module: str) -> dict[str, list[TensorPlan]]:
    """The MoE block's other children (router, shared experts) -> their tensors."""
    block = module.rpartition(".")[0]
    prefix = f"{block}." if block else ""
    rows: dict[str, list[TensorPlan]] = {}
    for t in plan.params:
        if t.module.startswith(prefix) and not (t.module + ".").startswith(module + "."):
            child = t.module[len(prefix) :].split(".")[0]
            rows.setdefault(child, []).append(t)
    return rows


def experts_grid_figure(plan: ResolvedPlan, module: str) -> go.Figure:
    """Heat map: one row per expert and per sibling module, one column per rank; the colour is
    the share of the row's bytes the rank holds, the text its bytes."""
    labels, shares, texts = [], [], []
    for expert, row in enumerate(expert_bytes(plan, module)):
        whole = sum(row)  # each expert is held once over the ranks, whole or in slices
        labels.append(f"expert {expert}")
        shares.append([b / whole if whole else 0 for b in row])
        texts.append([human_bytes(b) if b else "—" for b in row])
    for child, tensors in _siblings(plan, module).items():
        total = sum(t.nbytes for t in tensors)
        row = [sum(t.ranks[r].bytes for t in tensors) for r in range(plan.world_size)]
        styles = sorted({t.style for t in tensors})
        labels.append(f"{child} ({', '.join(styles)})")
        shares.append([b / total if total else 0 for b in row])
        texts.append([human_bytes(b) for b in row])
    layout = "whole experts per rank (EP)" if plan.experts == "ep" else "a slice of every expert"
    fig = go.Figure(
        go.Heatmap(
            z=shares,
            x=[f"rank {r}" for r in range(plan.world_size)],
            y=labels,
            text=texts,
            texttemplate="%{text}",
            zmin=0,
            zmax=1,
            colorscale="Blues",
            colorbar={"title": "share held"},
            hovertemplate="%{y} on %{x}: %{text} (%{z:.0%} of it)<extra></extra>",
            meta={"module": module, "experts": plan.experts},
        )
    )
    fig.update_layout(
        title=titled(f"{module}: experts x ranks", f"{layout}; router and shared experts below"),
        yaxis={"autorange": "reversed"},
        height=max(260, 28 * len(labels) + 120),
        margin={"t": 80, "b": 40},
    )
    return fig
