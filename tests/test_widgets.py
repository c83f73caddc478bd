"""The notebook widgets headless: figure builders, the redraw throttle, PlanView, LoadMonitor
(on one real 2-rank job, reused), the Dashboard and the HTML reports."""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time

import numpy as np
import pytest

import tpviz
from tpviz.events import (
    Done,
    Error,
    JsonlTail,
    Memory,
    Phase,
    UnitDone,
    UnitStart,
    encode,
    end_rank_files,
    events_file,
    read_events_dir,
    remove_rank_files,
)
from tpviz.format import count, layer_of
from tpviz.job import LoadJob
from tpviz.plan import RankShard, TensorPlan, forecast, local_shape, resolve_plan, shard_blocks
from tpviz.report import html_report, write_html_report
from tpviz.widgets import figures
from tpviz.widgets.monitor import MAX_UPDATES_PER_SECOND
from tpviz.widgets.throttle import Throttle

WAIT = 120  # seconds: generous bound for a tiny 2-rank load


class FakeTime:
    """An injected clock and scheduler: time moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[tuple[float, object]] = []

    def clock(self) -> float:
        return self.now

    def schedule(self, delay: float, fn) -> None:
        self.timers.append((self.now + delay, fn))

    def advance(self, seconds: float) -> None:
        self.now += seconds
        due = [t for t in self.timers if t[0] <= self.now]
        self.timers = [t for t in self.timers if t[0] > self.now]
        for _, fn in due:
            fn()

    def drain(self) -> None:
        while self.timers:
            self.advance(max(0.0, min(t for t, _ in self.timers) - self.now))


def as_bytes(values, unit: str) -> list[int]:
    """Axis values (in `unit`: powers of two, so exact) back in bytes."""
    return [round(v * figures.UNITS[unit]) for v in values]


def rectangles(trace) -> list[tuple[float, float, float, float]]:
    """The rectangles of a filled block trace: (x0, x1, y0, y1) per None-separated polygon."""
    xs, ys = list(trace.x), list(trace.y)
    out = []
    for i in range(0, len(xs), 6):
        px, py = xs[i : i + 5], ys[i : i + 5]
        assert xs[i + 5] is None and px[0] == px[-1] and py[0] == py[-1]
        out.append((min(px), max(px), min(py), max(py)))
    return out


def expected_rectangles(shard) -> list[tuple[int, int, int, int]]:
    """A 2-D block as a rectangle: columns (dim 1) across, rows (dim 0) down."""
    return [
        (b.offset[1], b.offset[1] + b.shape[1], b.offset[0], b.offset[0] + b.shape[0])
        for b in shard.blocks
    ]


def synthetic_tensor(shape, dim, world_size, parts=1, style="colwise") -> TensorPlan:
    ranks = [
        RankShard(
            r,
            local_shape(shape, dim, blocks),
            4 * math.prod(local_shape(shape, dim, blocks)),
            blocks,
        )
        for r, blocks in enumerate(shard_blocks(shape, dim, world_size, parts))
    ]
    placement = "replicate" if dim is None else f"shard({dim})"
    return TensorPlan("w", "m", style, style, placement, list(shape), "float32", [], ranks)


def memory_events(rank: int, t0: float, rss0: int, steps: int, step_bytes: int) -> list:
    """A rank that samples twice before loading, then grows by `step_bytes` per sample."""
    out = [Memory(rank, t0 - 0.2, rss=rss0 - 5, rss_anon=1, tensor_bytes=0)]
    out.append(Memory(rank, t0 - 0.01, rss=rss0, rss_anon=1, tensor_bytes=0))
    out.append(Phase(rank, t0, name="loading"))
    out += [
        Memory(
            rank, t0 + 0.05 * (i + 1), rss=rss0 + step_bytes * (i + 1), rss_anon=1, tensor_bytes=i
        )
        for i in range(steps)
    ]
    return out


# --- figure builders --------------------------------------------------------------------------


def test_bytes_by_style_adds_up_per_rank_and_hatches_replicated_bytes(uneven3):
    plan = resolve_plan(uneven3, 3)
    fig = figures.bytes_by_style_figure(plan)
    bars = [t for t in fig.data if t.type == "bar"]
    unit = fig.layout.yaxis.title.text
    assert unit == "KiB"  # about 400 KiB per rank
    for r in range(3):
        assert sum(as_bytes([t.y[r] for t in bars], unit)) == plan.per_rank_bytes[r]
    replicated = [t for t in bars if t.meta["replicated"]]
    assert replicated and all(t.marker.pattern.shape == "/" for t in replicated)
    assert all("replicated" in t.name for t in replicated)
    assert {t.meta["style"] for t in bars if not t.meta["replicated"]} >= {"colwise", "rowwise"}


@pytest.mark.parametrize(
    "shape,dim,world_size,parts",
    [
        ([1001, 96], 0, 3, 1),  # uneven rows: 334, 334, 333
        ([96, 352], 1, 3, 1),  # columns: rowwise
        ([9, 4], 0, 4, 1),  # 3, 3, 3 and an empty rank
        ([704, 96], 0, 2, 2),  # packed: two blocks per rank
    ],
)
def test_block_diagram_draws_each_rank_its_blocks_to_scale(shape, dim, world_size, parts):
    tensor = synthetic_tensor(shape, dim, world_size, parts)
    fig = figures.block_diagram_figure(tensor)
    blocks = {t.meta["rank"]: t for t in fig.data if t.meta["kind"] == "block"}
    for shard in tensor.ranks:
        if shard.blocks:
            assert sorted(rectangles(blocks[shard.rank])) == sorted(expected_rectangles(shard))
            assert blocks[shard.rank].fill == "toself"
        else:
            assert shard.rank not in blocks
            empty = [t for t in fig.data if t.meta["kind"] == "empty"]
            assert [t.meta["rank"] for t in empty] == [shard.rank]
            assert "empty" in empty[0].name and "empty" in fig.layout.title.text.split("<br>")[1]
    # the whole tensor, to scale: one unit of rows is as long as one unit of columns
    assert list(fig.layout.xaxis.range) == [0, shape[1]]
    assert list(fig.layout.yaxis.range) == [shape[0], 0]
    assert fig.layout.yaxis.scaleanchor == "x" and fig.layout.yaxis.scaleratio == 1
    # every cut falls on a tick
    cuts = {b.offset[dim] for s in tensor.ranks for b in s.blocks}
    ticks = fig.layout.yaxis.tickvals if dim == 0 else fig.layout.xaxis.tickvals
    assert cuts <= set(ticks)


@pytest.mark.parametrize("dim", [0, 2])  # expert parallel, tensor parallel
def test_stacked_experts_are_drawn_across_the_dim_they_are_cut_along(dim):
    """(experts, hidden, features): cut along features, every rank's block spans every expert,
    so dim 0 and the cut dim are drawn; cut along experts, dims 0 and 1."""
    tensor = synthetic_tensor([4, 64, 96], dim, 2, style="rowwise")
    fig = figures.block_diagram_figure(tensor)
    across = 2 if dim == 2 else 1
    for trace in (t for t in fig.data if t.meta["kind"] == "block"):
        (block,) = tensor.ranks[trace.meta["rank"]].blocks
        x0, y0 = block.offset[across], block.offset[0]
        assert rectangles(trace) == [(x0, x0 + block.shape[across], y0, y0 + block.shape[0])]
    assert fig.layout.xaxis.title.text == f"dim {across}"
    assert f"(dim {3 - across} not drawn)" in fig.layout.title.text


def test_block_diagram_of_real_plan_tensors_matches_their_offsets(uneven3):
    plan = resolve_plan(uneven3, 3)
    for t in plan.params:
        fig = figures.block_diagram_figure(t)
        if t.shard_dim is None:
            (whole,) = [d for d in fig.data if d.meta["kind"] == "replicated"]
            assert whole.meta["ranks"] == [0, 1, 2]
            continue
        for d in fig.data:
            if d.meta["kind"] == "block":
                shard = t.ranks[d.meta["rank"]]
                if len(t.global_shape) == 2:
                    assert sorted(rectangles(d)) == sorted(expected_rectangles(shard))
                else:  # 1-D: one row along x
                    want = [(b.offset[0], b.offset[0] + b.shape[0], 0, 1) for b in shard.blocks]
                    assert rectangles(d) == want


def test_representative_tensor_prefers_an_uneven_split(uneven3, tiny):
    assert figures.representative_tensor(resolve_plan(uneven3, 3).params).name.endswith(
        "embed_tokens.weight"
    )
    chosen = figures.representative_tensor(resolve_plan(tiny, 2).params)
    assert chosen.shard_dim is not None and layer_of(chosen.name) is not None


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_a_forecast_peak_equal_to_the_shard_is_one_line_labelled_both(tiny, dtype):
    plan = resolve_plan(tiny, 2, dtype=dtype)
    run = figures.memory_run(plan, "sliced", "sliced")
    run.series.add(memory_events(0, 100.0, 1000, 5, 10) + memory_events(1, 100.1, 2000, 4, 20))
    fig = figures.memory_figure([run], "rss_growth")
    same = plan.forecast["sliced"]["peak_bytes"] == plan.per_rank_bytes
    assert same == (dtype is None)  # a cast stages each slice: the peak is above the shard
    for r in (0, 1):
        (shard,) = [
            t for t in fig.data if t.meta == {"kind": "forecast_shard", "rank": r, "run": "sliced"}
        ]
        (peak,) = [
            t for t in fig.data if t.meta == {"kind": "forecast_peak", "rank": r, "run": "sliced"}
        ]
        assert shard.name.endswith("forecast shard = peak" if same else "forecast shard")
        assert peak.visible is (not same)


def test_overlaid_loads_keep_a_short_legend_grouped_per_load(tiny):
    plan = resolve_plan(tiny, 2)
    runs = [figures.memory_run(plan, s, s) for s in ("sliced", "rank0_broadcast", "replicated")]
    fig = figures.memory_figure(runs, "rss_growth")
    listed = [t for t in fig.data if t.showlegend is not False]
    assert [t.name for t in listed] == [f"{r.label} rank {k}" for r in runs for k in (0, 1)]
    assert [t.legendgroup for t in listed] == [r.label for r in runs for _ in (0, 1)]
    assert all(t.meta["kind"] == "memory" for t in listed) and len(fig.data) == 18
    # a click on an entry toggles its whole load; the legend sits below the plot
    assert fig.layout.legend.groupclick == "togglegroup"
    assert fig.layout.legend.orientation == "h" and fig.layout.legend.y < 0


def test_counts_say_tensor_for_one():
    assert count(1, "tensor") == "1 tensor" and count(2, "tensor") == "2 tensors"


def test_memory_figure_has_one_line_per_rank_and_dashed_forecasts(tiny):
    plan = resolve_plan(tiny, 2)
    run = figures.memory_run(plan, "sliced", "sliced")
    run.series.add(memory_events(0, 100.0, 1000, 5, 10) + memory_events(1, 100.1, 2000, 4, 20))
    fig = figures.memory_figure([run], "rss_growth")
    lines = [t for t in fig.data if t.meta["kind"] == "memory"]
    assert [t.meta["rank"] for t in lines] == [0, 1]
    assert all(t.line.dash is None for t in lines)
    # RSS growth counts from the sample right before loading; time from loading's start
    assert fig.layout.yaxis.title.text == "MiB"
    assert as_bytes(lines[0].y, "MiB") == [0, 10, 20, 30, 40, 50]
    assert as_bytes(lines[1].y, "MiB") == [0, 20, 40, 60, 80]
    assert lines[0].x[0] == pytest.approx(-0.01) and lines[1].x[0] == pytest.approx(0.09)
    peaks = forecast(plan, "sliced").peak_bytes
    for kind, dash, values in (
        ("forecast_shard", "dash", plan.per_rank_bytes),
        ("forecast_peak", "dashdot", peaks),
    ):
        found = [t for t in fig.data if t.meta["kind"] == kind]
        assert [t.meta["rank"] for t in found] == [0, 1]
        for t in found:
            assert t.line.dash == dash
            assert set(as_bytes(t.y, "MiB")) == {values[t.meta["rank"]]}
            assert t.x[0] <= 0 and t.x[1] >= lines[t.meta["rank"]].x[-1]
    assert "mmap" in fig.layout.title.text  # says what RSS counts


def test_memory_measures_absolute_rss_sits_forecasts_on_the_baseline(tiny):
    plan = resolve_plan(tiny, 2)
    run = figures.memory_run(plan, "sliced", "sliced")
    run.series.add(memory_events(0, 100.0, 1000, 3, 10))
    traces = figures.rank_traces(run, 0, "rss")
    assert as_bytes(traces[0].y, "MiB") == [995, 1000, 1010, 1020, 1030]
    assert set(as_bytes(traces[1].y, "MiB")) == {1000 + plan.per_rank_bytes[0]}
    cuda = figures.rank_traces(run, 0, "cuda_allocated")
    assert len(cuda[0].x) == 0  # no CUDA samples on CPU: an empty line, not zeros


def test_overlaid_runs_are_named_and_coloured_apart(tiny):
    plan = resolve_plan(tiny, 2)
    runs = [
        figures.memory_run(plan, s, s, color_offset=2 * i)
        for i, s in enumerate(("sliced", "replicated"))
    ]
    fig = figures.memory_figure(runs, "rss_growth")
    lines = [t for t in fig.data if t.meta["kind"] == "memory"]
    assert [t.name for t in lines] == [
        "sliced rank 0",
        "sliced rank 1",
        "replicated rank 0",
        "replicated rank 1",
    ]
    assert len({t.line.color for t in lines}) == 4


def test_thinning_keeps_the_peak_and_the_last_point():
    xs = np.arange(10_000, dtype=float)
    ys = xs % 97
    ys[5_001] = 10**6
    tx, ty = figures.thin(xs, ys, limit=1000)
    assert len(tx) <= 1002 and tx[-1] == 9_999 and 10**6 in ty


# --- throttle ---------------------------------------------------------------------------------


def test_throttle_caps_a_burst_of_ten_thousand_requests():
    fake = FakeTime()
    calls = []
    throttle = Throttle(
        lambda: calls.append(fake.now), 10.0, clock=fake.clock, schedule=fake.schedule
    )
    for _ in range(10_000):  # all at the same instant
        throttle.request()
    assert len(calls) == 1
    fake.drain()
    assert len(calls) == 2  # and one more for the state after the burst
    calls.clear()
    for _ in range(10_000):  # 10,000 over 2 s
        fake.advance(0.0002)
        throttle.request()
    fake.drain()
    assert len(calls) <= 2 * 10 + 2
    assert all(b - a >= 0.1 - 1e-9 for a, b in zip(calls, calls[1:]))


def test_monitor_redraws_at_most_ten_times_a_second_however_many_events(tiny):
    fake = FakeTime()
    plan = resolve_plan(tiny, 2)
    monitor = tpviz.LoadMonitor(plan=plan)
    # the monitor's own throttle, on the test's clock: time moves only as the events say
    monitor._throttle = Throttle(
        monitor._refresh, MAX_UPDATES_PER_SECOND, clock=fake.clock, schedule=fake.schedule
    )
    start = monitor.updates
    t = 1000.0
    for i in range(10_000):  # one event every 0.1 ms: 1 s of events
        fake.advance(0.0001)
        t += 0.0001
        event = Memory(i % 2, t, rss=10**8 + i, rss_anon=None, tensor_bytes=i)
        monitor.feed([event])
    fake.drain()
    assert monitor.updates - start <= 10 + 2
    lines = [d for d in monitor.chart.figure.data if d.meta["kind"] == "memory"]
    assert len(lines) == 2
    monitor.chart.measure.value = "tensor_bytes"
    assert as_bytes(lines[1].y, monitor.chart.unit)[-1] == 9_999  # the last event was drawn


# --- PlanView ---------------------------------------------------------------------------------


def test_plan_view_table_filters_badges_and_issues(tiny):
    plan = resolve_plan(tiny, 2, {"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.w9": "rowwise"})
    view = tpviz.PlanView(plan)
    table = view.table.value
    assert table.count("<details") == 2  # one per layer, collapsible
    assert "tpviz-badge" in table and "embed_tokens" in table
    # up_proj's shard on each rank; shape and bytes each kept whole (a cell wraps between them)
    nowrap = '<span class="tpviz-nw">{}</span>'
    assert f"{nowrap.format('176×128')} · {nowrap.format('88.0 KiB')}" in table
    assert "unmatched_pattern" in view.issues.value and "w9" in view.issues.value
    view.name_filter.value = "layers.1.*proj"
    names = {t.name for t in view.visible_tensors()}
    assert names and all(n.startswith("model.layers.1.") and "proj" in n for n in names)
    assert "embed_tokens" not in view.table.value
    view.name_filter.value = ""
    view.style_filter.value = "colwise"
    assert {t.name for t in view.visible_tensors()} == {
        f"model.layers.{i}.mlp.up_proj.weight" for i in (0, 1)
    }
    assert set(view.tensor.options) == {t.name for t in view.visible_tensors()}


def test_plan_view_world_size_control_resolves_live(tiny):
    view = tpviz.PlanView(resolve_plan(tiny, 2))
    seen = []
    view.on_plan_change(seen.append)
    view.world_size.value = 3
    assert view.plan.world_size == 3 and view.plan.errors
    assert (
        "head_alignment" in view.issues.value
        and "world sizes that work: 1, 2, 4" in view.issues.value
    )
    view.world_size.value = 4
    assert not view.plan.errors and "no warnings or errors" in view.issues.value
    assert [p.world_size for p in seen] == [3, 4]
    bars = [t for t in view.bytes_figure.data if t.type == "bar"]
    assert len(bars[0].x) == 4
    view.select("model.layers.0.mlp.down_proj.weight")
    blocks = [t for t in view.block_figure.data if t.meta["kind"] == "block"]
    tensor = view.plan.tensor("model.layers.0.mlp.down_proj.weight")
    assert len(blocks) == 4
    for d in blocks:
        assert rectangles(d) == expected_rectangles(tensor.ranks[d.meta["rank"]])
    html = view.to_html()
    assert "down_proj" in html and "<script src=" not in html


# a refused widget is freed at once: its close (ipywidgets' __del__) must not fail either
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_widgets_refuse_arguments_of_the_wrong_kind_naming_them(tiny):
    plan = resolve_plan(tiny, 2)
    with pytest.raises(
        TypeError, match="LoadMonitor follows a LoadJob .* give a ResolvedPlan as plan="
    ):
        tpviz.LoadMonitor(plan)
    with pytest.raises(TypeError, match="LoadMonitor follows a LoadJob .*, not a str"):
        tpviz.LoadMonitor(str(tiny))
    for rate in (0, -1.0, "10", True):
        with pytest.raises(ValueError, match="max_rate must be a number of redraws a second"):
            tpviz.LoadMonitor(plan=plan, max_rate=rate)
    with pytest.raises(
        TypeError, match=r"PlanView shows a ResolvedPlan: PlanView\(tpviz.resolve_plan"
    ):
        tpviz.PlanView(str(tiny))
    for kwargs, message in [
        (dict(strategy="nope"), "unknown strategy 'nope'"),
        (dict(preset="huge"), "unknown preset 'huge' (choose from tiny, small, medium"),
        (dict(world_size=0), "world size must be a positive integer, got 0"),
        (dict(source=5), "source must be a directory"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            tpviz.Dashboard(**kwargs)


def test_views_resolve_a_default_plan_again_as_the_default(tmp_path):
    """A model's default plan names modules other variants have (Qwen2-MoE's dense MLP, which
    a model whose every layer is sparse lacks): resolved again for another world size or
    dtype, it is still the default, not keys of the user's that match nothing."""
    transformers = pytest.importorskip("transformers")
    from .hf_tiny import TINY_DIMS

    config = transformers.AutoConfig.for_model(
        "qwen2_moe", **TINY_DIMS, num_experts=4, moe_intermediate_size=32
    )
    config.save_pretrained(tmp_path)
    view = tpviz.PlanView(resolve_plan(tmp_path, 2))
    view.world_size.value = 4
    assert view.plan.world_size == 4 and view.plan.given_patterns is None
    assert "unmatched_pattern" not in view.issues.value
    board = tpviz.Dashboard(str(tmp_path), cache=tmp_path / "cache")
    for dtype in ("bfloat16", ""):
        board.dtype.value = dtype
        assert board.plan.given_patterns is None
        assert "unmatched_pattern" not in board.validation.value
    edited = {**board.plan.patterns, "model.layers.*.mlp.nothing": "colwise"}
    board.plan_editor.value = json.dumps(edited)  # edited: the user's keys, warned about
    assert board.plan.given_patterns == edited and "nothing" in board.validation.value
    board.close()


