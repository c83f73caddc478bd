"""Load progress on stderr for the CLI: one bar per rank on a terminal, plain lines elsewhere.
A `label` (the strategy, in `tpviz compare`) prefixes every line and bar, and shortens plain
output to one line per phase that all ranks have reached.

Startup is shown as it happens (`startup_text`, also the notebook monitor's): the phase each
rank is in, and the seconds of each phase so far. A bar's rate counts loading time only: it
restarts when its rank begins loading."""

from __future__ import annotations

import sys
import time
from typing import Any

from .events import RankPhase
from .format import human_bytes
from .job import LoadJob
from .results import STARTUP_PHASES, LoadResult
from .tracking import RankProgress

LABELS = {name: name.replace("_", " ") for name in STARTUP_PHASES}


def _rank_marks(progress: RankProgress) -> list[float | None]:
    """A rank's startup marks; a phase it passed unheard (an events file has no heartbeat to
    mark its process start) ends where the next one does."""
    marks = list(progress.startup_marks())
    for i in reversed(range(len(marks) - 1)):
        if marks[i] is None:
            marks[i] = marks[i + 1]
    return marks


def startup_marks(progress: dict[int, RankProgress]) -> list[float | None]:
    """When each startup phase ended on every rank (the last rank's mark), None if not yet."""
    marks = [_rank_marks(p) for p in progress.values()]
    ends = []
    for i in range(len(STARTUP_PHASES)):
        reached = [m[i] for m in marks]
        ends.append(None if not reached or None in reached else max(reached))
    return ends


def startup_text(progress: dict[int, RankProgress], started: float, now: float) -> str:
    """`startup 1.2 s: process start 0.31 s · imports 0.02 s · process group 0.9 s...`: the
    phases all ranks have passed, and the one still running (`...`)."""
    parts, previous = [], started
    for name, end in zip(STARTUP_PHASES, startup_marks(progress)):
        if end is None:
            parts.append(f"{LABELS[name]} {max(0.0, now - previous):.1f} s...")
            break
        parts.append(f"{LABELS[name]} {max(0.0, end - previous):.2f} s")
        previous = max(previous, end)
    else:
        now = previous  # every rank is ready: startup is over
    return f"startup {now - started:.2f} s: " + " · ".join(parts)


def rank_startup(progress: RankProgress) -> str | None:
    """The startup phase a rank is in, or None once it is ready."""
    for name, mark in zip(STARTUP_PHASES, _rank_marks(progress)):
        if mark is None:
            return LABELS[name]
    return None


def follow(job: LoadJob, show: bool, label: str = "") -> LoadResult:
    """Wait for the job and return its result, drawing progress on stderr when `show`."""
    if not show:
        return job.wait()
    if sys.stderr.isatty():
        return _follow_bars(job, label)
    return _follow_lines(job, label)


def _follow_bars(job: LoadJob, label: str) -> LoadResult:
    from tqdm import tqdm

    prefix = f"{label} " if label else ""
    bars = {
        r: tqdm(
            total=1,
            position=r,
            desc=f"{prefix}rank {r}",
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            leave=not label,  # compare keeps its screen for the table
            file=sys.stderr,
            dynamic_ncols=True,
        )
        for r in job.progress
    }
    loading: set[int] = set()  # ranks whose bar was restarted when they began loading
    try:
        while True:
            try:
                return job.wait(timeout=0.1)
            except TimeoutError:
                pass
            finally:
                for rank, bar in bars.items():
                    _draw_bar(bar, job.progress[rank], rank in loading)
                    if rank not in loading and RankPhase.LOADING in job.progress[rank].phase_times:
                        loading.add(rank)
                        bar.reset(total=max(job.progress[rank].bytes_total, 1))
    finally:
        for bar in bars.values():
            bar.close()


def _draw_bar(bar: Any, p: RankProgress, loading: bool) -> None:
    bar.total = max(p.bytes_total, 1)
    bar.n = p.bytes_done if loading else 0
    doing = p.module or p.phase
    if not loading:
        doing = f"startup: {rank_startup(p) or p.phase}"
    bar.set_postfix_str(
        f"{p.units_done}/{p.units_total or '?'} modules {human_bytes(p.bytes_done)} {doing}",
        refresh=False,
    )
    bar.refresh()


def _follow_lines(job: LoadJob, label: str) -> LoadResult:
    """A line per rank and phase; with a label, a line per phase every rank has reached."""
    seen: dict[Any, str] = {}
    while True:
        try:
            return job.wait(timeout=0.25)
        except TimeoutError:
            pass
        finally:
            lines = _phase_lines(job, label)
            if not label and None not in startup_marks(job.progress):
                lines["startup"] = startup_text(job.progress, job.started, time.time())
            for key, line in lines.items():
                if seen.get(key) != line:
                    seen[key] = line
                    print(f"{line} at {time.strftime('%H:%M:%S')}", file=sys.stderr)


def _phase_lines(job: LoadJob, label: str) -> dict[Any, str]:
    progress = job.progress
    if not label:
        return {
            r: f"rank {r}: {p.phase} ({p.units_done}/{p.units_total or '?'} modules)"
            for r, p in progress.items()
        }
    phases = {p.phase for p in progress.values()}
    if len(phases) != 1:
        return {}
    done = min(p.units_done for p in progress.values())
    total = max(p.units_total for p in progress.values())
    phase = phases.pop()
    return {"all": f"{label}: {phase} on {len(progress)} ranks ({done}/{total} modules each)"}
