"""Per-rank progress from events: the one tracker behind LoadJob.progress, the CLI's progress
lines and LoadMonitor's bars."""

from __future__ import annotations

from dataclasses import dataclass, field

from .events import LAUNCHER_RANK, Done, Error, Event, Phase, RankPhase, UnitDone, UnitStart
from .messages import Beat
from .plan import ResolvedPlan
from .results import RankResult


@dataclass
class RankProgress:
    """What is known of one rank, from its events."""

    units_done: int = 0
    units_total: int = 0
    bytes_done: int = 0
    bytes_total: int = 0  # known from the plan; 0 when there is none
    module: str | None = None  # the unit being loaded
    phase: str = RankPhase.STARTING
    phase_times: dict[str, float] = field(default_factory=dict)  # phase -> when it began
    first_heard: float | None = None  # when the launcher first heard the rank
    # when the rank's process was up (or, warm, had the reload request): its first heartbeat's
    # own time, which the launcher may read a pump tick later, after the rank's next phases
    up: float | None = None
    error: str | None = None
    result: RankResult | None = None

    @property
    def loaded(self) -> bool:
        return self.result is not None or self.phase in (RankPhase.CHECKING, RankPhase.LOADED)

    def startup_marks(self) -> tuple[float | None, ...]:
        """When each of results.STARTUP_PHASES ended on this rank (None where unknown)."""
        times = self.phase_times
        up = self.up if self.up is not None else self.first_heard
        known = [t for t in (up, times.get(RankPhase.STARTING)) if t is not None]
        return (
            min(known, default=None),  # up before it says anything else
            times.get(RankPhase.STARTING),
            times.get(RankPhase.SKELETON),
            times.get(RankPhase.READY),
        )


class ProgressTracker:
    """Rank progress, updated event by event. With a plan, every rank and its totals are known
    from the start; without one, ranks appear as their events arrive."""

    def __init__(self, plan: ResolvedPlan | None = None):
        self.ranks: dict[int, RankProgress] = {}
        if plan is not None:
            units = plan.units()
            for r in range(plan.world_size):
                self.ranks[r] = RankProgress(
                    units_total=len(units),
                    bytes_total=sum(t.ranks[r].bytes for _, ts in units for t in ts),
                )

    def track(self, event: Event) -> None:
        if event.rank == LAUNCHER_RANK:
            return  # the job's own state changes: the job holds them
        progress = self.ranks.setdefault(event.rank, RankProgress())
        if isinstance(event, Phase):
            progress.phase = event.name
            progress.phase_times[event.name] = event.t
        elif isinstance(event, UnitStart):
            progress.module, progress.units_total = event.module, event.total
        elif isinstance(event, UnitDone):
            progress.units_done, progress.units_total = event.index + 1, event.total
            progress.bytes_done += event.bytes
        elif isinstance(event, Error):
            progress.error = event.message
        elif isinstance(event, Done):
            progress.result = RankResult.from_dict(event.result)

    def heard(self, rank: int, t: float) -> None:
        progress = self.ranks.get(rank)
        if progress is not None and progress.first_heard is None:
            progress.first_heard = t

    def beat(self, rank: int, beat: Beat) -> None:
        progress = self.ranks.get(rank)
        if progress is not None and progress.up is None:
            progress.up = beat.sent

    def results(self) -> list[RankResult] | None:
        """Every rank's result in rank order, once all are in."""
        ranks = [self.ranks[r] for r in sorted(self.ranks)]
        if not ranks or any(p.result is None for p in ranks):
            return None
        return [p.result for p in ranks]  # type: ignore[misc]

    def first_error(self) -> str:
        return next((f"rank {r}: {p.error}" for r, p in self.ranks.items() if p.error), "")