# --- LoadMonitor on a real job ----------------------------------------------------------------


@pytest.fixture(scope="module")
def monitored(tiny, tmp_path_factory):
    """One verified 2-rank load, watched from the start and written to an events dir. The job
    takes in none of its ranks' messages until the monitor's constructor has returned (on a
    busy machine a tiny load can otherwise end while widgets are built), so the job is still
    starting then, unless the constructor waits for it: it would then never return, which
    the bound on its thread catches."""
    events_dir = tmp_path_factory.mktemp("events")
    constructed = threading.Event()
    handle = LoadJob._handle

    def held(job, rank, message):
        constructed.wait(WAIT)
        handle(job, rank, message)

    made: list[tpviz.LoadMonitor] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LoadJob, "_handle", held)
        job = tpviz.launch(tiny, 2, verify=True, timeout=WAIT, events_dir=events_dir)
        start = time.monotonic()
        maker = threading.Thread(target=lambda: made.append(tpviz.LoadMonitor(job)))
        maker.start()
        maker.join(WAIT)
        built = time.monotonic() - start
        state_after_constructor = job.state
        constructed.set()
    assert made, "LoadMonitor(job) did not return while the job was held"
    monitor = made[0]
    monitor.wait(WAIT)
    yield job, monitor, built, state_after_constructor, events_dir
    job.shutdown()


