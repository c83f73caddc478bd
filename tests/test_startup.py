"""Startup as it happens: the text the CLI and the monitor show before loading begins."""

from __future__ import annotations

import math

from tpviz.events import Phase, RankPhase
from tpviz.messages import Beat
from tpviz.progress import rank_startup, startup_text
from tpviz.tracking import ProgressTracker, RankProgress


def tracker_at(marks: dict[int, dict[str, float]], heard: dict[int, float]) -> ProgressTracker:
    tracker = ProgressTracker()
    for rank, phases in marks.items():
        tracker.ranks[rank] = RankProgress()
        for name, t in phases.items():
            tracker.track(Phase(rank, t, name=name))
    for rank, t in heard.items():
        tracker.heard(rank, t)
    return tracker


def test_startup_text_shows_passed_phases_and_the_running_one():
    tracker = tracker_at({0: {RankPhase.STARTING: 100.5}, 1: {}}, {0: 100.25, 1: 100.75})
    ranks = tracker.ranks
    assert rank_startup(ranks[0]) == "process group" and rank_startup(ranks[1]) == "imports"
    # a phase ends when its last rank passes it; the running one counts up to now
    assert startup_text(ranks, 100.0, 102.0) == (
        "startup 2.00 s: process start 0.75 s · imports 1.2 s..."
    )


def test_startup_text_is_final_once_every_rank_is_ready():
    done = {RankPhase.STARTING: 101.0, RankPhase.SKELETON: 101.5, RankPhase.READY: 102.0}
    tracker = tracker_at({0: done, 1: {**done, RankPhase.READY: 102.5}}, {0: 100.5, 1: 100.5})
    text = startup_text(tracker.ranks, 100.0, 999.0)
    assert text == (
        "startup 2.50 s: process start 0.50 s · imports 0.50 s · process group 0.50 s · "
        "skeleton 1.00 s"
    )
    assert all(rank_startup(p) is None for p in tracker.ranks.values())


def test_a_rank_read_late_was_up_when_it_sent_its_first_heartbeat():
    """A forked rank can pass every phase before the launcher's pump reads its pipe: its
    process start ends when it sent its first heartbeat, not when that was read."""
    done = {RankPhase.STARTING: 100.2, RankPhase.SKELETON: 100.3, RankPhase.READY: 100.4}
    tracker = tracker_at({0: done}, {0: 100.5})
    tracker.beat(0, Beat(100.1))
    assert startup_text(tracker.ranks, 100.0, 999.0) == (
        "startup 0.40 s: process start 0.10 s · imports 0.10 s · process group 0.10 s · "
        "skeleton 0.10 s"
    )


def test_ranks_followed_from_event_files_pass_their_unheard_process_start():
    # an events file has no heartbeat: the process start ends where the imports do
    tracker = tracker_at({0: {RankPhase.STARTING: 101.0}}, {})
    assert rank_startup(tracker.ranks[0]) == "process group"
    assert startup_text(tracker.ranks, 100.0, 101.5).startswith(
        "startup 1.50 s: process start 1.00 s · imports 0.00 s · process group 0.5 s..."
    )


def test_the_monitor_shows_startup_on_its_chart_until_loading_begins(tiny):
    import tpviz
    from tpviz.plan import resolve_plan

    # every event drawn as it comes, in this thread
    monitor = tpviz.LoadMonitor(plan=resolve_plan(tiny, 2), max_rate=math.inf)
    t = monitor._started
    monitor.feed([Phase(0, t + 1.0, name=RankPhase.STARTING)])
    note = monitor.chart.figure.layout.annotations[0].text
    assert note.startswith("load: startup") and "process start" in note  # rank 1 is in it
    assert "rank 0 process group, rank 1 process start" in monitor.status.value
    ready = [RankPhase.SKELETON, RankPhase.READY, RankPhase.LOADING]
    monitor.feed([Phase(r, t + 2.0, name=n) for r in (0, 1) for n in [RankPhase.STARTING, *ready]])
    assert monitor.chart.figure.layout.annotations == ()  # the lines take over
    assert "startup" not in monitor.status.value


def test_the_forkserver_preloads_what_a_rank_of_the_model_imports(tmp_path, tiny):
    from tpviz.rankserver import rank_imports

    from .conftest import write_config

    hf = write_config(tmp_path / "hf", model_type="gpt_oss")
    modeling = ["transformers", "transformers.models.gpt_oss.modeling_gpt_oss"]
    assert rank_imports(hf, "auto") == modeling
    assert rank_imports(hf / "model.safetensors", None) == modeling  # a file: its directory's
    assert rank_imports(hf, "hf-remote-code") == ["transformers"]  # its code is the checkpoint's
    assert rank_imports(tiny, "auto") == []  # tpviz's own Llama: nothing beyond torch
    assert rank_imports(hf, "my_models:build") == []  # a factory's import could run anything
    assert rank_imports(tmp_path / "missing", "auto") == []  # the load reports that itself
