"""MemoryChart: memory over time, one line per rank and load; monitors draw into it."""

from __future__ import annotations

import threading
from typing import Any

import ipywidgets as widgets
from plotly.graph_objects import FigureWidget  # at import: it takes seconds the first time

from . import figures


class MemoryChart:
    """Memory over time, one line per rank and load, with a measure selector. Several monitors
    may share one chart: each adds its load as a run, so strategies overlay."""

    def __init__(self, measure: str = "rss_growth"):
        self.measure = widgets.Dropdown(
            options=[(label, key) for key, (label, _) in figures.MEASURES.items()],
            value=measure,
            description="measure",
            layout=widgets.Layout(width="360px"),
        )
        self.figure = FigureWidget(figures.memory_figure([], measure))
        self.runs: list[figures.MemoryRun] = []
        self.unit = figures.memory_unit([])
        self.lock = threading.RLock()  # runs are fed and drawn from several threads
        self._slots: dict[tuple[int, int], int] = {}  # (run, rank) -> its first trace
        self.measure.observe(self._on_measure, "value")
        self.widget = widgets.VBox([self.measure, self.figure])

    def add_run(self, run: figures.MemoryRun) -> None:
        with self.lock:
            run.color_offset = sum(max(len(r.ranks), 1) for r in self.runs)
            self.runs.append(run)
            unit = figures.memory_unit(self.runs)
            if unit != self.unit:  # a larger model: every run again, in the new unit
                self.unit = unit
                self.redraw()
            else:
                self.draw(run)

    def draw(self, run: figures.MemoryRun) -> None:
        """Redraw `run` for the current measure; ranks new to it get their traces."""
        with self.lock:
            index = next(i for i, r in enumerate(self.runs) if r is run)
            measure = self.measure.value
            new = []
            with self.figure.batch_update():
                for rank in run.ranks:
                    traces = figures.rank_traces(run, rank, measure, self.unit)
                    slot = self._slots.get((index, rank))
                    if slot is None:
                        new.append((rank, traces))
                        continue
                    for target, trace in zip(self.figure.data[slot : slot + len(traces)], traces):
                        target.x, target.y = trace.x, trace.y
                        target.name, target.visible = trace.name, trace.visible
            for rank, traces in new:
                self._slots[(index, rank)] = len(self.figure.data)
                self.figure.add_traces(traces)

    def redraw(self) -> None:
        """Every run again, for the current measure and unit."""
        with self.lock:
            with self.figure.batch_update():
                self.figure.layout.update(figures.memory_layout(self.measure.value, self.unit))
            for run in self.runs:
                self.draw(run)

    def _on_measure(self, _change: dict[str, Any]) -> None:
        self.redraw()

    def note(self, text: str) -> None:
        """Text across the plot (a load's startup, while its lines are still empty)."""
        with self.lock:
            shown = self.figure.layout.annotations
            if (shown[0].text if shown else "") != text:
                note = dict(text=text, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False)
                self.figure.layout.annotations = [note] if text else []