@pytest.mark.slow
def test_monitor_does_not_block_while_the_job_loads(monitored):
    job, monitor, built, state, _ = monitored
    assert state == "starting"  # the constructor returned while the ranks still started
    assert monitor.updates >= 2  # and redraws came later, from background threads


@pytest.mark.slow
def test_monitor_draws_one_memory_line_per_rank_with_dashed_forecasts(monitored):
    job, monitor, *_ = monitored
    data = monitor.chart.figure.data
    lines = [t for t in data if t.meta["kind"] == "memory"]
    assert [t.meta["rank"] for t in lines] == [0, 1] and all(len(t.x) > 1 for t in lines)
    shards = {t.meta["rank"]: t for t in data if t.meta["kind"] == "forecast_shard"}
    peaks = {t.meta["rank"]: t for t in data if t.meta["kind"] == "forecast_peak"}
    for r in range(2):
        unit = monitor.chart.unit
        assert shards[r].line.dash == "dash" and peaks[r].line.dash == "dashdot"
        assert set(as_bytes(shards[r].y, unit)) == {job.plan.per_rank_bytes[r]}
        assert set(as_bytes(peaks[r].y, unit)) == {job.result["ranks"][r]["forecast_peak_bytes"]}
    monitor.chart.measure.value = "rss"
    assert as_bytes(lines[0].y, monitor.chart.unit)[0] > 10**8  # imported torch and all
    monitor.chart.measure.value = "rss_growth"


