"""rank0_broadcast: rank 0 makes one unit's whole tensors (reads them, or draws them with
`init="random"`) and sends each rank its part with point-to-point sends (a scatter of slices:
a receiver never holds more than its part, and uneven parts need no padding); replicated
tensors are broadcast. The other ranks stay on meta until their part arrives.

A part that is a contiguous row block in the target dtype is sent straight from the whole
tensor; others go through one part-sized copy. Peak: rank 0 its shard plus its largest unit;
the others their shard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .executor import Executor, Handle
from .reads import sends_a_view

if TYPE_CHECKING:
    from .executor import TensorPlan


def run(x: Executor) -> None:
    for index, total, module, tensors in x.units():
        with x.unit(index, total, module, tensors):
            if x.rank == 0:
                _send_unit(x, module, tensors)
            else:
                _receive_unit(x, tensors)


def _receive_unit(x: Executor, tensors: list[TensorPlan]) -> None:
    for t in tensors:
        local = x.shard(t)
        if t.shard_dim is None:
            x.broadcast(local)
        elif t.ranks[x.rank].bytes:
            x.recv(local, 0)
        x.install(t, local)


def _send_unit(x: Executor, module: str, tensors: list[TensorPlan]) -> None:
    fulls = x.full_tensors(module, tensors)
    for t, full in zip(tensors, fulls):
        local = x.fill(x.shard(t), full, t, 0)
        if t.shard_dim is None:
            x.broadcast(local)
        else:
            for rank in range(1, x.world_size):
                if t.ranks[rank].bytes:
                    _send_part(x, full, t, rank)
        x.install(t, local)
    for t, full in zip(tensors, fulls):
        x.free_full(t, full)


def _send_part(x: Executor, full: Handle, t: TensorPlan, rank: int) -> None:
    """Send `rank` its part; a copy made for it is gone when this returns."""
    if sends_a_view(t, rank, x.comm_device_type):
        x.send(x.view(full, t, rank), rank)
        return
    part = x.fill(x.part(t, rank), full, t, rank)
    x.send(part, rank)
    x.release(part)
