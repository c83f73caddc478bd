"""torch.profiler wiring: one TensorBoard worker per rank, a range per unit and per phase.

Traces are written with `tensorboard_trace_handler(DIR, worker_name="rank{r}")`, which the
torch-tb-profiler plugin reads (`tensorboard --logdir DIR`). The loader marks its work with
`span(name)`: a `record_function` range while profiling, `contextlib.nullcontext` otherwise,
so without a profile dir the load path has no profiler in it at all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function, tensorboard_trace_handler

UNIT_PREFIX = "tpviz.load/"
PHASE_PREFIX = "tpviz.phase/"
READ, COPY, COLLECTIVE = "tpviz.read", "tpviz.copy", "tpviz.collective"


def no_span(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


class RankProfiler:
    def __init__(self, prof: profile):
        self.prof = prof

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
        return {
            "slowest_units": [{"module": m, "seconds": s} for m, s in slowest],
            "unit_seconds": sum(units.values()),
            "read_seconds": totals[READ],
            "copy_seconds": totals[COPY],
            "collective_seconds": totals[COLLECTIVE],
        }


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
    handler = tensorboard_trace_handler(profile_dir, worker_name=f"rank{rank}")
    with profile(
        activities=activities, profile_memory=True, record_shapes=True, on_trace_ready=handler
    ) as prof:
        yield RankProfiler(prof)