@pytest.mark.slow
def test_monitor_progress_bars_reach_their_end_and_summary_appears(monitored):
    job, monitor, *_ = monitored
    units = len(job.plan.units())
    for r, (bar, text) in monitor._bars.items():
        assert bar.value == bar.max == job.progress[r].bytes_total and bar.bar_style == "success"
        assert f"{units}/{units} modules" in text.value
    assert (
        "loaded:" in monitor.status.value and "shards match the plan: yes" in monitor.status.value
    )
    summary = monitor.summary.value
    assert '<table class="tpviz-summary">' in summary and "verification ok" in summary
    assert summary.count("<tr>") == 3  # header and one row per rank
    assert monitor.cancel_button.disabled and monitor.cancel_button.layout.display == "none"
    assert monitor.wait(1) is job.result


@pytest.mark.slow
def test_monitor_to_html_and_report_are_self_contained(monitored, tmp_path):
    job, monitor, *_ = monitored
    html = monitor.to_html()
    assert "Memory per rank" in html and "tpviz-summary" not in html  # figures, not widgets
    assert re.search(r"<script[^>]+src=", html) is None and "plotly.js v" in html
    path = write_html_report(tmp_path / "r.html", job.plan, [job.result])
    text = path.read_text()
    assert "Peak memory per rank" in text and "Bytes per rank by style" in text
    assert re.search(r"<script[^>]+src=", text) is None
    with_events = html_report(job.plan, [job.result, job.result], [job.events, None])
    assert with_events.count("Memory per rank") == 2  # the overlay and the first load
    assert with_events.count("plotly.js v") == 1  # inlined once


