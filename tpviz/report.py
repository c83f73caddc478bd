"""Human-readable summaries of plans and load results (text tables), and HTML reports."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from html import escape
from pathlib import Path
from typing import Any

from .plan import ResolvedPlan

_INDEX = re.compile(r"\.\d+\.")


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> str:
    """A plain text table; columns in `right` are right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        parts = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def shape_text(shape) -> str:
    return "×".join(map(str, shape)) if len(shape) else "scalar"


def plan_table(plan: ResolvedPlan, full: bool = False) -> str:
    """One row per tensor; unless `full`, tensors that differ only by layer index are folded
    into one row with a count (`model.layers.*.mlp.up_proj.weight x80`)."""
    groups: dict[tuple, list] = {}
    for t in plan.params:
        name = t.name if full else _INDEX.sub(".*.", t.name)
        key = (
            name,
            t.style,
            tuple(t.global_shape),
            t.dtype,
            tuple(tuple(r.shape) for r in t.ranks),
            tuple(t.tied_to) if full else (),
        )
        groups.setdefault(key, []).append(t)
    w = plan.world_size
    headers = ["tensor", "style", "global", *[f"rank {r}" for r in range(w)], "bytes/rank"]
    rows = []
    for (name, style, shape, _, shards, _), members in groups.items():
        t = members[0]
        label = name + (f" x{len(members)}" if len(members) > 1 else "")
        if t.tied_to:
            label += f" (tied: {', '.join(t.tied_to)})"
        per_rank = sorted({r.bytes for r in t.ranks})
        rank_bytes = (
            human_bytes(per_rank[0])
            if len(per_rank) == 1
            else " / ".join(human_bytes(r.bytes) for r in t.ranks)
        )
        rows.append([label, style, shape_text(shape), *(shape_text(s) for s in shards), rank_bytes])
    totals = " | ".join(f"rank {r}: {human_bytes(b)}" for r, b in enumerate(plan.per_rank_bytes))
    out = [
        table(headers, rows),
        "",
        f"per rank: {totals}",
        f"model: {human_bytes(plan.total_bytes)} in {plan.dtype} over {w} rank(s)",
    ]
    out += [f"warning [{i.code}]: {i.message}" for i in plan.warnings]
    out += [f"error [{i.code}]: {i.message}" for i in plan.errors]
    return "\n".join(out)


def load_table(result: dict[str, Any]) -> str:
    """Per-rank figures of one load result."""
    headers = [
        "rank",
        "seconds",
        "params",
        "planned",
        "peak RSS +",
        "peak tensors",
        "forecast peak",
        "sent",
        "received",
    ]
    rows = [
        [
            r["rank"],
            f"{r['seconds']:.2f}",
            human_bytes(r["param_bytes"]),
            human_bytes(r["planned_bytes"]),
            human_bytes(r["peak_rss_bytes"]),
            human_bytes(r["peak_tensor_bytes"]),
            human_bytes(r["forecast_peak_bytes"]),
            human_bytes(r["bytes_sent"]),
            human_bytes(r["bytes_received"]),
        ]
        for r in result["ranks"]
    ]
    lines = [
        f"{result['strategy']} on {result['world_size']} {result['device']} rank(s), "
        f"{result['dtype']}: startup {result['startup_seconds']:.2f} s, load "
        f"{result['load_seconds']:.2f} s, plan matches shards: "
        f"{'yes' if result['plan_matches_shards'] else 'NO'}",
        table(headers, rows, right=range(1, len(headers))),
        "peak RSS + is resident-set growth during loading; it counts mmap'd file pages too.",
        *(f"warning [{w['code']}]: {w['message']}" for w in result.get("warnings", [])),
    ]
    verify = result.get("verify")
    if verify:
        verdict = {True: "ok", False: "FAILED", None: "not comparable"}[verify.get("ok")]
        if "max_abs_diff" in verify:
            lines.append(
                f"verify: max |logits - reference| = {verify['max_abs_diff']:.3g} "
                f"(tolerance {verify['tolerance']:g}): {verdict}"
            )
        else:
            lines.append(f"verify: {verdict}: {verify.get('error')}")
        if verify.get("note"):
            lines.append(f"  {verify['note']}")
    check = result.get("init_check")
    if check:
        lines.append(
            f"random init (seed {check['seed']}): replicated tensors agree across ranks: "
            f"{'yes' if check['replicated_consistent'] else 'NO ' + str(check['inconsistent'])}"
        )
        if check["matches_single_process"] is None:
            lines.append(f"  {check.get('note', '')}")
        else:
            lines.append(
                "  equal to a single-process init with the same seed: "
                + (
                    "yes"
                    if check["matches_single_process"]
                    else f"NO, e.g. {check['mismatched'][:3]}"
                )
            )
    profile = result.get("profile")
    if profile:
        lines.append(f"profile traces: {profile['dir']} (tensorboard --logdir {profile['dir']})")
    return "\n".join(lines)


