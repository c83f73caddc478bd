"""Memory samples of one load as they arrive, per rank, and the forecasts drawn beside them
(`MemoryRun`): plain data, fed with events, read by the memory figures."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from ...events import LAUNCHER_RANK, Event, Memory, Phase
from ...plan import ResolvedPlan, forecast

MAX_POINTS = 4000  # per memory line: bounds what each redraw sends to the browser


class MemorySeries:
    """The memory samples of one load, per rank, fed with events as they arrive. Times count
    from the moment loading began; each rank's baseline is its sample right before loading."""

    def __init__(self) -> None:
        self.samples: dict[int, list[Memory]] = {}
        self.loading_at: dict[int, float] = {}
        self._baseline: dict[int, int] = {}  # rank -> index of its baseline sample
        self._first: float | None = None

    def add(self, events: Iterable[Event]) -> None:
        for e in events:
            if e.rank == LAUNCHER_RANK:
                continue  # the launcher's own events
            if isinstance(e, Memory):
                self.samples.setdefault(e.rank, []).append(e)
                self._first = e.t if self._first is None else min(self._first, e.t)
            elif isinstance(e, Phase) and e.name == "loading":
                self.loading_at[e.rank] = e.t
                if self.samples.get(e.rank):
                    self._baseline[e.rank] = len(self.samples[e.rank]) - 1

    @property
    def ranks(self) -> list[int]:
        return sorted(self.samples)

    @property
    def t0(self) -> float | None:
        return min(self.loading_at.values()) if self.loading_at else self._first

    def baseline(self, rank: int) -> Memory | None:
        index = self._baseline.get(rank)
        return None if index is None else self.samples[rank][index]

    def xy(self, rank: int, measure: str) -> tuple[np.ndarray, np.ndarray]:
        """Seconds since loading began, and the measure in bytes, of the rank's samples."""
        samples = self.samples.get(rank, [])
        t0 = self.t0 or 0.0
        if measure == "rss_growth":
            index = self._baseline.get(rank)
            if index is None:
                return np.empty(0), np.empty(0)
            base = samples[index].rss
            chosen = samples[index:]
            values = [s.rss - base for s in chosen]
        else:
            chosen = [s for s in samples if getattr(s, measure) is not None]
            values = [getattr(s, measure) for s in chosen]
        xs = np.array([s.t for s in chosen], dtype=float) - t0
        return thin(xs, np.array(values, dtype=float))


def thin(xs: np.ndarray, ys: np.ndarray, limit: int = MAX_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """At most about `limit` points, evenly strided, keeping the last point and the peak."""
    if len(xs) <= limit:
        return xs, ys
    stride = math.ceil(len(xs) / limit)
    keep = np.unique(np.append(np.arange(0, len(xs), stride), [len(xs) - 1, int(ys.argmax())]))
    return xs[keep], ys[keep]


@dataclass
class MemoryRun:
    """One load on a memory chart: its samples and each rank's forecasts."""

    label: str  # the legend's name for this load, e.g. its strategy
    series: MemorySeries = field(default_factory=MemorySeries)
    shard_bytes: dict[int, int] = field(default_factory=dict)  # forecast final shard per rank
    peak_bytes: dict[int, int] = field(default_factory=dict)  # forecast peak per rank
    color_offset: int = 0  # so that overlaid loads get their own colours

    @property
    def ranks(self) -> list[int]:
        return sorted(set(self.series.ranks) | set(self.shard_bytes))


def memory_run(
    plan: ResolvedPlan,
    label: str,
    strategy: str,
    device: str = "cpu",
    init: str = "checkpoint",
    color_offset: int = 0,
) -> MemoryRun:
    """An empty run with the plan's forecasts: final shard and the strategy's peak per rank."""
    peaks = forecast(plan, strategy, device, init).peak_bytes
    return MemoryRun(
        label,
        shard_bytes=dict(enumerate(plan.per_rank_bytes)),
        peak_bytes=dict(enumerate(peaks)),
        color_offset=color_offset,
    )