@pytest.mark.slow
def test_monitor_follows_an_events_dir(monitored):
    job, _, _, _, events_dir = monitored
    follower = tpviz.LoadMonitor.from_events_dir(events_dir, poll_seconds=0.05)
    result = follower.wait(30)
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    assert result["world_size"] == 2 and result["plan_matches_shards"] is True
    lines = [t for t in follower.chart.figure.data if t.meta["kind"] == "memory"]
    assert len(lines) == 2 and all(len(t.x) > 1 for t in lines)
    peaks = [t for t in follower.chart.figure.data if t.meta["kind"] == "forecast_peak"]
    unit = follower.chart.unit
    want = [{r["forecast_peak_bytes"]} for r in result["ranks"]]
    assert [set(as_bytes(t.y, unit)) for t in peaks] == want
    assert "tpviz-summary" in follower.summary.value
    units = len(job.plan.units())
    assert all(bar.value == bar.max == units for bar, _ in follower._bars.values())


def _write_events(directory, events, mode="a"):
    with open(events_file(directory, events[0].rank), mode, encoding="utf-8") as f:
        f.writelines(encode(e) + "\n" for e in events)


def test_a_follower_reads_a_new_loads_file_from_its_start(tmp_path):
    """Each load's files start empty: a follower that had read further into the last one's
    reads the new one from its first line."""
    _write_events(tmp_path, [Phase(0, 1.0, name="loading"), Phase(0, 2.0, name="loaded")])
    tail = JsonlTail(tmp_path)
    assert [e.t for e in tail.read_new()] == [1.0, 2.0]
    _write_events(tmp_path, [Phase(0, 5.0, name="starting")], mode="w")
    assert [e.t for e in tail.read_new()] == [5.0]
    # emptied in place (same inode, as load_sharded's ranks do) and grown past where the last
    # read ended before the next read: still read from its first line
    with open(events_file(tmp_path, 0), "r+", encoding="utf-8") as f:
        f.truncate(0)
        f.writelines(encode(Phase(0, 9.0 + i, name="loading")) + "\n" for i in range(3))
    assert [e.t for e in tail.read_new()] == [9.0, 10.0, 11.0]
    (tmp_path / "rank7.jsonl").write_text("")  # an earlier run's rank, and a file of the user's
    (tmp_path / "rank.jsonl").write_text("not a rank's")
    remove_rank_files(tmp_path, beyond=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank.jsonl", "rank0.jsonl"]


def test_a_follower_says_where_each_rank_was_once_their_files_stop_growing(tmp_path):
    """A killed rank writes nothing more: after `silence_seconds` without a new line the status
    says where each rank was, and following goes on (here, to the rank's error)."""
    _write_events(
        tmp_path,
        [
            Phase(0, 1.0, name="loading"),
            UnitStart(0, 1.1, module="a", bytes=8, index=0, total=4),
            UnitDone(0, 1.2, module="a", bytes=8, seconds=0.1, index=0, total=4),
            UnitStart(0, 1.3, module="model.layers.1.mlp", bytes=8, index=1, total=4),
        ],
    )
    silent = threading.Event()
    follower = tpviz.LoadMonitor.from_events_dir(tmp_path, poll_seconds=0.02, silence_seconds=0.2)
    follower.status.observe(
        lambda change: "no rank has written" in change["new"] and silent.set(), "value"
    )
    assert "no rank has written" in follower.status.value or silent.wait(30)
    assert "rank 0 was loading model.layers.1.mlp (unit 2 of 4)" in follower.status.value
    assert "still following" in follower.status.value and not follower.finished
    _write_events(tmp_path, [Error(0, 9.0, message="the rank's own last words")])
    with pytest.raises(tpviz.LoadError, match="the rank's own last words"):
        follower.wait(30)
    assert "no rank has written" not in follower.status.value


@pytest.mark.parametrize(
    "content, reason",
    [
        ('{"v":1,"type":"done","rank":0}', "done event: t is missing, not float"),
        ("[1, 2, 3]", "an event is a JSON object, not list"),
        ('{"v":1,"type":"unit_start","rank":0,"t":1,"module":"a","bytes":8,"index":0,'
         '"total":-1}', "unit_start event: total is -1, below 0 or not finite"),
        ('{"v":1,"type":"memory","rank":0,"t":1,"rss":"a lot","rss_anon":null,'
         '"tensor_bytes":0}', 'memory event: rss is "a lot", not int'),
        ('{"v":2,"type":"phase","rank":0,"t":1,"name":"x"}', "event format version 2"),
        ("[" * 100_000 + "]" * 100_000, "JSON nested too deeply"),
        (b'{"v":1,"type":"phase","rank":0,"t":1,"name":"\xff"}', "not UTF-8 text (byte 45)"),
    ],
    ids=["missing", "list", "negative", "kind", "version", "deep", "utf8"],
)  # fmt: skip
def test_a_follower_of_lines_that_are_not_events_fails_naming_file_and_line(
    tmp_path, content, reason
):
    """Files written by something else (or by hand) end the follower's wait with the file and
    line; its thread died and wait() waited forever before."""
    _write_events(tmp_path, [Phase(0, 1.0, name="loading")])
    raw = content if isinstance(content, bytes) else content.encode()
    with open(events_file(tmp_path, 0), "ab") as f:
        f.write(raw + b"\n")
    follower = tpviz.LoadMonitor.from_events_dir(tmp_path, poll_seconds=0.02)
    with pytest.raises(tpviz.LoadError) as error:
        follower.wait(30)
    assert f"cannot read events: {events_file(tmp_path, 0)} line 2: {reason}" in str(error.value)


def test_a_follower_refuses_what_is_not_an_events_dir_or_file(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="file: an events dir must be a directory"):
        tpviz.LoadMonitor.from_events_dir(tmp_path / "file")
    os.mkfifo(events_file(tmp_path, 0))  # its open would block the follower for good
    with pytest.raises(tpviz.LoadError, match="rank0.jsonl: an events file must be a regular"):
        tpviz.LoadMonitor.from_events_dir(tmp_path, poll_seconds=0.02).wait(30)


def test_files_the_launcher_ends_read_as_failed_even_where_a_rank_was_cut_off(tmp_path):
    """A rank killed as it wrote leaves half a line; the launcher ends every file that has no
    `done` or `error` yet with its own, and a follower skips the cut line."""
    _write_events(tmp_path, [Phase(0, 1.0, name="loading")])
    with open(events_file(tmp_path, 0), "a", encoding="utf-8") as f:
        f.write('{"v":1,"type":"memo')  # cut off here
    _write_events(tmp_path, [Done(1, 2.0, result={})])
    tail = JsonlTail(tmp_path)
    assert len(tail.read_new()) == 2  # the cut line waits, as a line still being written would
    end_rank_files(tmp_path, ["model.layers.0.mlp", None, None], "the load was cancelled", 3.0)
    new = tail.read_new()
    assert [(type(e).__name__, e.rank) for e in new] == [("Error", 0), ("Error", 2)]
    assert new[0].message == "the job ended: the load was cancelled"
    assert new[0].module == "model.layers.0.mlp"
    assert len(read_events_dir(tmp_path)) == 4  # rank 1's done is its own end: left alone
    end_rank_files(tmp_path, [None] * 3, "again", 4.0)  # every file has its end now
    assert tail.read_new() == []
    # ranks ended before any made the dir (a --events dir is made by the first rank to write)
    end_rank_files(tmp_path / "new", [None, None], "the load was cancelled", 5.0)
    assert [e.rank for e in read_events_dir(tmp_path / "new")] == [0, 1]


def test_a_ranks_own_error_after_its_peer_failed_is_followed_by_the_jobs_cause(tmp_path):
    """A rank whose collective broke when its peer died or failed writes an error of its own;
    the launcher still ends its file with the job's cause, so that a follower names the cause,
    and leaves the error of the rank that failed the job as that rank's end."""
    _write_events(tmp_path, [Error(0, 1.0, message="Connection closed by peer")])
    _write_events(tmp_path, [Error(1, 1.5, message="bad read")])
    end_rank_files(tmp_path, [None, None], "rank 1 failed: bad read", 2.0, cause=1)
    last = {e.rank: e for e in read_events_dir(tmp_path)}
    assert last[0].message == "the job ended: rank 1 failed: bad read"
    assert last[1].message == "bad read"


@pytest.mark.slow
def test_cancel_button_really_cancels(tiny):
    job = tpviz.launch(tiny, 2, timeout=WAIT)
    monitor = tpviz.LoadMonitor(job)
    monitor.cancel_button.click()
    assert job.state == "cancelled"
    with pytest.raises(tpviz.LoadError, match="cancelled"):
        monitor.wait(30)
    assert "cancelled" in monitor.status.value and monitor.cancel_button.disabled
    assert monitor.cancel_button.layout.display == "none"  # the job is over: no button stays
    assert all(bar.bar_style == "danger" for bar, _ in monitor._bars.values())
    assert job._procs == []  # every rank ended
    job.shutdown()


def test_events_carry_what_the_monitor_tracks():
    monitor = tpviz.LoadMonitor(max_rate=math.inf)  # every event drawn as it comes
    monitor.feed(
        [
            Phase(0, 1.0, name="loading"),
            UnitStart(0, 1.1, module="a", bytes=8, index=0, total=2),
            UnitDone(0, 1.2, module="a", bytes=8, seconds=0.1, index=0, total=2),
            UnitStart(0, 1.3, module="b", bytes=4, index=1, total=2),
        ]
    )
    bar, text = monitor._bars[0]
    assert (bar.value, bar.max) == (1, 2) and "1/2 modules" in text.value and "· b" in text.value
    monitor.feed(
        [
            Done(
                0,
                2.0,
                result={
                    "rank": 0,
                    "seconds": 0.1,
                    "load_seconds": 0.2,
                    "param_bytes": 12,
                    "planned_bytes": 12,
                    "peak_rss_bytes": 0,
                    "peak_tensor_bytes": 12,
                    "forecast_peak_bytes": 12,
                },
            )
        ]
    )
    assert monitor.wait(5)["ranks"][0]["param_bytes"] == 12


# --- Dashboard --------------------------------------------------------------------------------


@pytest.mark.slow
def test_dashboard_validates_loads_and_overlays_strategies(tmp_path):
    dash = tpviz.Dashboard(cache=tmp_path)
    assert dash.source.value == str(tmp_path / "demo-tiny") and dash.plan.world_size == 2
    good = dash.plan_editor.value
    assert json.loads(good)["lm_head"] == "colwise_gather_output"
    dash.plan_editor.value = good[:-3]
    assert "plan JSON: line" in dash.validation.value
    dash.plan_editor.value = good.replace('"rowwise"', '"rowwize"', 1)
    assert "unknown_style" in dash.validation.value and "rowwise" in dash.validation.value
    assert dash.load() is None and "errors" in dash.status.value
    dash.plan_editor.value = good
    dash.plan_view.world_size.value = 3
    assert "head_alignment" in dash.validation.value and dash.load() is None
    # listed once: beside the editor, not again in the plan view below it
    assert dash.plan_view.issues.layout.display == "none"
    dash.plan_view.world_size.value = 2
    assert "plan valid" in dash.validation.value
    # valid plans whose styles do not compose show before a load, on simulated ranks
    dash.plan_editor.value = good.replace('"rowwise"', '"colwise"')
    assert "plan valid" in dash.validation.value
    dash.simulate_button.click()
    assert "FAILED" in dash.status.value and "forward fails in" in dash.status.value
    dash.plan_editor.value = good
    assert dash.simulate().ok and dash.status.value.endswith(": ok")
    try:
        dash.load()
        first = dash.wait(WAIT)
        dash.strategy.value = "rank0_broadcast"
        dash.profile.value = True
        dash.load()
        second = dash.wait(WAIT)
    finally:
        dash.shutdown()
    assert [r["strategy"] for r in dash.results] == ["sliced", "rank0_broadcast"]
    assert first["verify"]["ok"] and second["verify"]["ok"]
    lines = [t for t in dash.chart.figure.data if t.meta["kind"] == "memory"]
    assert [t.name for t in lines] == [
        "sliced rank 0",
        "sliced rank 1",
        "rank0_broadcast rank 0",
        "rank0_broadcast rank 1",
    ]
    assert all(len(t.x) > 1 for t in lines)
    profile = second["profile"]["dir"]
    assert profile.startswith(str(tmp_path / "profiles")) and any(
        p.suffix == ".json" or p.name.endswith(".pt.trace.json") for p in _files(profile)
    )
    assert f"tensorboard --logdir {profile}" in dash.status.value
    assert dash.comparison.value.count("<tr>") == 3
    assert dash.to_html().count("Memory per rank") == 3  # the overlay and each load


def _files(directory):
    from pathlib import Path

    return [p for p in Path(directory).rglob("*") if p.is_file()]


def test_lazy_exports_are_the_widget_classes():
    from tpviz.widgets.dashboard import Dashboard
    from tpviz.widgets.monitor import LoadMonitor
    from tpviz.widgets.plan_view import PlanView

    assert (tpviz.PlanView, tpviz.LoadMonitor, tpviz.Dashboard) == (
        PlanView,
        LoadMonitor,
        Dashboard,
    )
