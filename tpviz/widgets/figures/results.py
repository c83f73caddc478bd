"""A finished load in figures: per-rank summary rows (and loads compared, a row each) with
their HTML table, a headline, the verification in words, and peaks measured beside
forecasts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

import plotly.graph_objects as go

from ...format import human_bytes, verdict
from ...results import LoadResult
from .palette import in_unit, titled, unit_for

Result = LoadResult | Mapping[str, Any]  # a load result, typed or as its JSON


def summary_rows(result: Result) -> tuple[list[str], list[list[str]]]:
    """The per-rank summary of a load: time, peak against forecast, params against plan."""
    result = LoadResult.of(result)
    cuda = any(r.peak_cuda_allocated_bytes is not None for r in result.ranks)
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
    for r in result.ranks:
        rows.append(
            [
                str(r.rank),
                f"{r.seconds:.2f}",
                human_bytes(r.peak_rss_bytes),
                human_bytes(r.forecast_peak_bytes),
                human_bytes(r.peak_tensor_bytes),
                *([human_bytes(r.peak_cuda_allocated_bytes)] if cuda else []),
                human_bytes(r.param_bytes),
                human_bytes(r.planned_bytes),
                "yes" if r.param_bytes == r.planned_bytes else "NO",
            ]
        )
    return headers, rows


def _comparison_rows(loads: Sequence[tuple[str, Result]]) -> tuple[list[str], list[list[str]]]:
    """One row per labelled load: time, the largest rank's peaks and forecast, verification."""
    headers = ["load", "load s", "max peak RSS growth", "max peak tensors", "forecast", "verify"]
    rows = []
    for label, result in loads:
        result = LoadResult.of(result)
        ranks, verify = result.ranks, (result.verify or {}).get("ok")
        rows.append(
            [
                label,
                f"{result.load_seconds:.2f}",
                human_bytes(max(r.peak_rss_bytes for r in ranks)),
                human_bytes(max(r.peak_tensor_bytes for r in ranks)),
                human_bytes(max(r.forecast_peak_bytes for r in ranks)),
                "-" if verify is None else verdict(verify),
            ]
        )
    return headers, rows


def comparison_html(loads: Sequence[tuple[str, Result]]) -> str:
    """The Dashboard's loads so far, a row each (empty before the first)."""
    if not loads:
        return ""
    table = table_html(*_comparison_rows(loads), "tpviz-summary tpviz-comparison")
    return f"<b>Loads so far</b> (largest rank; RSS growth counts mmap'd pages){table}"


def table_html(headers: list[str], rows: list[list[str]], css_class: str) -> str:
    """Rows of text as an HTML table (escaped), for the widgets' summaries."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{css_class}"><tr>{head}</tr>{body}</table>'


def headline(result: Result) -> str:
    """One line: strategy, ranks, dtype, times and whether the shards match the plan."""
    result = LoadResult.of(result)
    parts = [f"{result.strategy} on {len(result.ranks)} {result.device or ''} rank(s)"]
    parts[0] = parts[0].replace("  ", " ")
    if result.dtype:
        parts.append(result.dtype)
    parts.append(f"load {result.load_seconds:.2f} s")
    if result.startup_seconds is not None:
        parts.append(f"startup {result.startup_seconds:.2f} s")
    if result.plan_matches_shards is not None:
        parts.append(f"shards match the plan: {'yes' if result.plan_matches_shards else 'NO'}")
    return ", ".join(parts)


def verify_text(result: Result) -> str | None:
    """The verification result in words, or None when the load was not verified."""
    verify = LoadResult.of(result).verify
    if not verify:
        return None
    outcome = verdict(verify.get("ok"))
    if "max_abs_diff" not in verify:
        return f"verification {outcome}: {verify.get('error') or verify.get('note', '')}"
    return (
        f"verification {outcome}: max |logits − reference| = {verify['max_abs_diff']:.3g} "
        f"(tolerance {verify['tolerance']:g})"
    )


def summary_figure(result: Result) -> go.Figure:
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


def peaks_figure(results: Sequence[Result]) -> go.Figure:
    """Each rank's measured peaks beside its forecasts, for loads drawn without their events."""
    typed = [LoadResult.of(res) for res in results]
    x = [f"{res.strategy} rank {r.rank}" for res in typed for r in res.ranks]
    ranks = [r for res in typed for r in res.ranks]
    unit = unit_for(max((r.forecast_peak_bytes for r in ranks), default=0))
    fig = go.Figure()
    for key, name in (
        ("peak_rss_bytes", "peak RSS growth"),
        ("peak_tensor_bytes", "peak tensor bytes"),
        ("forecast_peak_bytes", "forecast peak"),
        ("planned_bytes", "forecast final shard (plan)"),
    ):
        fig.add_bar(x=x, y=in_unit([getattr(r, key) for r in ranks], unit), name=name)
    fig.update_layout(
        barmode="group",
        title=titled("Peak memory per rank", "peak RSS growth counts mmap'd checkpoint pages too"),
        yaxis={"title": unit},
        height=400,
        margin={"t": 80},
    )
    return fig