def compare_table(results: list[dict[str, Any]]) -> str:
    headers = [
        "strategy",
        "rank",
        "load s",
        "peak RSS +",
        "peak tensors",
        "sent",
        "received",
        "x sliced (s)",
        "x sliced (RSS)",
    ]
    rows = []
    for res in results:
        for r in res["ranks"]:
            ratio = r.get("ratio_to_sliced", {})
            rows.append(
                [
                    res["strategy"],
                    r["rank"],
                    f"{r['seconds']:.2f}",
                    human_bytes(r["peak_rss_bytes"]),
                    human_bytes(r["peak_tensor_bytes"]),
                    human_bytes(r["bytes_sent"]),
                    human_bytes(r["bytes_received"]),
                    _ratio(ratio.get("seconds")),
                    _ratio(ratio.get("peak_rss_bytes")),
                ]
            )
    return table(headers, rows, right=range(2, len(headers)))


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


# --- HTML reports -----------------------------------------------------------------------------

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1, h2 { font-weight: 600; }
.issues li.error { color: #b00020; } .issues li.warning { color: #8a5a00; }
"""


def html_page(title: str, parts: Sequence[Any]) -> str:
    """A self-contained page of HTML snippets and plotly figures: plotly.js goes inline, once,
    so the file opens without any network."""
    body, inline = [], True
    for part in parts:
        if isinstance(part, str):
            body.append(part)
            continue
        body.append(
            part.to_html(full_html=False, include_plotlyjs=inline, config={"displaylogo": False})
        )
        inline = False
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{escape(title)}</title>'
        f"<style>{_CSS}</style></head>\n<body>\n<h1>{escape(title)}</h1>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def plan_parts(plan: ResolvedPlan, tensor: str | None = None) -> list[Any]:
    """The plan section: facts, issues, bytes per rank by style, a block diagram (of `tensor`,
    else a representative one) and the plan table."""
    from .widgets import figures

    per_rank = ", ".join(f"rank {r}: {human_bytes(b)}" for r, b in enumerate(plan.per_rank_bytes))
    issues = [("error", i) for i in plan.errors] + [("warning", i) for i in plan.warnings]
    items = "".join(
        f'<li class="{kind}">{kind} [{escape(i.code)}]: {escape(i.message)}</li>'
        for kind, i in issues
    )
    shown = plan.tensor(tensor) if tensor else figures.representative_tensor(plan.params)
    return [
        f"<h2>Plan</h2><p>{escape(str(plan.source))}: {plan.world_size} rank(s), {plan.dtype}, "
        f"model {human_bytes(plan.total_bytes)}; per rank {per_rank}</p>",
        f'<ul class="issues">{items}</ul>' if items else "<p>No warnings or errors.</p>",
        figures.bytes_by_style_figure(plan),
        figures.block_diagram_figure(shown),
        figures.plan_table_figure(plan),
    ]


def load_parts(result: dict[str, Any] | None, run: Any = None, measure: str | None = None) -> list:
    """One load: memory over time from its `run` (a `figures.MemoryRun`), or without one the
    per-rank peaks beside the forecasts; then the summary table. `result` is None while the
    load is still running."""
    from .widgets import figures

    label = run.label if run is not None else (result or {}).get("strategy", "load")
    parts: list[Any] = [f"<h2>Load: {escape(label)}</h2>"]
    if run is not None:
        device = (result or {}).get("device", "cpu")
        parts.append(figures.memory_figure([run], measure or figures.default_measure(device)))
    elif result is not None:
        parts.append(figures.peaks_figure([result]))
    parts.append(figures.summary_figure(result) if result else "<p>Still loading.</p>")
    return parts


def html_report(
    plan: ResolvedPlan,
    results: Sequence[dict[str, Any]],
    events: Sequence[Sequence[Any] | None] | None = None,
    *,
    tensor: str | None = None,
    title: str = "tpviz report",
) -> str:
    """The plan's figures, then each load (`events[i]`, if given, are the events of
    `results[i]` and draw its memory over time); several loads are also overlaid."""
    from .widgets import figures

    runs = []
    for i, result in enumerate(results):
        evts = events[i] if events and i < len(events) else None
        if evts is None:
            runs.append(None)
            continue
        run = figures.memory_run(
            plan,
            result["strategy"],
            result["strategy"],
            result.get("device", "cpu"),
            result.get("init", "checkpoint"),
            color_offset=i * plan.world_size,
        )
        run.series.add(evts)
        runs.append(run)
    parts = plan_parts(plan, tensor)
    if len(results) > 1:
        parts.append("<h2>All loads</h2>")
        drawn = [r for r in runs if r is not None]
        if drawn:
            device = results[0].get("device", "cpu")
            parts.append(figures.memory_figure(drawn, figures.default_measure(device)))
        parts.append(figures.peaks_figure(results))
    for result, run in zip(results, runs):
        parts += load_parts(result, run)
    return html_page(title, parts)


def write_html_report(
    path: str | os.PathLike,
    plan: ResolvedPlan,
    results: Sequence[dict[str, Any]],
    events: Sequence[Sequence[Any] | None] | None = None,
) -> Path:
    """Write `html_report(plan, results, events)` to `path`; opens offline."""
    out = Path(path)
    out.write_text(html_report(plan, results, events), encoding="utf-8")
    return out
