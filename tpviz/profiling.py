"""torch.profiler wiring: one TensorBoard worker per rank, a range per unit and per phase.

Traces are written as `DIR/rank{r}.<ns>.pt.trace.json`, the names `tensorboard_trace_handler`
gives, which the torch-tb-profiler plugin reads (`tensorboard --logdir DIR`). A trace that
cannot be written (a full disk) is noted in the rank's profile summary (`error`) with its path:
the load result is kept. The loader marks its work with
`span(name)`: a `record_function` range while profiling, `contextlib.nullcontext` otherwise,
so without a profile dir the load path has no profiler in it at all.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from .outputs import write_error

UNIT_PREFIX = "tpviz.load/"
PHASE_PREFIX = "tpviz.phase/"
READ, COPY, COLLECTIVE = "tpviz.read", "tpviz.copy", "tpviz.collective"


def no_span(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


class RankProfiler:
    def __init__(self) -> None:
        self.prof: profile | None = None
        self.trace: str | None = None  # the file written
        self.error: dict[str, str] | None = None  # or why it was not

    @staticmethod
    def span(name: str) -> contextlib.AbstractContextManager:
        return record_function(name)

    def summary(self, top: int = 5) -> dict[str, Any]:
        """The slowest units, and the time spent reading, copying and in collectives, from
        this rank's profiler events (seconds)."""
        units: dict[str, float] = {}
        totals = {READ: 0.0, COPY: 0.0, COLLECTIVE: 0.0}
        for evt in self.prof.events():
            seconds = evt.time_range.elapsed_us() / 1e6
            if evt.name.startswith(UNIT_PREFIX):
                module = evt.name[len(UNIT_PREFIX) :]
                units[module] = units.get(module, 0.0) + seconds
            elif evt.name in totals:
                totals[evt.name] += seconds
        slowest = sorted(units.items(), key=lambda kv: kv[1], reverse=True)[:top]
        summary = {
            "slowest_units": [{"module": m, "seconds": s} for m, s in slowest],
            "unit_seconds": sum(units.values()),
            "read_seconds": totals[READ],
            "copy_seconds": totals[COPY],
            "collective_seconds": totals[COLLECTIVE],
            "trace": self.trace,
        }
        if self.error is not None:
            summary["error"] = self.error
        return summary


def _trace_writer(profile_dir: str, rank: int, out: RankProfiler) -> Callable[[profile], None]:
    def write(prof: profile) -> None:
        path = os.path.join(profile_dir, f"rank{rank}.{time.time_ns()}.pt.trace.json")
        try:
            os.makedirs(profile_dir, exist_ok=True)
            prof.export_chrome_trace(path)
        except (OSError, RuntimeError) as e:
            out.error = write_error("profile", profile_dir, path, str(e))
            return
        # kineto writes PATH.tmp and renames it; a failed write only logs to stderr
        if not os.path.isfile(path):
            with contextlib.suppress(OSError):
                os.unlink(path + ".tmp")
            reason = "the profiler could not write it (is the disk full?)"
            out.error = write_error("profile", profile_dir, path, reason)
            return
        out.trace = path

    return write


@contextlib.contextmanager
def rank_profiler(
    profile_dir: str | None, rank: int, device: torch.device
) -> Iterator[RankProfiler | None]:
    """Profile what runs inside into `profile_dir`; yields None when not profiling."""
    if not profile_dir:
        yield None
        return
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    out = RankProfiler()
    out.prof = profile(
        activities=activities,
        profile_memory=True,
        record_shapes=True,
        on_trace_ready=_trace_writer(profile_dir, rank, out),
    )
    with _quiet_kineto():
        out.prof.start()
    try:
        yield out
    finally:
        with _quiet_kineto():
            out.prof.__exit__(None, None, None)  # stop, write the trace, clean up


# kineto's notes on every start and stop (`USDT:… profiler_start`, `STAGE:… Warm Up`)
_KINETO_NOTE = re.compile(rb"^(USDT|STAGE):\S+ \S+ \d+:\d+ \S+\] ")


@contextlib.contextmanager
def _quiet_kineto() -> Iterator[None]:
    """Hold what is written to fd 2 meanwhile and pass on all but kineto's notes: kineto prints
    them from C++ on every start and stop, and no setting turns them off."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held if not _KINETO_NOTE.match(line)]
            if kept:
                os.write(2, b"".join(kept))
