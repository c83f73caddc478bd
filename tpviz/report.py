"""Human-readable summaries of plans and load results (text tables), and HTML reports."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

from . import styles
from .format import fold_layers, human_bytes, shape_text, verdict
from .outputs import write_text
from .plan import ResolvedPlan
from .results import LoadResult


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


def plan_table(plan: ResolvedPlan, full: bool = False) -> str:
    """One row per tensor; unless `full`, tensors that differ only by layer index are folded
    into one row with a count (`model.layers.*.mlp.up_proj.weight x80`) whose bytes are the
    row's total. Ranks holding the same are folded too (`0-6: 1143×8192, 7: 1142×8192`), so
    the width does not grow with the world size. Rows in error show the style as given."""
    groups: dict[tuple, list] = {}
    for t in plan.params:
        name = t.name if full else fold_layers(t.name)
        key = (
            name,
            t.style_given,
            tuple(t.global_shape),
            t.dtype,
            tuple(tuple(r.shape) for r in t.ranks),
            tuple(t.tied_to) if full else (),
        )
        groups.setdefault(key, []).append(t)
    in_error = _names_in_error(plan)
    rows = []
    for (name, _, shape, _, shards, _), members in groups.items():
        t = members[0]
        label = name + (f" x{len(members)}" if len(members) > 1 else "")
        if t.tied_to:
            label += f" (tied: {', '.join(t.tied_to)})"
        style = f"{t.style_given} (error)" if t.name in in_error else t.style
        total = [len(members) * r.bytes for r in t.ranks]
        rows.append([label, style, shape_text(shape), by_rank(shards, shape_text), by_rank(total)])
    headers = ["tensor", "style", "global", "shard per rank", "bytes/rank"]
    out = [table(headers, rows)]
    if len(groups) < len(plan.params):
        out.append("bytes/rank of a row folded xN: all N tensors together")
    out += [
        "",
        f"per rank: {by_rank(plan.per_rank_bytes, label_all=True)}",
        f"model: {human_bytes(plan.total_bytes)} in {plan.dtype} over {plan.world_size} rank(s)",
    ]
    out += [f"warning [{i.code}]: {i.message}" for i in plan.warnings]
    out += [f"error [{i.code}]: {i.message}" for i in plan.errors]
    return "\n".join(out)


def by_rank(values: Sequence[Any], show=human_bytes, label_all: bool = False) -> str:
    """One value if every rank shows the same (labelled `ranks 0-7: ` if `label_all`), else
    runs of ranks that do: `ranks 0-6: 1.2 MiB, rank 7: 1.1 MiB`."""
    runs: list[list[Any]] = []  # [first rank, last rank, text]
    for r, text in enumerate(map(show, values)):
        if runs and runs[-1][2] == text:
            runs[-1][1] = r
        else:
            runs.append([r, r, text])
    if len(runs) == 1 and not label_all:
        return runs[0][2]
    return ", ".join(
        f"ranks {a}-{b}: {text}" if b > a else f"rank {a}: {text}" for a, b, text in runs
    )


def _names_in_error(plan: ResolvedPlan) -> set[str]:
    """Tensors whose given style cannot be used (unknown or unsupported: the plan went on with
    `replicate` only to find further errors) and tensors or modules an error names."""
    named = {i.name for i in plan.errors}
    return {t.name for t in plan.params if t.name in named or t.module in named or _unusable(t)}


def _unusable(t) -> bool:
    try:
        styles.canonical(t.style_given)
    except ValueError:  # UnknownStyle, UnsupportedStyle
        return True
    return False


LOAD_HEADERS = [
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


def load_table(result: Mapping[str, Any]) -> str:
    """Per-rank figures of one load result (a LoadResult, or its JSON)."""
    result = LoadResult.of(result)
    rows = [
        [
            r.rank,
            f"{r.seconds:.2f}",
            human_bytes(r.param_bytes),
            human_bytes(r.planned_bytes),
            human_bytes(r.peak_rss_bytes),
            human_bytes(r.peak_tensor_bytes),
            human_bytes(r.forecast_peak_bytes),
            human_bytes(r.bytes_sent),
            human_bytes(r.bytes_received),
        ]
        for r in result.ranks
    ]
    lines = [
        f"{result.strategy} on {result.world_size} {result.device} rank(s), "
        f"{result.dtype}: startup {result.startup_seconds:.2f} s, load "
        f"{result.load_seconds:.2f} s, plan matches shards: "
        f"{'yes' if result.plan_matches_shards else 'NO'}",
        table(LOAD_HEADERS, rows, right=range(1, len(LOAD_HEADERS))),
        "peak RSS + is resident-set growth during loading; it counts mmap'd file pages too.",
        *(f"warning [{w['code']}]: {w['message']}" for w in result.warnings or []),
        *_verify_lines(result.verify),
        *_init_check_lines(result.init_check),
    ]
    if result.profile:
        lines += _profile_lines(result.profile)
    return "\n".join(lines)


def _verify_lines(verify: dict[str, Any] | None) -> list[str]:
    if not verify:
        return []
    outcome = verdict(verify.get("ok"))
    if "max_abs_diff" in verify:
        lines = [
            f"verify: max |logits - reference| = {verify['max_abs_diff']:.3g} "
            f"(tolerance {verify['tolerance']:g}): {outcome}"
        ]
    else:
        lines = [f"verify: {outcome}: {verify.get('error')}"]
    if verify.get("note"):
        lines.append(f"  {verify['note']}")
    return lines


def _init_check_lines(check: dict[str, Any] | None) -> list[str]:
    if not check:
        return []
    agree = "yes" if check["replicated_consistent"] else "NO " + str(check["inconsistent"])
    lines = [f"random init (seed {check['seed']}): replicated tensors agree across ranks: {agree}"]
    if check["matches_single_process"] is None:
        lines.append(f"  {check.get('note', '')}")
    else:
        same = "yes" if check["matches_single_process"] else f"NO, e.g. {check['mismatched'][:3]}"
        lines.append(f"  equal to a single-process init with the same seed: {same}")
    if check.get("drawn_without_init"):
        lines.append(
            "  the model's init gives no value to "
            f"{', '.join(check['drawn_without_init'])} (its class sets them when built): drawn "
            "by tpviz's default instead (matrices normal(0, initializer_range), biases 0, "
            "others 1)"
        )
    return lines


def _profile_lines(profile: dict[str, Any], top: int = 3) -> list[str]:
    """Per rank: seconds reading, copying and in collectives, and its slowest modules."""
    ranks = [(r, s) for r, s in enumerate(profile["ranks"]) if s]
    headers = ["rank", "read s", "copy s", "collective s", "slowest modules", "s"]
    rows = []
    for r, s in ranks:
        totals = [f"{s[k]:.3f}" for k in ("read_seconds", "copy_seconds", "collective_seconds")]
        units = s["slowest_units"][:top] or [{"module": "-", "seconds": 0.0}]
        for i, unit in enumerate(units):
            first = [r, *totals] if i == 0 else [""] * 4
            rows.append([*first, unit["module"], f"{unit['seconds']:.3f}"])
    lines = ["profile:", table(headers, rows, right=(1, 2, 3, 5))] if rows else []
    if all(s.get("error") is None for _, s in ranks):
        lines.append(f"profile traces: {profile['dir']} (tensorboard --logdir {profile['dir']})")
    return lines


def compare_table(results: Sequence[Mapping[str, Any]]) -> str:
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
    for res in map(LoadResult.of, results):
        for r in res.ranks:
            ratio = r.ratio_to_sliced or {}
            rows.append(
                [
                    res.strategy,
                    r.rank,
                    f"{r.seconds:.2f}",
                    human_bytes(r.peak_rss_bytes),
                    human_bytes(r.peak_tensor_bytes),
                    human_bytes(r.bytes_sent),
                    human_bytes(r.bytes_received),
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


def load_parts(
    result: Mapping[str, Any] | None, run: Any = None, measure: str | None = None
) -> list:
    """One load: memory over time from its `run` (a `figures.MemoryRun`), or without one the
    per-rank peaks beside the forecasts; then the summary table. `result` is None while the
    load is still running."""
    from .widgets import figures

    result = LoadResult.of(result) if result is not None else None
    label = run.label if run is not None else result.strategy if result else "load"
    parts: list[Any] = [f"<h2>Load: {escape(label)}</h2>"]
    if run is not None:
        device = result.device if result and result.device else "cpu"
        parts.append(figures.memory_figure([run], measure or figures.default_measure(device)))
    elif result is not None:
        parts.append(figures.peaks_figure([result]))
    parts.append(figures.summary_figure(result) if result else "<p>Still loading.</p>")
    return parts


def html_report(
    plan: ResolvedPlan,
    results: Sequence[Mapping[str, Any]],
    events: Sequence[Sequence[Any] | None] | None = None,
    *,
    tensor: str | None = None,
    title: str = "tpviz report",
) -> str:
    """The plan's figures, then each load (`events[i]`, if given, are the events of
    `results[i]` and draw its memory over time); several loads are also overlaid."""
    from .widgets import figures

    results = [LoadResult.of(r) for r in results]
    runs = []
    for i, result in enumerate(results):
        evts = events[i] if events and i < len(events) else None
        if evts is None:
            runs.append(None)
            continue
        run = figures.memory_run(
            plan,
            result.strategy,
            result.strategy,
            result.device or "cpu",
            result.init or "checkpoint",
            color_offset=i * plan.world_size,
        )
        run.series.add(evts)
        runs.append(run)
    parts = plan_parts(plan, tensor)
    if len(results) > 1:
        parts.append("<h2>All loads</h2>")
        drawn = [r for r in runs if r is not None]
        if drawn:
            device = results[0].device or "cpu"
            parts.append(figures.memory_figure(drawn, figures.default_measure(device)))
        parts.append(figures.peaks_figure(results))
    for result, run in zip(results, runs):
        parts += load_parts(result, run)
    return html_page(title, parts)


def write_html_report(
    path: str | os.PathLike,
    plan: ResolvedPlan,
    results: Sequence[Mapping[str, Any]],
    events: Sequence[Sequence[Any] | None] | None = None,
) -> Path:
    """Write `html_report(plan, results, events)` to `path`, whole or not at all (a failure
    raises OutputWriteError naming the path); opens offline."""
    return write_text(path, html_report(plan, results, events))
