"""LoadMonitor: follow a LoadJob, or the event files of a torchrun job, live in a notebook.

Events arrive on the job's pump thread (or a file-following thread); they are queued and drawn
by a throttled redraw, at most ~10 a second whatever the event rate, so the kernel's own
thread stays free: other cells run while a load is in progress.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from html import escape
from typing import Any

import ipywidgets as widgets

from ..events import Done, Event, JobState, JsonlTail
from ..format import human_bytes
from ..job import HEARTBEAT_TIMEOUT
from ..launcher import LoadError, LoadJob
from ..liveness import files_silence_message
from ..plan import ResolvedPlan
from ..progress import rank_startup, startup_text
from ..report import html_page, load_parts, plan_parts
from ..results import LoadResult, RankResult, slowest_load
from ..tracking import ProgressTracker
from . import figures
from .chart import MemoryChart
from .throttle import Throttle

MAX_UPDATES_PER_SECOND = 10.0

_CSS = """<style>
.tpviz-summary { border-collapse: collapse; font-size: 12px; margin: 4px 0; }
.tpviz-summary td, .tpviz-summary th { padding: 2px 8px; border-bottom: 1px solid #ddd;
  text-align: right; }
.tpviz-status.failed, .tpviz-status.cancelled { color: #b00020; }
</style>"""


class LoadMonitor(widgets.VBox):
    """Live view of a load: `LoadMonitor(tpviz.launch(ckpt, 2))`.

    Memory per rank over time with its forecasts, a progress bar per rank, a status line, a
    Cancel button, and after loading a summary table with the verification result. Pass
    `chart` to draw into a shared `MemoryChart`; `max_rate` caps redraws a second.
    """

    def __init__(
        self,
        job: LoadJob | None = None,
        *,
        plan: ResolvedPlan | None = None,
        chart: MemoryChart | None = None,
        label: str | None = None,
        max_rate: float = MAX_UPDATES_PER_SECOND,
    ):
        self._stop = threading.Event()  # first: `close` (also run as a refused one is freed)
        self._unsubscribe: Callable[[], None] | None = None
        _check_arguments(job, plan, max_rate)
        self.job = job
        self.plan = job.plan if job is not None else plan
        device = job.device if job is not None else "cpu"
        strategy = job.options.strategy if job is not None else None
        self.label = label or strategy or "load"
        if self.plan is not None and job is not None:
            self.run = figures.memory_run(
                self.plan, self.label, job.options.strategy, device, job.options.init
            )
        else:
            self.run = figures.MemoryRun(self.label)
            if self.plan is not None:
                self.run.shard_bytes = dict(enumerate(self.plan.per_rank_bytes))
        self.chart = chart or MemoryChart(figures.default_measure(device))
        self.updates = 0  # redraws so far: the throttle keeps them to `max_rate` a second
        self.result: LoadResult | None = None
        self.tracker = ProgressTracker(self.plan)  # the same progress a job keeps
        self._bars: dict[int, tuple[widgets.FloatProgress, widgets.HTML]] = {}
        self._pending: list[Event] = []
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._unreadable = ""  # why the followed events dir cannot be read
        self._finish_callbacks: list[Callable[[LoadMonitor], None]] = []
        self._started = time.time()
        self._silence: tuple[float, str] | None = None  # followed files unchanged: (s, dir)
        self.status = widgets.HTML()
        self.cancel_button = widgets.Button(
            description="Cancel", icon="stop", button_style="warning", disabled=job is None
        )
        self.cancel_button.on_click(lambda _: self.cancel())
        self.progress = widgets.VBox()
        self.summary = widgets.HTML()
        self._throttle = Throttle(self._refresh, max_rate)
        children = [widgets.HTML(_CSS), self.status]
        if chart is None:
            children.append(self.chart.widget)
        children += [self.progress, self.cancel_button, self.summary]
        super().__init__(children)
        self.chart.add_run(self.run)
        if job is not None:
            self._unsubscribe = job.subscribe(self._on_event)  # replays what came before
        self._throttle.request()

    @classmethod
    def from_events_dir(
        cls,
        path: str | os.PathLike,
        plan: ResolvedPlan | None = None,
        *,
        poll_seconds: float = 0.2,
        silence_seconds: float = HEARTBEAT_TIMEOUT,
        label: str = "torchrun",
        **kwargs: Any,
    ) -> LoadMonitor:
        """Follow the `rank*.jsonl` files a torchrun job writes (`load_sharded(...,
        events_dir=path)`) from a background thread until every rank is done or fails. With
        the job's `plan`, byte totals and final shards are drawn from the start; the forecast
        peaks (and without a plan, the shards) appear with each rank's result. A rank that is
        killed writes nothing more: when no file has grown for `silence_seconds` (a loading
        rank writes its memory many times a second), the status says where each rank was,
        and following goes on."""
        if os.path.exists(path) and not os.path.isdir(path):  # a job makes it if absent
            raise ValueError(f"{path}: an events dir must be a directory (torchrun's events_dir)")
        monitor = cls(None, plan=plan, label=label, **kwargs)
        tail = JsonlTail(path)

        def follow() -> None:
            heard = time.monotonic()
            while not (monitor._finished.is_set() or monitor._stop.is_set()):
                try:
                    events = tail.read_new()
                except (OSError, ValueError) as e:  # the load's end, as the monitor can see it
                    monitor._unreadable = f"cannot read events: {e}"
                    monitor._throttle.request()
                    return
                now = time.monotonic()
                if events:
                    heard = now
                    monitor.feed(events)
                quiet = now - heard
                monitor._note_silence(quiet if quiet >= silence_seconds else None, str(path))
                monitor._stop.wait(poll_seconds)

        threading.Thread(target=follow, name="tpviz-events-tail", daemon=True).start()
        return monitor

    # --- public -----------------------------------------------------------------------------

    def feed(self, events: list[Event]) -> None:
        """Queue events for the next redraw (a job's events are fed by its subscription)."""
        with self._lock:
            self._pending.extend(events)
        self._throttle.request()

    def cancel(self) -> None:
        """Cancel the job: every rank is ended."""
        if self.job is not None:
            self.job.cancel()
        self._throttle.request()

    def wait(self, timeout: float | None = None) -> LoadResult:
        """Block until the load has finished and its summary is drawn; the load result, or the
        job's error raised."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"the load is still running after {timeout} s")
        if self.job is not None and self.job.error is not None:
            raise self.job.error
        if self.result is None:
            raise LoadError(f"the load ended without a result: {self._error()}")
        return self.result

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def on_finish(self, callback: Callable[[LoadMonitor], None]) -> None:
        """Call `callback(monitor)` once the load has finished (at once if it has)."""
        with self._lock:
            done = self._finished.is_set()
            if not done:
                self._finish_callbacks.append(callback)
        if done:
            callback(self)

    def summary_view(self) -> widgets.HTML:
        """The summary table as its own widget, to show it again in a later cell."""
        return widgets.HTML(_CSS + self.summary.value)

    def stop(self) -> None:
        """Stop following: no more redraws from the job or the event files."""
        self._stop.set()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def close(self) -> None:
        self.stop()
        super().close()

    def to_html(self) -> str:
        """The monitor as a self-contained HTML page (plotly.js inline, opens offline)."""
        parts = plan_parts(self.plan) if self.plan is not None else []
        parts += load_parts(self.result, self.run, self.chart.measure.value)
        return html_page(f"tpviz load: {self.label}", parts)

    # --- events and redraws -----------------------------------------------------------------

    def _note_silence(self, seconds: float | None, path: str) -> None:
        """The followed files have not grown for `seconds` (None: they grow)."""
        if (seconds, self._silence) != (None, None):
            self._silence = None if seconds is None else (seconds, path)
            self._throttle.request()

    def _on_event(self, event: Event) -> None:
        with self._lock:
            self._pending.append(event)
        self._throttle.request()

    def _refresh(self) -> None:
        with self._lock:
            events, self._pending = self._pending, []
        with self.chart.lock:
            self.run.series.add(events)
        for event in events:
            self.tracker.track(event)
            if isinstance(event, Done):
                self._note_forecasts(event)
        self.updates += 1
        self.chart.draw(self.run)
        self._draw_progress()
        state = self._state()
        self._draw_status(state)
        if state.finished and not self._finished.is_set():
            self._finish(state)

    def _note_forecasts(self, event: Done) -> None:
        """Without a job, a rank's result is where its forecasts come from."""
        entry = RankResult.of(event.result)
        self.run.shard_bytes.setdefault(event.rank, entry.planned_bytes)
        self.run.peak_bytes.setdefault(event.rank, entry.forecast_peak_bytes)

    def _state(self) -> JobState:
        if self.job is not None:
            return self.job.state
        ranks = self.tracker.ranks.values()
        if self._unreadable or any(r.error for r in ranks):
            return JobState.FAILED
        if self.tracker.results() is not None:
            return JobState.LOADED
        return JobState.STARTING

    def _error(self) -> str:
        if self.job is not None and self.job.error is not None:
            return str(self.job.error)
        return self._unreadable or self.tracker.first_error()

    def _draw_progress(self) -> None:
        failed = self._state() in (JobState.FAILED, JobState.CANCELLED)
        for r in sorted(self.tracker.ranks):
            rank = self.tracker.ranks[r]
            if r not in self._bars:
                bar = widgets.FloatProgress(min=0.0, max=1.0, layout={"width": "320px"})
                text = widgets.HTML()
                self._bars[r] = (bar, text)
                self.progress.children = [*self.progress.children, widgets.HBox([bar, text])]
            bar, text = self._bars[r]
            if rank.bytes_total:
                value, top = rank.bytes_done, rank.bytes_total
                amount = f"{human_bytes(rank.bytes_done)} / {human_bytes(rank.bytes_total)}"
            else:
                value, top = rank.units_done, rank.units_total or 1
                amount = f"{human_bytes(rank.bytes_done)}"
            loaded = rank.loaded
            with bar.hold_sync():
                bar.max = float(top)
                bar.value = float(min(value, top))
                bar.bar_style = "danger" if failed else "success" if loaded else "info"
            where = f" · {escape(rank.module)}" if rank.module and not loaded else ""
            text.value = (
                f"rank {r}: {amount} · {rank.units_done}/{rank.units_total} modules · "
                f"{escape(rank.phase)}{where}"
            )

    def _draw_status(self, state: JobState) -> None:
        job = self.job
        seconds = time.time() - self._started
        ranks = self.tracker.ranks
        if job is not None:
            ranks = job.progress  # the job also knows when it first heard each rank
        if state is JobState.FAILED:
            text = f"failed: {self._error()}"
        elif state is JobState.CANCELLED:
            text = "cancelled: every rank was ended"
        elif self.result is not None or (job is not None and job.result and state.finished):
            result = self.result or job.result
            text = "loaded: " + figures.headline(result)
            if state in (JobState.CLOSING, JobState.CLOSED):
                text += f" (job {state})"
        elif self._silence is not None and not state.finished:
            text = files_silence_message(*self._silence, self.tracker.ranks)
        elif state is JobState.VERIFYING:
            text = "verifying the sharded model against a single-process reference ..."
        elif ranks and any(rank_startup(p) for p in ranks.values()):
            started = job.started if job is not None else self._started
            startup = startup_text(ranks, started, time.time())
            self.chart.note(f"{self.label}: {startup}")
            doing = ", ".join(f"rank {r} {rank_startup(ranks[r]) or 'ready'}" for r in ranks)
            text = f"{self.label}: {startup} ({doing})"
        else:
            phases = ", ".join(f"rank {r} {ranks[r].phase}" for r in sorted(ranks))
            text = f"{self.label}: {phases or 'waiting for ranks'} ({seconds:.1f} s)"
        if state is not JobState.STARTING or not any(rank_startup(p) for p in ranks.values()):
            self.chart.note("")  # the lines tell the rest
        self.status.value = f'<div class="tpviz-status {state}">{escape(text)}</div>'

    def _finish(self, state: JobState) -> None:
        if self.job is not None:
            self.result = self.job.result
        elif state is JobState.LOADED:
            entries = self.tracker.results() or []
            self.result = LoadResult(
                strategy=self.label,
                world_size=len(entries),
                load_seconds=slowest_load(entries),
                plan_matches_shards=all(e.plan_matches_shards for e in entries),
                ranks=entries,
            )
        if self.result is not None and state not in (JobState.FAILED, JobState.CANCELLED):
            self.summary.value = summary_html(self.result)
        self.cancel_button.disabled = True
        self.cancel_button.layout.display = "none"  # nothing left to cancel
        self._draw_status(state)
        with self._lock:
            callbacks, self._finish_callbacks = self._finish_callbacks, []
            self._finished.set()
        for callback in callbacks:
            callback(self)


def summary_html(result: LoadResult) -> str:
    """The per-rank summary table of a load, its headline and its verification result."""
    headers, rows = figures.summary_rows(result)
    lines = [f"<b>{escape(figures.headline(result))}</b>"]
    if text := figures.verify_text(result):
        lines.append(escape(text))
    lines.append("peak RSS growth counts mmap'd checkpoint pages too")
    table = figures.table_html(headers, rows, "tpviz-summary")
    return f"<div>{'<br>'.join(lines)}</div>{table}"


def _check_arguments(job: Any, plan: Any, max_rate: Any) -> None:
    """A monitor follows a LoadJob, or (with `from_events_dir`) draws against a plan, and
    redraws some positive number of times a second (`math.inf`: at every event)."""
    if job is not None and not isinstance(job, LoadJob):
        hint = "; give a ResolvedPlan as plan=" if isinstance(job, ResolvedPlan) else ""
        raise TypeError(
            f"LoadMonitor follows a LoadJob (from tpviz.launch), not a {type(job).__name__}{hint}"
        )
    if plan is not None and not isinstance(plan, ResolvedPlan):
        raise TypeError(f"plan must be a ResolvedPlan (tpviz.resolve_plan), not {plan!r}")
    if isinstance(max_rate, bool) or not isinstance(max_rate, int | float) or not max_rate > 0:
        raise ValueError(f"max_rate must be a number of redraws a second above 0, not {max_rate!r}")
