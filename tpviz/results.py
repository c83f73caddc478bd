"""The load result, typed: one `RankResult` per rank inside a `LoadResult`.

`to_dict()` is the load JSON (DESIGN.md, "Load JSON"): fields in declaration order, those
that are None left out, so that optional parts (`verify`, `profile`, CUDA figures, ...) appear
only when there is something to say. Both are also read-only mappings over that JSON, so that
`result["ranks"][0]["param_bytes"]` reads as it always has; code in tpviz uses the attributes.
`from_dict()` reads the JSON back (a `done` event carries its rank's entry as a dict).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, Self

from .outputs import collect_output_errors
from .plan import ResolvedPlan

# A startup phase ends when the last rank has passed it. The launcher notes when it first
# hears a rank's heartbeat (the process is up); the ranks' `phase` events mark the rest.
STARTUP_PHASES = ("process_start", "imports", "process_group", "skeleton")
# How far above its reference load's baseline a warm rank's resident set may stay after
# releasing the previous model before the result says so (allocator and import residue is a
# few MiB).
RSS_MARGIN_BYTES = 16 * 2**20


class _JsonMapping(Mapping[str, Any]):
    """Read-only mapping access to `to_dict()`."""

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = _plain(value)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> Self:
        """`data` typed: an instance as it is, its JSON read."""
        return data if isinstance(data, cls) else cls.from_dict(data)

    def __getitem__(self, key: str) -> Any:
        # one field converted, not the whole JSON built per access
        names = {f.name for f in fields(self)}  # type: ignore[arg-type]
        value = getattr(self, key) if key in names else None
        if value is None:  # to_dict() leaves None fields out
            raise KeyError(key)
        return _plain(value)

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())


def _plain(value: Any) -> Any:
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value.to_dict() if isinstance(value, _JsonMapping) else value


@dataclass(kw_only=True, eq=False)
class RankResult(_JsonMapping):
    """One rank's entry of the load JSON: what it loaded, how fast, at what memory cost."""

    rank: int
    seconds: float  # this rank's own loading
    # barrier (all ready) to barrier (all loaded), as this rank saw it; not in the load JSON
    # contract, so results written elsewhere may lack it
    load_seconds: float | None = None
    param_bytes: int
    planned_bytes: int
    peak_rss_bytes: int
    rss_baseline_bytes: int | None = None
    peak_tensor_bytes: int
    forecast_peak_bytes: int
    bytes_sent: int | None = None
    bytes_received: int | None = None
    forecast_bytes_sent: int | None = None
    forecast_bytes_received: int | None = None
    plan_matches_shards: bool | None = None
    mismatches: list[str] | None = None
    peak_cuda_allocated_bytes: int | None = None  # on CUDA only
    profile: dict[str, Any] | None = None  # with a profile dir: the trace summary
    init: dict[str, Any] | None = None  # with init="random": the consistency check
    output_errors: list[dict[str, str]] | None = None  # outputs the rank could not write
    ratio_to_sliced: dict[str, float | None] | None = None  # in a comparison


