"""One tensor drawn to scale as its ranks hold it: each rank's blocks a rectangle in the rank's
colour, a replicated tensor one hatched rectangle, an empty rank a legend entry. A tensor of 3
or more dims is drawn over dim 0 and the dim it is cut along (or dim 1). A chunk held
whole by several ranks (`shard(D, groups=G)`: replicated key-value heads) is drawn in stripes,
one per rank that holds it, each stripe standing for the whole chunk."""

from __future__ import annotations

import plotly.graph_objects as go

from ...format import human_bytes, shape_text
from ...plan import Block, RankShard, TensorPlan
from .palette import rank_color, titled

Rect = tuple[int, int, int, int]  # x0, x1, y0, y1


def block_diagram_figure(tensor: TensorPlan) -> go.Figure:
    """The tensor drawn to scale, each block a rectangle in its owning rank's colour."""
    ndim = len(tensor.global_shape)
    across = drawn_across(tensor)
    fig = go.Figure()
    if tensor.shard_dim is None:
        fig.add_trace(_replicated_trace(tensor))
    label_x, label_y, labels = [], [], []
    for shard in tensor.ranks if tensor.shard_dim is not None else []:
        if not shard.blocks:
            fig.add_trace(_empty_rank_trace(shard))
            continue
        sharing = sharing_ranks(tensor, shard.rank)
        rects = [
            _stripe(block_rect(b, ndim, across), sharing, shard.rank, ndim) for b in shard.blocks
        ]
        fig.add_trace(_rank_blocks_trace(shard, rects, sharing))
        for i, (x0, x1, y0, y1) in enumerate(rects):
            part = f" · part {i + 1}" if len(rects) > 1 else ""
            label_x.append((x0 + x1) / 2)
            label_y.append((y0 + y1) / 2)
            labels.append(f"rank {shard.rank}{part}<br>{shape_text(shard.blocks[i].shape)}")
    if labels:
        fig.add_scatter(
            x=label_x,
            y=label_y,
            text=labels,
            mode="text",
            textfont={"color": "white"},
            showlegend=False,
            hoverinfo="skip",
            meta={"kind": "label"},
        )
    _block_axes(fig, tensor)
    return fig


def drawn_across(tensor: TensorPlan) -> int:
    """The dim drawn along x (dim 0 goes down): dim 1, or the dim a tensor of 3 or more dims
    is cut along, so that its cut shows (stacked experts cut along their features)."""
    dim = tensor.shard_dim
    return dim if dim is not None and dim >= 2 else 1


def block_rect(block: Block, ndim: int, across: int = 1) -> Rect:
    """(x0, x1, y0, y1) of a block: x spans dim `across` (columns), y dim 0 (rows); a 1-D
    tensor is one row along x."""
    if ndim == 0:
        return 0, 1, 0, 1
    if ndim == 1:
        return block.offset[0], block.offset[0] + block.shape[0], 0, 1
    return (
        block.offset[across],
        block.offset[across] + block.shape[across],
        block.offset[0],
        block.offset[0] + block.shape[0],
    )


def sharing_ranks(tensor: TensorPlan, rank: int) -> list[int]:
    """The ranks that hold the same chunk of `tensor` as `rank` (just `rank` unless the tensor
    is cut in groups: each chunk is held by world_size/groups consecutive ranks)."""
    if tensor.groups is None:
        return [rank]
    share = len(tensor.ranks) // tensor.groups
    first = rank // share * share
    return list(range(first, first + share))


def _stripe(rect: Rect, sharing: list[int], rank: int, ndim: int) -> Rect:
    """`rank`'s stripe of a chunk's rectangle shared by the ranks `sharing`: across the
    columns of a matrix, across the height of a 1-D row."""
    if len(sharing) < 2:
        return rect
    i, n = sharing.index(rank), len(sharing)
    x0, x1, y0, y1 = rect
    if ndim >= 2:
        w = (x1 - x0) / n
        return x0 + i * w, x0 + (i + 1) * w, y0, y1
    h = (y1 - y0) / n
    return x0, x1, y0 + i * h, y0 + (i + 1) * h


def _polygons(rects: list[Rect]) -> tuple[list, list]:
    """The rectangles as one filled line trace's points: closed outlines split by None."""
    xs: list[float | None] = []
    ys: list[float | None] = []
    for x0, x1, y0, y1 in rects:
        xs += [x0, x1, x1, x0, x0, None]
        ys += [y0, y0, y1, y1, y0, None]
    return xs, ys


