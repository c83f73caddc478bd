"""Load progress on stderr for the CLI: one bar per rank on a terminal, plain lines elsewhere.
A `label` (the strategy, in `tpviz compare`) prefixes every line and bar, and shortens plain
output to one line per phase that all ranks have reached."""

from __future__ import annotations

import sys
import time
from typing import Any

from .format import human_bytes
from .job import LoadJob
from .results import LoadResult


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
    try:
        while True:
            try:
                return job.wait(timeout=0.1)
            except TimeoutError:
                pass
            finally:
                for rank, bar in bars.items():
                    p = job.progress[rank]
                    bar.total = max(p.bytes_total, 1)
                    bar.n = p.bytes_done
                    bar.set_postfix_str(
                        f"{p.units_done}/{p.units_total or '?'} modules "
                        f"{human_bytes(p.bytes_done)} {p.module or p.phase}",
                        refresh=False,
                    )
                    bar.refresh()
    finally:
        for bar in bars.values():
            bar.close()


def _follow_lines(job: LoadJob, label: str) -> LoadResult:
    """A line per rank and phase; with a label, a line per phase every rank has reached."""
    seen: dict[Any, str] = {}
    while True:
        try:
            return job.wait(timeout=0.25)
        except TimeoutError:
            pass
        finally:
            for key, line in _phase_lines(job, label).items():
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