@dataclass(kw_only=True, eq=False)
class LoadResult(_JsonMapping):
    """The result of one load (`tpviz load --json`)."""

    strategy: str
    world_size: int | None = None
    dtype: str | None = None
    device: str | None = None
    init: str | None = None
    source: str | None = None
    startup_seconds: float | None = None  # spawn to all ranks ready
    startup_phases: dict[str, float] | None = None  # STARTUP_PHASES -> seconds
    load_seconds: float
    plan_matches_shards: bool | None = None
    ranks: list[RankResult]
    warnings: list[dict[str, str]] | None = None
    init_check: dict[str, Any] | None = None
    profile: dict[str, Any] | None = None
    output_errors: list[dict[str, str]] | None = None
    verify: dict[str, Any] | None = None
    ratio_to_sliced: dict[str, float | None] | None = None

    def __post_init__(self) -> None:
        self.ranks = [RankResult.of(r) for r in self.ranks]

    @classmethod
    def collect(
        cls,
        plan: ResolvedPlan,
        ranks: list[RankResult],
        *,
        strategy: str,
        device: str,
        init: str,
        profile_dir: str | None,
        started: float,
        startup_marks: Sequence[Sequence[float | None]],
    ) -> LoadResult:
        """The job's result from its ranks' entries. `startup_marks` holds, per rank, when each
        of STARTUP_PHASES ended (None where unknown)."""
        ready = [m[-1] for m in startup_marks if m[-1] is not None]
        result = cls(
            strategy=strategy,
            world_size=plan.world_size,
            dtype=plan.dtype,
            device=device,
            init=init,
            source=plan.source,
            startup_seconds=max(ready, default=started) - started,
            startup_phases=startup_phases(started, startup_marks),
            load_seconds=slowest_load(ranks),
            plan_matches_shards=all(r.plan_matches_shards for r in ranks),
            ranks=ranks,
            warnings=[asdict(w) for w in plan.warnings],
        )
        if init == "random":
            result.init_check = ranks[0].init
        if profile_dir:
            result.profile = {"dir": profile_dir, "ranks": [r.profile for r in ranks]}
        result.output_errors = collect_output_errors([r.to_dict() for r in ranks]) or None
        return result

    def warn_if_not_released(self, reference: Sequence[int]) -> None:
        """On warm ranks: warn where a rank's resident set before loading stayed more than
        RSS_MARGIN_BYTES above `reference` (that rank's baseline in its reference load), since
        its growth would then read lower than a fresh rank's."""
        for rank, before in enumerate(reference):
            above = self.ranks[rank].rss_baseline_bytes - before
            if above > RSS_MARGIN_BYTES:
                self.warnings.append(
                    {
                        "code": "rss_not_released",
                        "name": f"rank {rank}",
                        "message": f"rank {rank} started this load {above / 2**20:.0f} MiB "
                        "above its reference load's resident set (margin "
                        f"{RSS_MARGIN_BYTES / 2**20:.0f} MiB): its RSS growth may read low",
                    }
                )


def slowest_load(ranks: Sequence[RankResult]) -> float:
    """The job's load time: the largest of its ranks' barrier-to-barrier times."""
    return max((r.load_seconds for r in ranks if r.load_seconds is not None), default=0.0)


def startup_phases(
    started: float, startup_marks: Sequence[Sequence[float | None]]
) -> dict[str, float]:
    """Seconds per startup phase, from the job's start to the last rank ready. A phase ends
    when the last rank has passed it, so the phases add up to `startup_seconds`."""
    end = max((m[-1] for m in startup_marks if m[-1] is not None), default=started)
    phases, previous = {}, started
    for i, name in enumerate(STARTUP_PHASES):
        reached = [m[i] for m in startup_marks if m[i] is not None]
        boundary = min(end, max([previous, *reached]))
        phases[name] = boundary - previous
        previous = boundary
    return phases


def add_ratios(results: list[LoadResult]) -> list[LoadResult]:
    """Add `ratio_to_sliced` to each result (and each rank) of a comparison."""
    base = next((r for r in results if r.strategy == "sliced"), None)
    if base is None:
        return results
    base_rss = max(r.peak_rss_bytes for r in base.ranks)
    for res in results:
        res.ratio_to_sliced = {
            "load_seconds": _ratio(res.load_seconds, base.load_seconds),
            "peak_rss_bytes": _ratio(max(r.peak_rss_bytes for r in res.ranks), base_rss),
        }
        for rank, b in zip(res.ranks, base.ranks):
            rank.ratio_to_sliced = {
                "seconds": _ratio(rank.seconds, b.seconds),
                "peak_rss_bytes": _ratio(rank.peak_rss_bytes, b.peak_rss_bytes),
                "peak_tensor_bytes": _ratio(rank.peak_tensor_bytes, b.peak_tensor_bytes),
            }
    return results


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None