def _replicated_trace(tensor: TensorPlan) -> go.Scatter:
    """The whole tensor, hatched grey: every rank holds all of it."""
    ndim = len(tensor.global_shape)
    whole = Block([0] * ndim, list(tensor.global_shape))
    xs, ys = _polygons([block_rect(whole, ndim, drawn_across(tensor))])
    return go.Scatter(
        x=xs,
        y=ys,
        fill="toself",
        mode="lines",
        line={"color": "#555", "width": 1},
        fillcolor="#d9d9d9",
        fillpattern={"shape": "/", "fgcolor": "#888"},
        name=f"replicated: all {len(tensor.ranks)} rank(s) hold it",
        hoveron="fills",
        meta={"kind": "replicated", "ranks": [s.rank for s in tensor.ranks]},
    )


def _empty_rank_trace(shard: RankShard) -> go.Scatter:
    """No points, only a legend entry: torch.chunk left this rank nothing."""
    return go.Scatter(
        x=[None],
        y=[None],
        mode="markers",
        marker={"color": rank_color(shard.rank), "symbol": "square-open", "size": 12},
        name=f"rank {shard.rank}: empty ({shape_text(shard.shape)})",
        meta={"kind": "empty", "rank": shard.rank},
    )


def _rank_blocks_trace(shard: RankShard, rects: list[Rect], sharing: list[int]) -> go.Scatter:
    """The rank's blocks (one per part for packed styles), filled in its colour."""
    xs, ys = _polygons(rects)
    others = [r for r in sharing if r != shard.rank]
    shared = f" · same chunk as rank {', '.join(map(str, others))}" if others else ""
    return go.Scatter(
        x=xs,
        y=ys,
        fill="toself",
        mode="lines",
        line={"color": "white", "width": 1},
        fillcolor=rank_color(shard.rank),
        name=f"rank {shard.rank}: {shape_text(shard.shape)} · {human_bytes(shard.bytes)}{shared}",
        hoveron="fills",
        meta={"kind": "block", "rank": shard.rank, "sharing": sharing},
    )


def _edges(tensor: TensorPlan, dim: int) -> list[int]:
    """Block boundaries along `dim`, so the axis reads where each cut falls."""
    edges = {0, tensor.global_shape[dim]}
    for shard in tensor.ranks:
        for b in shard.blocks:
            edges.update((b.offset[dim], b.offset[dim] + b.shape[dim]))
    return sorted(edges)


def _block_axes(fig: go.Figure, tensor: TensorPlan) -> None:
    # every tensor sets the same layout keys: a FigureWidget swapping diagrams keeps stale ones
    shape = tensor.global_shape
    ndim = len(shape)
    across = drawn_across(tensor)
    hidden = [str(d) for d in range(1, ndim) if d != across]
    note = f" (dim {', '.join(hidden)} not drawn)" if hidden else ""
    rank_shapes = ", ".join(f"rank {s.rank} {shape_text(s.shape)}" for s in tensor.ranks)
    if any(not s.blocks for s in tensor.ranks):
        rank_shapes += " (torch.chunk leaves trailing ranks empty)"
    if tensor.groups is not None:
        share = len(tensor.ranks) // tensor.groups
        rank_shapes += f" (each chunk held whole by {share} ranks, drawn as stripes)"
    fig.update_layout(
        title=titled(
            f"{tensor.name} {shape_text(shape)}: {tensor.placement}, {tensor.style}{note}",
            rank_shapes,
        ),
        plot_bgcolor="white",
        margin={"t": 80, "b": 40},
        showlegend=True,
        height=460 if ndim >= 2 else 240,
    )
    if ndim >= 2:
        x = {
            "title": f"dim {across}",
            "range": [0, shape[across]],
            "tickvals": _edges(tensor, across),
        }
        y = {"title": "dim 0", "range": [shape[0], 0], "tickvals": _edges(tensor, 0)}
        # to scale: a row is as tall as a column is wide
        y.update(visible=True, scaleanchor="x", scaleratio=1, constrain="domain")
    else:
        length = shape[0] if ndim else 1
        edges = _edges(tensor, 0) if ndim else [0, 1]
        x = {"title": "dim 0" if ndim else "scalar", "range": [0, length], "tickvals": edges}
        y = {"title": "", "range": [1, 0], "tickvals": [0, 1]}
        y.update(visible=False, scaleanchor=False, scaleratio=1, constrain="range")
    fig.update_xaxes(showgrid=False, **x)
    fig.update_yaxes(showgrid=False, **y)
