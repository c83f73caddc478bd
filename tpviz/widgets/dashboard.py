"""Dashboard: pick a checkpoint or a demo preset, the world size, strategy, dtype and device;
edit the plan with live validation; see the PlanView; load and watch; and compare loads, whose
memory lines overlay on one chart."""

from __future__ import annotations

import json
import os
import time
from html import escape
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import torch

from ..choices import TARGET_DTYPES
from ..inputs import check_path_argument, check_world_size
from ..launcher import LoadError, LoadJob, load_next
from ..models.demo import PRESETS, cache_dir, demo_checkpoint
from ..plan import STRATEGIES, ResolvedPlan, load_plan_patterns, resolve_plan
from ..report import html_page, load_parts, plan_parts
from ..runtime.options import check_strategy
from ..suggest import Simulation, Suggestion, simulate_plan, suggest_plan
from . import figures
from .chart import MemoryChart
from .monitor import LoadMonitor
from .plan_view import PlanView, issues_html


class Dashboard(widgets.VBox):
    """One widget to choose, resolve, load and compare: `tpviz.Dashboard()`.

    Each Load runs on the previous job's ranks when they fit (warm), and adds its memory
    lines to the shared chart, labelled by strategy, so strategies compare at a glance.
    `load()` and `wait()` do from code what the Load button does.
    """

    def __init__(
        self,
        source: str | os.PathLike | None = None,
        *,
        preset: str = "tiny",
        world_size: int = 2,
        strategy: str = "sliced",
        cache: str | os.PathLike | None = None,
    ):
        self.job: LoadJob | None = None  # first: `close` (also run as a refused one is freed)
        _check_arguments(source, preset, world_size, strategy, cache)
        self.cache = Path(cache) if cache is not None else cache_dir()
        self.plan_view: PlanView | None = None
        self.monitors: list[LoadMonitor] = []
        self._patterns: dict[str, str] | None = None  # the editor's last valid plan
        self._editing = False
        self._world_size = world_size
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        self._build_controls(source, preset, strategy, devices)
        self._build_views(devices[0])
        super().__init__(
            [
                widgets.HBox([self.model, self.source]),
                widgets.HBox([self.strategy, self.dtype, self.device, self.verify, self.profile]),
                self.experts,
                widgets.HBox([self.load_button, self.status]),
                self.tabs,
            ]
        )
        self._wire_callbacks()
        self.open_source()

    def _build_controls(
        self, source: str | os.PathLike | None, preset: str, strategy: str, devices: list[str]
    ) -> None:
        """The choices above the tabs: model or demo, directory, options, the Load button."""
        self.model = widgets.Dropdown(
            # "" rather than None: a Dropdown shows a None value as no selection at all
            options=[("checkpoint directory", ""), *((f"demo: {p}", p) for p in PRESETS)],
            value="" if source is not None else preset,
            description="model",
        )
        self.source = widgets.Text(
            value=str(source or ""),
            placeholder="/path/to/checkpoint",
            description="directory",
            continuous_update=False,
            layout=widgets.Layout(width="520px"),
        )
        self.strategy = widgets.Dropdown(
            options=list(STRATEGIES), value=strategy, description="strategy"
        )
        self.dtype = widgets.Dropdown(
            options=[("checkpoint's", ""), *((d, d) for d in TARGET_DTYPES)],
            description="dtype",
        )
        self.device = widgets.Dropdown(options=devices, description="device")
        self.experts = widgets.ToggleButtons(
            options=[("experts: TP slices", "tp"), ("experts: whole per rank (EP)", "ep")],
            value="tp",
            tooltips=["every rank a slice of every expert", "each rank whole experts"],
        )
        self.verify = widgets.Checkbox(value=True, description="verify", indent=False)
        self.profile = widgets.Checkbox(value=False, description="profile", indent=False)
        self.load_button = widgets.Button(description="Load", icon="play", button_style="primary")
        self.status = widgets.HTML()

    def _build_views(self, device: str) -> None:
        """The two tabs: the plan (editor, validation, PlanView) and the loads (shared memory
        chart, the latest monitor, the comparison table)."""
        self.plan_editor = widgets.Textarea(
            rows=8,
            continuous_update=True,
            placeholder='{"layers.*.mlp.up_proj": "colwise", ...}',
            layout=widgets.Layout(width="100%"),
        )
        self.suggest_button = widgets.Button(
            description="suggest",
            icon="magic",
            tooltip="propose a plan from the model's structure, proven on simulated ranks",
        )
        self.simulate_button = widgets.Button(
            description="simulate",
            icon="check",
            tooltip="run this plan on simulated ranks: do its styles compose? (about a second)",
        )
        self.validation = widgets.HTML()
        self.plan_box = widgets.VBox()
        self.chart = MemoryChart(figures.default_measure(device))
        self.monitor_box = widgets.VBox()
        self.comparison = widgets.HTML()
        header = widgets.HTML("<b>Plan</b> (JSON: pattern → style; validated as you type)")
        tools = widgets.HBox([header, self.suggest_button, self.simulate_button])
        plan_tab = widgets.VBox([tools, self.plan_editor, self.validation, self.plan_box])
        load_tab = widgets.VBox([self.chart.widget, self.monitor_box, self.comparison])
        self.tabs = widgets.Tab([plan_tab, load_tab], titles=("Plan", "Load"))

    def _wire_callbacks(self) -> None:
        self.load_button.on_click(lambda _: self.load())
        self.device.observe(self._on_device, "value")
        self.model.observe(lambda _: self.open_source(), "value")
        self.source.observe(lambda _: self.open_source(), "value")
        self.dtype.observe(self._on_dtype, "value")
        # the layout changes the plan's keys for the experts: start again from the default plan
        self.experts.observe(lambda _: self.open_source(), "value")
        self.plan_editor.observe(self._on_plan_text, "value")
        self.suggest_button.on_click(lambda _: self.suggest())
        self.simulate_button.on_click(lambda _: self.simulate())

    # --- choosing and resolving -------------------------------------------------------------

    @property
    def plan(self) -> ResolvedPlan | None:
        return self.plan_view.plan if self.plan_view is not None else None

    def open_source(self) -> ResolvedPlan | None:
        """Resolve the chosen checkpoint (making a demo one if needed) with its default plan,
        and put that plan in the editor."""
        self.source.disabled = bool(self.model.value)
        if self.model.value:
            self.status.value = escape(f"opening the {self.model.value} demo checkpoint ...")
            path = demo_checkpoint(self.model.value, self.cache)
            if self.source.value != str(path):
                self.source.value = str(path)  # observed: opens again, with the path
                return self.plan
        elif not self.source.value.strip():
            self._patterns = None
            self.validation.value = issues_html(None, "choose a checkpoint directory or a demo")
            return None
        world_size = self.plan_view.world_size.value if self.plan_view else self._world_size
        try:
            plan = resolve_plan(
                self.source.value.strip(),
                world_size,
                dtype=self.dtype.value or None,
                experts=self.experts.value,
            )
        except (ValueError, OSError) as e:
            self._patterns = None  # nothing to load until a source resolves
            self.validation.value = issues_html(None, str(e))
            self.status.value = ""
            return None
        self._editing = True
        try:
            self.plan_editor.value = json.dumps(plan.patterns, indent=2)
        finally:
            self._editing = False
        self._show(plan)
        self.status.value = ""
        return plan

    def suggest(self) -> Suggestion | None:
        """Fill the plan editor with a plan suggested for the chosen source and world size."""
        if self.plan is None or self.plan.source is None:
            return None
        self.status.value = "suggesting a plan: proving each part on simulated ranks ..."
        try:
            found = suggest_plan(
                self.plan.source, self.plan.world_size, dtype=self.dtype.value or None
            )
        except (ValueError, OSError) as e:
            self.validation.value = issues_html(None, str(e))
            self.status.value = ""
            return None
        self.plan_editor.value = json.dumps(found.plan, indent=2)  # observed: validated, shown
        self.status.value = escape(
            f"suggested plan: shards {found.decoder_share:.1%} of the decoder layers' bytes"
        )
        return found

    def simulate(self) -> Simulation | None:
        """Run the editor's plan on simulated ranks (`tpviz.simulate_plan`): do its styles
        compose? None if there is no valid plan."""
        if reason := self._plan_problem():
            self.status.value = _error_html(reason)
            return None
        self.status.value = "simulating the plan's ranks ..."
        try:
            found = simulate_plan(self.plan)
        except (ValueError, OSError) as e:
            self.status.value = _error_html(str(e))
            return None
        self.status.value = escape(found.line()) if found.ok else _error_html(found.line())
        return found

    def _plan_problem(self) -> str | None:
        """Why the editor's plan cannot be simulated or loaded; None if it can."""
        if self.plan is None or self._patterns is None:
            return "the plan is not valid: see the Plan tab"
        return "the plan has errors: see the Plan tab" if self.plan.errors else None

    def _on_plan_text(self, change: dict[str, Any]) -> None:
        if not self._editing:
            self.validate(change["new"])

    def validate(self, text: str) -> ResolvedPlan | None:
        """Check plan JSON `text`: a parse error or the plan's errors and warnings are shown;
        a plan that resolves is shown in the PlanView (errors included)."""
        try:
            patterns = load_plan_patterns(json.loads(text))
        except json.JSONDecodeError as e:
            self._patterns = None
            self.validation.value = issues_html(
                None, f"plan JSON: line {e.lineno}, column {e.colno}: {e.msg}"
            )
            return None
        except ValueError as e:
            self._patterns = None
            self.validation.value = issues_html(None, str(e))
            return None
        if self.plan is None:
            return None
        if patterns == self.plan.patterns:  # the plan shown, unedited: resolved as it was
            patterns = self.plan.given_patterns
        try:
            plan = resolve_plan(
                self.plan.source,
                self.plan.world_size,
                patterns,
                dtype=self.dtype.value or None,
                experts=self.experts.value,
            )
        except (ValueError, OSError) as e:
            self._patterns = None
            self.validation.value = issues_html(None, str(e))
            return None
        self._show(plan)
        return plan

    def _show(self, plan: ResolvedPlan) -> None:
        self._patterns = dict(plan.patterns)
        if self.plan_view is None:
            self.plan_view = PlanView(plan)
            self.plan_view.issues.layout.display = "none"  # the editor's validation lists them
            self.plan_view.on_plan_change(self._on_plan_change)
            self.plan_box.children = [self.plan_view]
            self._on_plan_change(plan)
        else:
            self.plan_view.set_plan(plan)

    def _on_plan_change(self, plan: ResolvedPlan) -> None:
        self.validation.value = issues_html(
            plan, clear="plan valid: no warnings or errors; ready to load"
        )

    def _on_dtype(self, _change: dict[str, Any]) -> None:
        if self.plan is None:
            self.open_source()
        else:
            self.validate(self.plan_editor.value)

    def _on_device(self, change: dict[str, Any]) -> None:
        self.chart.measure.value = figures.default_measure(change["new"])

    # --- loading ----------------------------------------------------------------------------

    def load(self) -> LoadMonitor | None:
        """Close the previous job and load the current plan with the chosen options; the new
        memory lines join the chart. None (with the reason shown) if it cannot start."""
        plan = self.plan
        reason = self._plan_problem()
        if self.monitors and not self.monitors[-1].finished:
            reason = "a load is still running: wait for it or cancel it"
        if reason:
            self.status.value = _error_html(reason)
            return None
        strategy = self.strategy.value
        profile_dir = None
        if self.profile.value:
            profile_dir = self.cache / "profiles" / f"{strategy}-{time.strftime('%Y%m%d-%H%M%S')}"
        try:
            job = load_next(  # on the previous job's ranks when they fit: warm
                self.job,
                plan.source,
                plan.world_size,
                plan,
                strategy=strategy,
                device=self.device.value,
                verify=self.verify.value,
                profile_dir=profile_dir,
            )
        except (ValueError, LoadError) as e:
            self.status.value = _error_html(str(e))
            return None
        used = sum(m.job is not None and m.job.options.strategy == strategy for m in self.monitors)
        label = strategy if not used else f"{strategy} #{used + 1}"
        monitor = LoadMonitor(job, chart=self.chart, label=label)
        self.job = job
        self.monitors.append(monitor)
        self.monitor_box.children = [monitor]
        self.tabs.selected_index = 1  # the Load tab: the chart and the new monitor
        self.load_button.disabled = True
        where = f"; profiler traces go to {profile_dir}" if profile_dir else ""
        self.status.value = escape(f"loading with {label}{where}")
        monitor.on_finish(self._on_finished)
        return monitor

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait for the latest load; its result (or its error raised)."""
        if not self.monitors:
            raise RuntimeError("nothing was loaded yet")
        return self.monitors[-1].wait(timeout)

    @property
    def results(self) -> list[dict[str, Any]]:
        """The results of the loads so far, oldest first."""
        return [m.result for m in self.monitors if m.result is not None]

    def shutdown(self) -> None:
        """Close the current job (its memory lines stay on the chart)."""
        if self.job is not None:
            self.job.shutdown()
            self.job = None

    def close(self) -> None:
        self.shutdown()
        super().close()

    def to_html(self) -> str:
        """The dashboard as a self-contained HTML page: the plan, the overlaid loads and each
        load's summary (plotly.js inline, opens offline)."""
        parts: list[Any] = plan_parts(self.plan) if self.plan is not None else []
        if self.monitors:
            runs = [m.run for m in self.monitors]
            parts += ["<h2>All loads</h2>", figures.memory_figure(runs, self.chart.measure.value)]
        for m in self.monitors:
            parts += load_parts(m.result, m.run, self.chart.measure.value)
        return html_page("tpviz dashboard", parts)

    def _on_finished(self, monitor: LoadMonitor) -> None:
        self.load_button.disabled = False
        result = monitor.result
        profile = result.profile if result is not None else None
        if result is None:
            self.status.value = escape(f"{monitor.label}: {monitor.job.state}")
        elif profile:
            self.status.value = escape(
                f"{monitor.label} loaded; profiler traces in {profile['dir']}: open them with "
                f"tensorboard --logdir {profile['dir']}"
            )
        else:
            self.status.value = escape(f"{monitor.label} loaded")
        loads = [(m.label, m.result) for m in self.monitors if m.result is not None]
        self.comparison.value = figures.comparison_html(loads)


def _error_html(reason: str) -> str:
    return f'<span style="color:#b00020">{escape(reason)}</span>'


def _check_arguments(source: Any, preset: Any, world_size: Any, strategy: Any, cache: Any) -> None:
    """The Dashboard's arguments, said by name: its controls offer only valid choices, and
    one it starts with could not be corrected there."""
    for name, path in (("source", source), ("cache", cache)):
        if path is not None:
            check_path_argument(name, path, "a directory (str or os.PathLike)")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    check_world_size(world_size)
    check_strategy(strategy)
