"""A plan at a glance: each rank's bytes by style, the plan as a table (folded by layer), and
which tensor's block diagram shows the plan best."""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from ...format import count, fold_layers, human_bytes, layer_of, shape_text
from ...plan import ResolvedPlan, TensorPlan
from ...styles import STYLES
from .palette import in_unit, style_color, titled, unit_for


def bytes_by_style_figure(plan: ResolvedPlan) -> go.Figure:
    """Stacked bars of each rank's bytes by style; replicated bytes hatched."""
    w = plan.world_size
    totals = _bytes_by_style(plan)
    order = list(STYLES)
    keys = sorted(totals, key=lambda k: (k[1], order.index(k[0]) if k[0] in order else 99))
    ranks = [f"rank {r}" for r in range(w)]
    unit = unit_for(max(plan.per_rank_bytes, default=0))
    fig = go.Figure()
    for style, replicated in keys:
        row = totals[(style, replicated)]
        fig.add_bar(
            name=f"{style} · replicated" if replicated else style,
            x=ranks,
            y=in_unit(row, unit),
            marker={"color": style_color(style), "pattern": {"shape": "/" if replicated else ""}},
            legendgroup=style,
            customdata=[human_bytes(b) for b in row],
            hovertemplate="%{x}: %{customdata}<extra>%{fullData.name}</extra>",
            meta={"style": style, "replicated": replicated},
        )
    fig.add_scatter(
        x=ranks,
        y=in_unit(plan.per_rank_bytes, unit),
        text=[human_bytes(b) for b in plan.per_rank_bytes],
        mode="text",
        textposition="top center",
        showlegend=False,
        hoverinfo="skip",
        meta={"kind": "totals"},
    )
    fig.update_layout(
        barmode="stack",
        title=titled(
            f"Bytes per rank by style ({plan.dtype}, {w} rank(s))",
            "hatched: replicated, every rank holds a full copy",
        ),
        yaxis={"title": unit},
        legend={"traceorder": "normal"},
        height=380,
        margin={"t": 80, "b": 40},
    )
    return fig


def _bytes_by_style(plan: ResolvedPlan) -> dict[tuple[str, bool], list[int]]:
    """(style, replicated) -> bytes per rank."""
    totals: dict[tuple[str, bool], list[int]] = {}
    for t in plan.params:
        row = totals.setdefault((t.style, t.shard_dim is None), [0] * plan.world_size)
        for shard in t.ranks:
            row[shard.rank] += shard.bytes
    return totals


def representative_tensor(tensors: Sequence[TensorPlan]) -> TensorPlan:
    """The tensor whose diagram shows a plan best: one whose chunks ranks share (replicated
    key-value heads), else an uneven split, else a packed one, else a sharded weight inside a
    layer, else any sharded one, else the first."""
    sharded = [t for t in tensors if t.shard_dim is not None]

    def uneven(t: TensorPlan) -> bool:
        return len({s.bytes for s in t.ranks}) > 1

    for pick in (
        lambda t: t.groups is not None,
        uneven,
        lambda t: sum(len(s.blocks) for s in t.ranks) > len(t.ranks),
        lambda t: layer_of(t.name) is not None and len(t.global_shape) == 2,
    ):
        found = next((t for t in sharded if pick(t)), None)
        if found is not None:
            return found
    return sharded[0] if sharded else tensors[0]


def plan_table_figure(plan: ResolvedPlan) -> go.Figure:
    """The plan as a table; tensors that differ only by layer index fold into one row."""
    groups: dict[tuple, list[TensorPlan]] = {}
    for t in plan.params:
        key = (
            fold_layers(t.name),
            t.style,
            t.placement,
            tuple(t.global_shape),
            tuple(map(tuple, _shapes(t))),
        )
        groups.setdefault(key, []).append(t)
    w = plan.world_size
    columns: list[list[str]] = [[] for _ in range(5 + w)]
    for (name, style, placement, shape, shapes), members in groups.items():
        t = members[0]
        label = name + (f" ×{len(members)}" if len(members) > 1 else "")
        if t.tied_to:
            label += f" (tied: {', '.join(t.tied_to)})"
        cells = [label, style, placement, shape_text(shape), *(shape_text(s) for s in shapes)]
        # the distinct sizes in rank order (a set would order equal-length texts by hash)
        sizes = dict.fromkeys(human_bytes(s.bytes) for s in t.ranks)
        cells.append(" / ".join(sorted(sizes, key=len)))
        for column, cell in zip(columns, cells):
            column.append(cell)
    headers = ["tensor", "style", "placement", "global", *[f"rank {r}" for r in range(w)]]
    fig = go.Figure(
        go.Table(
            header={"values": [*headers, "bytes per rank"], "align": "left"},
            cells={"values": columns[: len(headers) + 1], "align": "left"},
        )
    )
    fig.update_layout(
        title=f"Plan: {count(len(plan.params), 'tensor')}, {human_bytes(plan.total_bytes)} in "
        f"{plan.dtype} over {w} rank(s)",
        height=120 + 28 * (len(groups) + 1),
        margin={"t": 50, "b": 10},
    )
    return fig


def _shapes(t: TensorPlan) -> list[list[int]]:
    return [s.shape for s in t.ranks]
