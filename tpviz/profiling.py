"""torch.profiler wiring: one TensorBoard worker per rank, a range per unit and per phase.

Traces are written with `tensorboard_trace_handler(DIR, worker_name="rank{r}")`, which the
torch-tb-profiler plugin reads (`tensorboard --logdir DIR`). Without a profile dir nothing
here runs: the load path then has no profiler in it at all.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function, tensorboard_trace_handler

UNIT_PREFIX = "tpviz.load/"
PHASE_PREFIX = "tpviz.phase/"

# Time categories of the summary, by the profiler op names that fall in them.
CATEGORIES = {
    "collectives": ("c10d::", "nccl:", "gloo:", "record_param_comms"),
    "copies": ("aten::copy_", "aten::_to_copy", "aten::to", "Memcpy"),
}


class RankProfiler:
    def __init__(self, prof: profile):
        self.prof = prof
        self._units: dict[str, float] = {}

    def span(self, name: str) -> contextlib.AbstractContextManager:
        return record_function(name)

    def summary(self, top: int = 5) -> dict[str, Any]:
        """The slowest units and the split of time between reads, copies and collectives,
        from the events of this rank's trace (microseconds -> seconds)."""
        units: dict[str, float] = {}
        categories: dict[str, float] = defaultdict(float)
        unit_total = 0.0
        for evt in self.prof.events():
            seconds = evt.time_range.elapsed_us() / 1e6
            if evt.name.startswith(UNIT_PREFIX):
                module = evt.name[len(UNIT_PREFIX) :]
                units[module] = units.get(module, 0.0) + seconds
                unit_total += seconds
                continue
            for category, prefixes in CATEGORIES.items():
                if evt.name.startswith(prefixes):
                    categories[category] += seconds
                    break
        slowest = sorted(units.items(), key=lambda kv: kv[1], reverse=True)[:top]
        copies = categories["copies"]
        collectives = categories["collectives"]
        return {
            "slowest_units": [{"module": m, "seconds": s} for m, s in slowest],
            "unit_seconds": unit_total,
            "copy_seconds": copies,
            "collective_seconds": collectives,
            "read_seconds": max(0.0, unit_total - copies - collectives),
        }


@contextlib.contextmanager
def rank_profiler(
    profile_dir: str | None, rank: int, device: torch.device
) -> Iterator[RankProfiler | None]:
    """Profile the load on this rank into `profile_dir`; yields None when not profiling."""
    if not profile_dir:
        yield None
        return
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(
        activities=activities,
        profile_memory=True,
        record_shapes=True,
        on_trace_ready=tensorboard_trace_handler(profile_dir, worker_name=f"rank{rank}"),
    ) as prof:
        profiler = RankProfiler(prof)
        with record_function(PHASE_PREFIX + "loading"):
            yield profiler
