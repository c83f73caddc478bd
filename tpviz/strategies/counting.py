"""The forecast: each strategy run over a counting executor, one per rank.

`Counting` performs a strategy's steps on byte counts instead of tensors: every allocation
and release goes to a ledger, every send and receive to traffic counters. The peak of the
ledger is the loader's `peak_tensor_bytes`, byte for byte, because the loader's own ledger
sees the same steps (tpviz.runtime.executor.LoadContext).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .executor import Unit, plan_units
from .reads import Read, StagingRing, own_reads, staged_chunks, whole_reads
from .registry import STRATEGIES

if TYPE_CHECKING:
    from .executor import ResolvedPlan, TensorPlan


@dataclass
class Forecast:
    """Expected peak of the loader's tensor accounting, and collective traffic, per rank."""

    peak_bytes: list[int]
    sent_bytes: list[int]
    received_bytes: list[int]

    def to_dict(self) -> dict[str, list[int]]:
        return {
            "peak_bytes": self.peak_bytes,
            "traffic_bytes": [s + r for s, r in zip(self.sent_bytes, self.received_bytes)],
            "sent_bytes": self.sent_bytes,
            "received_bytes": self.received_bytes,
        }


class Ledger:
    """Running total and peak of the tensor bytes a rank holds."""

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0

    def alloc(self, nbytes: int) -> None:
        self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current

    def free(self, nbytes: int) -> None:
        self.current -= nbytes

    def spike(self, nbytes: int) -> None:
        """A buffer allocated and freed again at once (a read's staging copy)."""
        self.peak = max(self.peak, self.current + nbytes)


def forecast(
    plan: ResolvedPlan, strategy: str, device: str = "cpu", init: str = "checkpoint"
) -> Forecast:
    """Run `strategy` for every rank over a counting executor: peak tensor bytes and traffic
    per rank, on `device`, reading the checkpoint or (`init="random"`) initialising."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r} (choose from {', '.join(STRATEGIES)})")
    units = plan_units(plan)
    ranks = [Counting(plan, rank, device, init, units) for rank in range(plan.world_size)]
    for executor in ranks:
        STRATEGIES[strategy](executor)
    return Forecast(
        [r.ledger.peak for r in ranks], [r.sent for r in ranks], [r.received for r in ranks]
    )


_NOTHING_AROUND_A_UNIT = contextlib.nullcontext()  # reusable: it holds no state


class Counting:
    """The executor of one rank that counts bytes; its tensor handles are byte counts."""

    def __init__(
        self, plan: ResolvedPlan, rank: int, device: str, init: str, units: list[Unit]
    ) -> None:
        self.plan, self.rank, self.init, self.seed = plan, rank, init, 0
        self.device_type = self.comm_device_type = device
        self.ledger = Ledger()
        self.sent = self.received = 0
        self._units = units
        self._ring: StagingRing[int] = StagingRing(self.ledger.free)
        for t in plan.params:
            if t.origin == "computed":  # made with the skeleton, before loading
                self.ledger.alloc(t.ranks[rank].bytes)

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    def units(self) -> Iterator[Unit]:
        return iter(self._units)

    def unit(
        self, index: int, total: int, module: str, tensors: list[TensorPlan]
    ) -> contextlib.AbstractContextManager:
        return _NOTHING_AROUND_A_UNIT

    def shard(self, t: TensorPlan) -> int:
        return self._alloc(t.ranks[self.rank].bytes)

    def part(self, t: TensorPlan, rank: int) -> int:
        return self._alloc(t.ranks[rank].bytes)

    def read_own(self, t: TensorPlan, local: int) -> None:
        self._staging(t, own_reads(t, self.rank, self.device_type), self.device_type)

    def full_tensors(self, module: str, tensors: list[TensorPlan]) -> list[int]:
        if self.init != "checkpoint":  # drawn in the plan's dtype
            return [self._alloc(t.nbytes) for t in tensors]
        fulls = []
        for t in tensors:
            fulls.append(self._alloc(t.source_nbytes()))
            self._staging(t, whole_reads(t), "cpu")
        return fulls

    def free_full(self, t: TensorPlan, full: int) -> None:
        self.ledger.free(full)

    def fill(self, dest: int, full: int, t: TensorPlan, rank: int) -> int:
        return dest

    def view(self, full: int, t: TensorPlan, rank: int) -> int:
        return t.ranks[rank].bytes  # sent, never allocated

    def send(self, tensor: int, dst: int) -> None:
        self.sent += tensor

    def recv(self, tensor: int, src: int) -> None:
        self.received += tensor

    def broadcast(self, tensor: int) -> None:
        if self.rank == 0:
            self.sent += tensor * (self.world_size - 1)
        else:
            self.received += tensor

    def release(self, tensor: int) -> None:
        self.ledger.free(tensor)

    def install(self, t: TensorPlan, local: int) -> int:
        return local

    def init_module(self, module: str, seed: int) -> None:
        pass  # draws numbers, allocates nothing

    def _alloc(self, nbytes: int) -> int:
        self.ledger.alloc(nbytes)
        return nbytes

    def _staging(self, t: TensorPlan, reads: list[Read], dest: str) -> None:
        """The staging buffers of `reads` into a tensor on `dest`."""
        for read in reads:
            if not read.staged:
                continue
            if dest == "cpu":  # one buffer per read, freed at once
                self.ledger.spike(t.source_nbytes(read.numel))
                continue
            for chunk in staged_chunks(read, t.source_nbytes(1)):  # the pinned ring's steps
                self._ring.slot()
                self.ledger.alloc(t.source_nbytes(chunk.numel))
                self._ring.hold(t.source_nbytes(chunk.numel))
