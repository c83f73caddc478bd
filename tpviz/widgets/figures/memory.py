"""Memory per rank over time: a line per rank and load with its forecast final shard and
peak (dashed), what each measure counts, and the chart's layout and unit."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from .memory_series import MemoryRun
from .palette import UNITS, in_unit, rank_color, titled, unit_for

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


def default_measure(device: str) -> str:
    return "cuda_allocated" if device == "cuda" else "rss_growth"


def rank_traces(run: MemoryRun, rank: int, measure: str, unit: str = "MiB") -> list[go.Scatter]:
    """The rank's memory line, then its forecast final shard and forecast peak (dashed), in
    `unit`. The legend lists the memory lines only, grouped by load: a click toggles the load's
    lines and forecasts together, so overlaid loads stay a short legend."""
    return [_memory_line(run, rank, measure, unit), *_forecast_lines(run, rank, measure, unit)]


def _memory_line(run: MemoryRun, rank: int, measure: str, unit: str) -> go.Scatter:
    xs, ys = run.series.xy(rank, measure)
    return go.Scatter(
        x=xs,
        y=in_unit(ys, unit),
        mode="lines",
        line={"color": rank_color(run.color_offset + rank), "width": 2},
        name=f"{run.label} rank {rank}",
        legendgroup=run.label,
        legendgrouptitle={"text": run.label},
        hovertemplate=f"%{{y:.2f}} {unit} at %{{x:.2f}} s",
        meta={"kind": "memory", "rank": rank, "run": run.label},
    )


def _forecast_lines(run: MemoryRun, rank: int, measure: str, unit: str) -> list[go.Scatter]:
    """The forecast final shard and peak as flat lines over the run's time span; drawn empty
    while a forecast or the baseline it sits on is unknown."""
    span = _time_span(run, measure)
    offset = _baseline_offset(run, rank, measure)
    # a peak equal to the shard (sliced without staging copies) is one line, labelled both
    same = run.peak_bytes.get(rank) is not None and run.peak_bytes.get(rank) == run.shard_bytes.get(
        rank
    )
    traces = []
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
                line={"color": rank_color(run.color_offset + rank), "width": 1, "dash": dash},
                name=f"{run.label} rank {rank} {label or kind.replace('_', ' ')}",
                visible=not (same and kind == "forecast_peak"),
                legendgroup=run.label,
                showlegend=False,
                hovertemplate=f"%{{y:.2f}} {unit}",
                meta={"kind": kind, "rank": rank, "run": run.label},
            )
        )
    return traces


def _baseline_offset(run: MemoryRun, rank: int, measure: str) -> int | None:
    """What a forecast line sits on: 0 for measures that count from loading, the rank's
    baseline for absolute ones (None until that baseline is sampled)."""
    if measure not in ABSOLUTE_MEASURES:
        return 0
    base = run.series.baseline(rank)
    return getattr(base, measure) if base is not None else None


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
    return unit_for(
        max((v for r in runs for v in r.peak_bytes.values()), default=0) or UNITS["MiB"]
    )


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
