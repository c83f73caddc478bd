"""The operations a loading strategy is written in.

A strategy is one function of an `Executor`, run by every rank. Two executors run it: the
runtime's (`tpviz.runtime.executor.LoadContext`: real reads, torch.distributed, the tensor
ledger) and the forecast's (`tpviz.strategies.counting.Counting`: a ledger and byte counts
per rank, no tensors). The forecast is the strategy run over the counting executor for every
rank, so what is forecast is what the loader does, step for step.

A tensor handle is a `torch.Tensor` in the runtime and its byte count when forecasting;
strategies only pass handles from one operation to the next.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    # the one import of plan types in strategies/ (the others take them from here), for
    # annotations only: tpviz.plan imports the strategies to forecast while resolving
    from ..plan.types import ResolvedPlan, TensorPlan

Handle = Any  # a torch.Tensor in the runtime, its byte count when forecasting
Unit = tuple[int, int, str, list["TensorPlan"]]  # index, number of units, module, its tensors


class Executor(Protocol):
    """One rank's view of a load: the plan, and the operations a strategy may call."""

    plan: ResolvedPlan
    rank: int
    init: str  # "checkpoint" (read the weights) or "random" (initialise them)
    seed: int  # of a random initialisation
    device_type: str  # where the shards live: "cpu" or "cuda"
    comm_device_type: str  # where collectives need their tensors ("cpu" for gloo)

    @property
    def world_size(self) -> int: ...

    def units(self) -> Iterator[Unit]:
        """The units of loading in order."""
        ...

    def unit(
        self, index: int, total: int, module: str, tensors: list[TensorPlan]
    ) -> contextlib.AbstractContextManager:
        """Around one unit's steps: progress events, and errors that name the module."""
        ...

    def shard(self, t: TensorPlan) -> Handle:
        """A new, empty tensor of this rank's shard of `t`, where shards live."""
        ...

    def part(self, t: TensorPlan, rank: int) -> Handle:
        """A new, empty tensor of `rank`'s part of `t`, where collectives need it."""
        ...

    def read_own(self, t: TensorPlan, local: Handle) -> None:
        """Fill this rank's shard of `t` from the checkpoint (`reads.own_reads`)."""
        ...

    def full_tensors(self, module: str, tensors: list[TensorPlan]) -> list[Handle]:
        """Whole CPU tensors of one unit: read from the checkpoint (`reads.whole_reads`), or
        made by the random initialisation of the single-process model (`module`'s own init)."""
        ...

    def free_full(self, t: TensorPlan, full: Handle) -> None:
        """Done with a whole tensor from `full_tensors`."""
        ...

    def fill(self, dest: Handle, full: Handle, t: TensorPlan, rank: int) -> Handle:
        """Copy `rank`'s blocks of the whole tensor into `dest`; returns `dest`."""
        ...

    def view(self, full: Handle, t: TensorPlan, rank: int) -> Handle:
        """`rank`'s part of the whole tensor without a copy (see `reads.sends_a_view`)."""
        ...

    def send(self, tensor: Handle, dst: int) -> None: ...

    def recv(self, tensor: Handle, src: int) -> None: ...

    def broadcast(self, tensor: Handle) -> None:
        """From rank 0 to every rank."""
        ...

    def release(self, tensor: Handle) -> None:
        """Done with a tensor from `part`."""
        ...

    def install(self, t: TensorPlan, local: Handle) -> Handle:
        """Put the shard into the model; returns the installed local tensor."""
        ...

    def init_module(self, module: str, seed: int) -> None:
        """Random-initialise the tensors `module` holds, in place, from `seed`."""
        ...


Strategy = Callable[[Executor], None]


def plan_units(plan: ResolvedPlan) -> list[Unit]:
    """The plan's units of loading with their index and count."""
    units = plan.units()
    return [(index, len(units), module, tensors) for index, (module, tensors) in enumerate(units)]
