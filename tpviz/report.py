"""Human-readable summaries of plans and load results (text tables), and HTML reports."""

from __future__ import annotations

import re
from collections.abc import Sequence
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


def _shape(shape: list[int]) -> str:
    return "x".join(map(str, shape)) if shape else "scalar"


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
        rows.append(
            [label, style, _shape(list(shape)), *(_shape(list(s)) for s in shards), rank_bytes]
        )
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
