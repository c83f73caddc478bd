"""PlanView: explore a ResolvedPlan in a notebook.

The module table folds by layer, the bar chart splits each rank's bytes by style, the block
diagram draws a selected tensor as its ranks hold it, the plan's issues stay in plain view, and
a world-size control re-resolves the plan live.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from copy import deepcopy
from html import escape
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.graph_objects import FigureWidget  # at import: it takes seconds the first time

from ..format import count, human_bytes, layer_of, shape_text
from ..plan import ResolvedPlan, TensorPlan, resolve_plan
from ..report import html_page, plan_parts
from . import figures

_CSS = """<style>
.tpviz-plan table { border-collapse: collapse; width: 100%; table-layout: fixed; font-size: 12px; }
.tpviz-plan td, .tpviz-plan th { padding: 2px 6px; border-bottom: 1px solid #eee; text-align: left;
  overflow-wrap: anywhere; }
.tpviz-plan td:first-child { overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
.tpviz-plan summary { cursor: pointer; padding: 3px 0; font-weight: 600; }
.tpviz-badge { border-radius: 8px; padding: 0 6px; color: #222; font-size: 11px;
  display: inline-block; white-space: nowrap; }
.tpviz-empty { color: #b00020; font-weight: 600; }
.tpviz-nw { white-space: nowrap; }
.tpviz-issues div { padding: 4px 8px; margin: 2px 0; border-radius: 4px; }
.tpviz-issues .error { background: #fde7e9; color: #8b0016; }
.tpviz-issues .warning { background: #fff4d6; color: #6b4500; }
.tpviz-issues .ok { background: #e6f4ea; color: #1e5631; }
</style>"""


def badge(style: str, given: str | None = None) -> str:
    title = f' title="given as {escape(given)}"' if given and given != style else ""
    return (
        f'<span class="tpviz-badge" style="background:{figures.style_color(style)}"{title}>'
        f"{escape(style)}</span>"
    )


def issues_html(
    plan: ResolvedPlan | None, failure: str | None = None, clear: str = "no warnings or errors"
) -> str:
    """Errors, then warnings, each on its own line; the `clear` line when there are none."""
    lines = [f'<div class="error">{escape(failure)}</div>'] if failure else []
    if plan is not None:
        lines += [
            f'<div class="error">error [{escape(i.code)}]: {escape(i.message)}</div>'
            for i in plan.errors
        ]
        lines += [
            f'<div class="warning">warning [{escape(i.code)}]: {escape(i.message)}</div>'
            for i in plan.warnings
        ]
    if not lines:
        lines = [f'<div class="ok">{escape(clear)}</div>']
    return f'<div class="tpviz-issues">{"".join(lines)}</div>'


def _nowrap(text: str) -> str:
    return f'<span class="tpviz-nw">{text}</span>'


def _rank_cell(t: TensorPlan, rank: int) -> str:
    """Shape and bytes each kept whole: a narrow cell wraps between them, never inside one."""
    shard = t.ranks[rank]
    shape = _nowrap(shape_text(shard.shape))
    if t.shard_dim is None:
        return f"{shape} full · {_nowrap(human_bytes(shard.bytes))}"
    if not shard.blocks:
        return f'<span class="tpviz-empty">empty ({shape})</span>'
    parts = f" in {len(shard.blocks)} blocks" if len(shard.blocks) > 1 else ""
    return f"{shape}{parts} · {_nowrap(human_bytes(shard.bytes))}"


def _table(rows: list[TensorPlan], world_size: int, prefix: str) -> str:
    widths = f'<col style="width:{28 if world_size < 4 else 22}%"><col><col><col>'
    headers = ["tensor", "style", "placement", "global", *(f"rank {r}" for r in range(world_size))]
    head = "".join(f"<th>{h}</th>" for h in headers)
    body = []
    for t in rows:
        name = t.name[len(prefix) + 1 :] if prefix else t.name
        extra = ""
        if t.tied_to:
            extra += f" (tied: {escape(', '.join(t.tied_to))})"
        if t.origin == "computed":
            extra += " (computed)"
        cells = [
            f'<td title="{escape(t.name)}">{escape(name)}{extra}</td>',
            f"<td>{badge(t.style, t.style_given)}</td>",
            f"<td>{t.placement}</td>",
            f"<td>{shape_text(t.global_shape)}</td>",
            *(f"<td>{_rank_cell(t, r)}</td>" for r in range(world_size)),
        ]
        body.append(f"<tr>{''.join(cells)}</tr>")
    return f"<table><colgroup>{widths}</colgroup><tr>{head}</tr>{''.join(body)}</table>"


def table_html(plan: ResolvedPlan, tensors: list[TensorPlan], open_all: bool = False) -> str:
    """The module table in load order; each layer's tensors fold into a `<details>` block."""
    segments: list[tuple[str | None, list[TensorPlan]]] = []
    for t in tensors:
        layer = layer_of(t.name)
        if segments and segments[-1][0] == layer:
            segments[-1][1].append(t)
        else:
            segments.append((layer, [t]))
    out = []
    first_layer = True
    for layer, rows in segments:
        table = _table(rows, plan.world_size, layer or "")
        if layer is None:
            out.append(table)
            continue
        styles = "".join(badge(s) for s in dict.fromkeys(t.style for t in rows))
        per_rank = sum(t.ranks[0].bytes for t in rows)
        opened = " open" if open_all or first_layer else ""
        first_layer = False
        out.append(
            f"<details{opened}><summary>{escape(layer)}: {count(len(rows), 'tensor')}, "
            f"{human_bytes(per_rank)} on rank 0 {styles}</summary>{table}</details>"
        )
    if not tensors:
        out.append("<p>No tensor matches the filter.</p>")
    return f'<div class="tpviz-plan">{"".join(out)}</div>'


def _experts_grid(plan: ResolvedPlan, module: str | None) -> go.Figure:
    """The experts x ranks grid of one MoE layer (empty for a model without experts)."""
    return figures.experts_grid_figure(plan, module) if module else go.Figure()


def _first(items: list[str]) -> str | None:
    return items[0] if items else None


def replace_figure(widget: FigureWidget, fig: go.Figure) -> None:
    """Swap a FigureWidget's content in place (a new FigureWidget would resend plotly's
    bundle of several MB to the browser)."""
    widget.data = ()
    widget.add_traces(fig.data)
    widget.layout = fig.layout
    # The edits above reach the browser as messages, which it drops while plotly's front end
    # is still loading; a view reads the figure from the widget's state when it first renders,
    # and plotly refreshes that state only when the widget itself is displayed, never as a
    # child of a box: refresh it here.
    widget._widget_data = deepcopy(widget._data)
    widget._widget_layout = deepcopy(widget._layout_obj._props)


class PlanView(widgets.VBox):
    """Explore a ResolvedPlan: `PlanView(tpviz.resolve_plan(ckpt, 2))`. Changing the world
    size resolves the plan's own patterns (or the model's default plan) again."""

    def __init__(self, plan: ResolvedPlan):
        if not isinstance(plan, ResolvedPlan):
            raise TypeError(
                f"PlanView shows a ResolvedPlan: PlanView(tpviz.resolve_plan(source, "
                f"world_size)), not {plan!r}"
            )
        self.plan = plan
        self._listeners: list[Callable[[ResolvedPlan], None]] = []
        self._syncing = False
        self.header = widgets.HTML()
        self.world_size = widgets.BoundedIntText(
            value=plan.world_size,
            min=1,
            max=4096,
            description="world size",
            disabled=plan.source is None,  # an in-memory module cannot be re-resolved here
            layout=widgets.Layout(width="170px"),
        )
        self.name_filter = widgets.Text(
            placeholder="q_proj, layers.1.*",
            description="name",
            continuous_update=True,
            layout=widgets.Layout(width="280px"),
        )
        self.style_filter = widgets.Dropdown(description="style")
        self.issues = widgets.HTML()
        # drawn from the start: the state a FigureWidget opens with always reaches the browser
        self.bytes_figure = FigureWidget(figures.bytes_by_style_figure(plan))
        self.experts_figure = FigureWidget(
            _experts_grid(plan, _first(figures.experts_modules(plan)))
        )
        self.experts_layer = widgets.Dropdown(
            description="MoE layer", layout=widgets.Layout(width="480px")
        )
        # shown for MoE models only
        self.experts_box = widgets.VBox([self.experts_layer, self.experts_figure])
        self.tensor = widgets.Dropdown(description="tensor", layout=widgets.Layout(width="600px"))
        self.block_figure = FigureWidget(
            figures.block_diagram_figure(figures.representative_tensor(plan.params))
        )
        self.table = widgets.HTML()
        self.world_size.observe(self._on_world_size, "value")
        self.name_filter.observe(self._on_filter, "value")
        self.style_filter.observe(self._on_filter, "value")
        self.tensor.observe(self._on_tensor, "value")
        self.experts_layer.observe(self._on_experts_layer, "value")
        super().__init__(
            [
                widgets.HTML(_CSS),
                self.header,
                widgets.HBox([self.world_size, self.name_filter, self.style_filter]),
                self.issues,
                self.bytes_figure,
                self.experts_box,
                self.tensor,
                self.block_figure,
                self.table,
            ]
        )
        self.set_plan(plan)

    # --- public -----------------------------------------------------------------------------

    def set_plan(self, plan: ResolvedPlan) -> None:
        """Show another plan (e.g. resolved for another world size or plan)."""
        self.plan = plan
        self._syncing = True
        try:
            self.world_size.value = plan.world_size
            counts: dict[str, int] = {}
            for t in plan.params:
                counts[t.style] = counts.get(t.style, 0) + 1
            # "" rather than None: a Dropdown shows a None value as no selection at all
            options = [("all styles", ""), *((f"{s} ({n})", s) for s, n in counts.items())]
            keep = self.style_filter.value if self.style_filter.value in counts else ""
            self.style_filter.options = options
            self.style_filter.value = keep
            moes = figures.experts_modules(plan)  # the same layer stays picked where it exists
            layer = self.experts_layer.value if self.experts_layer.value in moes else _first(moes)
            self.experts_layer.options = moes
            self.experts_layer.value = layer
        finally:
            self._syncing = False
        self.header.value = self._header()
        self.issues.value = issues_html(plan)
        replace_figure(self.bytes_figure, figures.bytes_by_style_figure(plan))
        self._draw_experts()
        self._refilter()
        for listener in list(self._listeners):
            listener(plan)

    def resolve(self, world_size: int | None = None) -> ResolvedPlan | None:
        """Resolve the plan again (for `world_size`, default the current one) and show it; a
        source that cannot be read is shown as an error and gives None."""
        if self.plan.source is None:
            return None
        size = self.plan.world_size if world_size is None else world_size
        try:
            plan = resolve_plan(
                self.plan.source,
                size,
                self.plan.given_patterns,
                dtype=self.plan.dtype,
                model=self.plan.model,
                experts=self.plan.experts,
                kv_replication=self.plan.kv_replication,
            )
        except (ValueError, OSError) as e:
            self.issues.value = issues_html(None, f"cannot resolve for {size} rank(s): {e}")
            return None
        self.set_plan(plan)
        return plan

    def on_plan_change(self, callback: Callable[[ResolvedPlan], None]) -> None:
        """Call `callback(plan)` whenever the view shows another plan."""
        self._listeners.append(callback)

    def select(self, name: str) -> None:
        """Draw the block diagram of tensor `name`."""
        t = self.plan.tensor(name)
        if t.name not in self.tensor.options:
            self.tensor.options = [*self.tensor.options, t.name]
        self.tensor.value = t.name

    def visible_tensors(self) -> list[TensorPlan]:
        """The tensors that pass the name and style filters."""
        pattern = self.name_filter.value.strip()
        style = self.style_filter.value

        def name_ok(name: str) -> bool:
            if not pattern:
                return True
            if any(c in pattern for c in "*?["):
                return fnmatch.fnmatchcase(name, f"*{pattern}*")
            return pattern in name

        return [
            t
            for t in self.plan.params
            if (not style or t.style == style) and any(map(name_ok, [t.name, *t.tied_to]))
        ]

    def to_html(self) -> str:
        """The view as a self-contained HTML page (plotly.js inline, opens offline)."""
        return html_page("tpviz plan", plan_parts(self.plan, self.tensor.value))

    # --- internals --------------------------------------------------------------------------

    def _header(self) -> str:
        plan = self.plan
        per_rank = ", ".join(
            f"rank {r} {human_bytes(b)}" for r, b in enumerate(plan.per_rank_bytes)
        )
        return (
            f"<b>{escape(str(plan.source))}</b><br>{plan.world_size} rank(s), {plan.dtype}, "
            f"{count(len(plan.params), 'tensor')}, model {human_bytes(plan.total_bytes)}; "
            f"per rank: {per_rank}"
        )

    def _refilter(self) -> None:
        shown = self.visible_tensors()
        filtering = bool(self.name_filter.value.strip() or self.style_filter.value)
        self.table.value = table_html(self.plan, shown, open_all=filtering)
        current = self.tensor.value
        names = [t.name for t in shown] or [t.name for t in self.plan.params]
        if current is not None:  # the same tensor in a plan resolved again, by any of its names
            try:
                current = self.plan.tensor(current).name
            except KeyError:
                current = None
        if current not in names:
            current = None
        if current is None:
            wanted = set(names)
            candidates = [t for t in self.plan.params if t.name in wanted]
            current = figures.representative_tensor(candidates).name
        self._syncing = True
        try:
            self.tensor.options = names
            self.tensor.value = current
        finally:
            self._syncing = False
        self._draw_tensor(current)

    def _draw_tensor(self, name: str) -> None:
        replace_figure(self.block_figure, figures.block_diagram_figure(self.plan.tensor(name)))

    def _on_world_size(self, change: dict[str, Any]) -> None:
        if not self._syncing and change["new"] != self.plan.world_size:
            self.resolve(change["new"])

    def _on_filter(self, _change: dict[str, Any]) -> None:
        if not self._syncing:
            self._refilter()

    def _on_experts_layer(self, change: dict[str, Any]) -> None:
        if not self._syncing:
            self._draw_experts()

    def _draw_experts(self) -> None:
        module = self.experts_layer.value
        replace_figure(self.experts_figure, _experts_grid(self.plan, module))
        self.experts_box.layout.display = "" if module else "none"

    def _on_tensor(self, change: dict[str, Any]) -> None:
        if not self._syncing and change["new"] is not None:
            self._draw_tensor(change["new"])
