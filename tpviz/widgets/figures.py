"""Pure plotly builders for the widgets and the HTML report: plans, block diagrams, memory.

No ipywidgets here: everything returns a `plotly.graph_objects.Figure` or plain data, so all
that is drawn is testable headless and exportable to static HTML.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.colors import qualitative

from ..events import Event, Memory, Phase
from ..format import count, fold_layers, human_bytes, layer_of, shape_text, verdict
from ..plan import Block, ResolvedPlan, TensorPlan, forecast
from ..styles import DEFAULT_STYLE, STYLES

RANK_COLORS = qualitative.Plotly
# Set2 ends in grey: that stays the colour of `replicate`, the default style
STYLE_COLORS = dict(
    zip([s for s in STYLES if s != DEFAULT_STYLE], [*qualitative.Set2[:-1], *qualitative.Pastel1])
) | {DEFAULT_STYLE: qualitative.Set2[-1]}
MAX_POINTS = 4000  # per memory line: bounds what each redraw sends to the browser

# measure -> (label, what it counts)
MEASURES: dict[str, tuple[str, str]] = {
    "rss_growth": (
        "RSS growth since loading began",
        "resident set minus the rank's resident set just before loading (after imports); "
        "mmap'd checkpoint pages count too",
    ),
    "rss": (
        "RSS",
        "the rank's whole resident set, imported torch (~300 MB) included; mmap'd pages count",
    ),
    "rss_anon": ("anonymous RSS", "resident set without file-backed (mmap'd) pages"),
    "tensor_bytes": ("tensor bytes", "the loader's own accounting of the tensor bytes it holds"),
    "cuda_allocated": ("CUDA allocated", "torch.cuda.memory_allocated on the rank's GPU"),
    "cuda_reserved": (
        "CUDA reserved",
        "torch.cuda.memory_reserved: allocated plus the caching allocator's reserve",
    ),
}
ABSOLUTE_MEASURES = ("rss", "rss_anon")  # forecast lines sit on the rank's baseline for these


UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}  # the axes use the tables' binary units


def unit_for(nbytes: float) -> str:
    """The unit a bytes axis reads best in, for values up to about `nbytes`."""
    if nbytes >= 4 * UNITS["GiB"]:
        return "GiB"
    return "MiB" if nbytes >= UNITS["MiB"] / 2 else "KiB"


def in_unit(values: Sequence[float] | np.ndarray, unit: str) -> np.ndarray:
    # numpy arrays: plotly validates and sends them without a Python loop per point
    return np.asarray(values, dtype=float) / UNITS[unit]


def rank_color(index: int) -> str:
    return RANK_COLORS[index % len(RANK_COLORS)]


def style_color(style: str) -> str:
    return STYLE_COLORS.get(style, STYLE_COLORS[DEFAULT_STYLE])


def titled(title: str, note: str) -> dict[str, str]:
    """A title with a smaller line under it (a `<br><sup>` line, which FigureWidget redraws
    reliably, unlike plotly's `subtitle` after a relayout)."""
    return {"text": f"{title}<br><sup>{note}</sup>" if note else title}


def default_measure(device: str) -> str:
    return "cuda_allocated" if device == "cuda" else "rss_growth"


# --- plans ------------------------------------------------------------------------------------


def bytes_by_style_figure(plan: ResolvedPlan) -> go.Figure:
    """Stacked bars of each rank's bytes by style; replicated bytes hatched."""
    w = plan.world_size
    totals: dict[tuple[str, bool], list[int]] = {}
    for t in plan.params:
        row = totals.setdefault((t.style, t.shard_dim is None), [0] * w)
        for shard in t.ranks:
            row[shard.rank] += shard.bytes
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


def block_rect(block: Block, ndim: int) -> tuple[int, int, int, int]:
    """(x0, x1, y0, y1) of a block: x spans dim 1 (columns), y dim 0 (rows); a 1-D tensor is
    one row along x."""
    if ndim == 0:
        return 0, 1, 0, 1
    if ndim == 1:
        return block.offset[0], block.offset[0] + block.shape[0], 0, 1
    return (
        block.offset[1],
        block.offset[1] + block.shape[1],
        block.offset[0],
        block.offset[0] + block.shape[0],
    )


def _polygons(rects: list[tuple[int, int, int, int]]) -> tuple[list, list]:
    xs: list[float | None] = []
    ys: list[float | None] = []
    for x0, x1, y0, y1 in rects:
        xs += [x0, x1, x1, x0, x0, None]
        ys += [y0, y0, y1, y1, y0, None]
    return xs, ys


def block_diagram_figure(tensor: TensorPlan) -> go.Figure:
    """The tensor drawn to scale, each block a rectangle in its owning rank's colour."""
    ndim = len(tensor.global_shape)
    full = Block([0] * ndim, list(tensor.global_shape))
    fig = go.Figure()
    label_x, label_y, labels = [], [], []
    if tensor.shard_dim is None:
        xs, ys = _polygons([block_rect(full, ndim)])
        fig.add_scatter(
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
    for shard in tensor.ranks if tensor.shard_dim is not None else []:
        if not shard.blocks:
            fig.add_scatter(
                x=[None],
                y=[None],
                mode="markers",
                marker={"color": rank_color(shard.rank), "symbol": "square-open", "size": 12},
                name=f"rank {shard.rank}: empty ({shape_text(shard.shape)})",
                meta={"kind": "empty", "rank": shard.rank},
            )
            continue
        rects = [block_rect(b, ndim) for b in shard.blocks]
        xs, ys = _polygons(rects)
        fig.add_scatter(
            x=xs,
            y=ys,
            fill="toself",
            mode="lines",
            line={"color": "white", "width": 1},
            fillcolor=rank_color(shard.rank),
            name=f"rank {shard.rank}: {shape_text(shard.shape)} · {human_bytes(shard.bytes)}",
            hoveron="fills",
            meta={"kind": "block", "rank": shard.rank},
        )
        for i, (x0, x1, y0, y1) in enumerate(rects):
            part = f" · part {i + 1}" if len(rects) > 1 else ""
            block = shard.blocks[i]
            label_x.append((x0 + x1) / 2)
            label_y.append((y0 + y1) / 2)
            labels.append(f"rank {shard.rank}{part}<br>{shape_text(block.shape)}")
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
    note = " (dims 2+ not drawn)" if ndim > 2 else ""
    rank_shapes = ", ".join(f"rank {s.rank} {shape_text(s.shape)}" for s in tensor.ranks)
    if any(not s.blocks for s in tensor.ranks):
        rank_shapes += " (torch.chunk leaves trailing ranks empty)"
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
        x = {"title": "dim 1", "range": [0, shape[1]], "tickvals": _edges(tensor, 1)}
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


def representative_tensor(tensors: Sequence[TensorPlan]) -> TensorPlan:
    """The tensor whose diagram shows a plan best: an uneven split, else a packed one, else a
    sharded weight inside a layer, else any sharded one, else the first."""
    sharded = [t for t in tensors if t.shard_dim is not None]

    def uneven(t: TensorPlan) -> bool:
        return len({s.bytes for s in t.ranks}) > 1

    for pick in (
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
        cells.append(" / ".join(sorted({human_bytes(s.bytes) for s in t.ranks}, key=len)))
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


# --- memory over time -------------------------------------------------------------------------


class MemorySeries:
    """The memory samples of one load, per rank, fed with events as they arrive. Times count
    from the moment loading began; each rank's baseline is its sample right before loading."""

    def __init__(self) -> None:
        self.samples: dict[int, list[Memory]] = {}
        self.loading_at: dict[int, float] = {}
        self._baseline: dict[int, int] = {}  # rank -> index of its baseline sample
        self._first: float | None = None

    def add(self, events: Iterable[Event]) -> None:
        for e in events:
            if e.rank < 0:
                continue  # the launcher's own events
            if isinstance(e, Memory):
                self.samples.setdefault(e.rank, []).append(e)
                self._first = e.t if self._first is None else min(self._first, e.t)
            elif isinstance(e, Phase) and e.name == "loading":
                self.loading_at[e.rank] = e.t
                if self.samples.get(e.rank):
                    self._baseline[e.rank] = len(self.samples[e.rank]) - 1

    @property
    def ranks(self) -> list[int]:
        return sorted(self.samples)

    @property
    def t0(self) -> float | None:
        return min(self.loading_at.values()) if self.loading_at else self._first

    def baseline(self, rank: int) -> Memory | None:
        index = self._baseline.get(rank)
        return None if index is None else self.samples[rank][index]

    def xy(self, rank: int, measure: str) -> tuple[np.ndarray, np.ndarray]:
        """Seconds since loading began, and the measure in bytes, of the rank's samples."""
        samples = self.samples.get(rank, [])
        t0 = self.t0 or 0.0
        if measure == "rss_growth":
            index = self._baseline.get(rank)
            if index is None:
                return np.empty(0), np.empty(0)
            base = samples[index].rss
            chosen = samples[index:]
            values = [s.rss - base for s in chosen]
        else:
            chosen = [s for s in samples if getattr(s, measure) is not None]
            values = [getattr(s, measure) for s in chosen]
        xs = np.array([s.t for s in chosen], dtype=float) - t0
        return thin(xs, np.array(values, dtype=float))


def thin(xs: np.ndarray, ys: np.ndarray, limit: int = MAX_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """At most about `limit` points, evenly strided, keeping the last point and the peak."""
    if len(xs) <= limit:
        return xs, ys
    stride = math.ceil(len(xs) / limit)
    keep = np.unique(np.append(np.arange(0, len(xs), stride), [len(xs) - 1, int(ys.argmax())]))
    return xs[keep], ys[keep]


@dataclass
class MemoryRun:
    """One load on a memory chart: its samples and each rank's forecasts."""

    label: str  # the legend's name for this load, e.g. its strategy
    series: MemorySeries = field(default_factory=MemorySeries)
    shard_bytes: dict[int, int] = field(default_factory=dict)  # forecast final shard per rank
    peak_bytes: dict[int, int] = field(default_factory=dict)  # forecast peak per rank
    color_offset: int = 0  # so that overlaid loads get their own colours

    @property
    def ranks(self) -> list[int]:
        return sorted(set(self.series.ranks) | set(self.shard_bytes))


def rank_traces(run: MemoryRun, rank: int, measure: str, unit: str = "MiB") -> list[go.Scatter]:
    """The rank's memory line, then its forecast final shard and forecast peak (dashed), in
    `unit`. The legend lists the memory lines only, grouped by load: a click toggles the load's
    lines and forecasts together, so overlaid loads stay a short legend."""
    color = rank_color(run.color_offset + rank)
    xs, ys = run.series.xy(rank, measure)
    group = run.label
    traces = [
        go.Scatter(
            x=xs,
            y=in_unit(ys, unit),
            mode="lines",
            line={"color": color, "width": 2},
            name=f"{run.label} rank {rank}",
            legendgroup=group,
            legendgrouptitle={"text": run.label},
            hovertemplate=f"%{{y:.2f}} {unit} at %{{x:.2f}} s",
            meta={"kind": "memory", "rank": rank, "run": run.label},
        )
    ]
    span = _time_span(run, measure)
    offset = 0
    if measure in ABSOLUTE_MEASURES:
        base = run.series.baseline(rank)
        offset = getattr(base, measure) if base is not None else None
    # a peak equal to the shard (sliced without staging copies) is one line, labelled both
    same = run.peak_bytes.get(rank) is not None and run.peak_bytes.get(rank) == run.shard_bytes.get(
        rank
    )
    for kind, values, dash, label in (
        ("forecast_shard", run.shard_bytes, "dash", "forecast shard = peak" if same else None),
        ("forecast_peak", run.peak_bytes, "dashdot", None),
    ):
        value = values.get(rank)
        shown = value is not None and offset is not None
        traces.append(
            go.Scatter(
                x=span if shown else [],
                y=in_unit([value + offset] * 2, unit) if shown else [],
                mode="lines",
                line={"color": color, "width": 1, "dash": dash},
                name=f"{run.label} rank {rank} {label or kind.replace('_', ' ')}",
                visible=not (same and kind == "forecast_peak"),
                legendgroup=group,
                showlegend=False,
                hovertemplate=f"%{{y:.2f}} {unit}",
                meta={"kind": kind, "rank": rank, "run": run.label},
            )
        )
    return traces


def _time_span(run: MemoryRun, measure: str) -> list[float]:
    """From the run's first to its last point (0 to 1 s before there are any); RSS growth
    starts at the baselines."""
    t0 = run.series.t0
    series = run.series
    ends = [s[-1].t for s in series.samples.values()]
    if measure == "rss_growth":
        starts = [b.t for r in series.ranks if (b := series.baseline(r)) is not None]
    else:
        starts = [s[0].t for s in series.samples.values()]
    if t0 is None or not starts:
        return [0.0, 1.0]
    start, end = min(starts) - t0, max(ends) - t0
    return [start, max(end, start + 0.1)]


def memory_unit(runs: Sequence[MemoryRun]) -> str:
    """The unit of a memory chart: from the largest forecast of its runs."""
    return unit_for(max((v for r in runs for v in r.peak_bytes.values()), default=0) or 2**20)


def memory_layout(measure: str, unit: str = "MiB") -> dict[str, Any]:
    label, note = MEASURES[measure]
    return {
        "title": titled(f"Memory per rank: {label}", note),
        "xaxis": {"title": "seconds since loading began", "zeroline": True},
        "yaxis": {"title": unit},
        # below the plot, so that entries never squeeze it
        "legend": {"groupclick": "togglegroup", "orientation": "h", "yanchor": "top", "y": -0.2},
        "height": 480,
        "margin": {"t": 80, "b": 90},
        "uirevision": "memory",  # keep the user's zoom across redraws
    }


def memory_figure(runs: Sequence[MemoryRun], measure: str) -> go.Figure:
    """Memory over time: per run and rank a line and its two dashed forecast lines."""
    unit = memory_unit(runs)
    fig = go.Figure(layout=memory_layout(measure, unit))
    for run in runs:
        for rank in run.ranks:
            fig.add_traces(rank_traces(run, rank, measure, unit))
    return fig


# --- load results -----------------------------------------------------------------------------


def summary_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The per-rank summary of a load: time, peak against forecast, params against plan."""
    cuda = any("peak_cuda_allocated_bytes" in r for r in result["ranks"])
    headers = [
        "rank",
        "load s",
        "peak RSS growth",
        "forecast peak",
        "peak tensors",
        *(["peak CUDA allocated"] if cuda else []),
        "param bytes",
        "plan bytes",
        "params = plan",
    ]
    rows = []
    for r in result["ranks"]:
        rows.append(
            [
                str(r["rank"]),
                f"{r['seconds']:.2f}",
                human_bytes(r["peak_rss_bytes"]),
                human_bytes(r["forecast_peak_bytes"]),
                human_bytes(r["peak_tensor_bytes"]),
                *([human_bytes(r.get("peak_cuda_allocated_bytes"))] if cuda else []),
                human_bytes(r["param_bytes"]),
                human_bytes(r["planned_bytes"]),
                "yes" if r["param_bytes"] == r["planned_bytes"] else "NO",
            ]
        )
    return headers, rows


def headline(result: dict[str, Any]) -> str:
    """One line: strategy, ranks, dtype, times and whether the shards match the plan."""
    parts = [
        f"{result.get('strategy', 'load')} on {len(result['ranks'])} "
        f"{result.get('device', '')} rank(s)".replace("  ", " ")
    ]
    if result.get("dtype"):
        parts.append(result["dtype"])
    if "load_seconds" in result:
        parts.append(f"load {result['load_seconds']:.2f} s")
    if "startup_seconds" in result:
        parts.append(f"startup {result['startup_seconds']:.2f} s")
    if "plan_matches_shards" in result:
        parts.append(f"shards match the plan: {'yes' if result['plan_matches_shards'] else 'NO'}")
    return ", ".join(parts)


def verify_text(result: dict[str, Any]) -> str | None:
    """The verification result in words, or None when the load was not verified."""
    verify = result.get("verify")
    if not verify:
        return None
    outcome = verdict(verify.get("ok"))
    if "max_abs_diff" not in verify:
        return f"verification {outcome}: {verify.get('error') or verify.get('note', '')}"
    return (
        f"verification {outcome}: max |logits − reference| = {verify['max_abs_diff']:.3g} "
        f"(tolerance {verify['tolerance']:g})"
    )


def summary_figure(result: dict[str, Any]) -> go.Figure:
    headers, rows = summary_rows(result)
    fig = go.Figure(
        go.Table(
            header={"values": headers, "align": "left"},
            cells={"values": [list(c) for c in zip(*rows)] if rows else [], "align": "left"},
        )
    )
    lines = [headline(result)]
    if text := verify_text(result):
        lines.append(text)
    fig.update_layout(
        title=titled(lines[0], " · ".join(lines[1:])),
        height=150 + 28 * len(rows),
        margin={"t": 80, "b": 10},
    )
    return fig


def peaks_figure(results: Sequence[dict[str, Any]]) -> go.Figure:
    """Each rank's measured peaks beside its forecasts, for loads drawn without their events."""
    x = [f"{res.get('strategy', 'load')} rank {r['rank']}" for res in results for r in res["ranks"]]
    ranks = [r for res in results for r in res["ranks"]]
    unit = unit_for(max((r["forecast_peak_bytes"] for r in ranks), default=0))
    fig = go.Figure()
    for key, name in (
        ("peak_rss_bytes", "peak RSS growth"),
        ("peak_tensor_bytes", "peak tensor bytes"),
        ("forecast_peak_bytes", "forecast peak"),
        ("planned_bytes", "forecast final shard (plan)"),
    ):
        fig.add_bar(x=x, y=in_unit([r[key] for r in ranks], unit), name=name)
    fig.update_layout(
        barmode="group",
        title=titled("Peak memory per rank", "peak RSS growth counts mmap'd checkpoint pages too"),
        yaxis={"title": unit},
        height=400,
        margin={"t": 80},
    )
    return fig


def memory_run(
    plan: ResolvedPlan,
    label: str,
    strategy: str,
    device: str = "cpu",
    init: str = "checkpoint",
    color_offset: int = 0,
) -> MemoryRun:
    """An empty run with the plan's forecasts: final shard and the strategy's peak per rank."""
    peaks = forecast(plan, strategy, device, init).peak_bytes
    return MemoryRun(
        label,
        shard_bytes=dict(enumerate(plan.per_rank_bytes)),
        peak_bytes=dict(enumerate(peaks)),
        color_offset=color_offset,
    )
