"""sliced (the default): a meta skeleton; per unit, each rank reads only its own slices into
its own tensors. Peak: the final shard plus the largest staging buffer of one slice (none on
the CPU without a cast).

With `init="random"` each rank draws its own shards in place; shards cannot reproduce a
single-process draw. Units that hold only replicated tensors use a seed common to all ranks;
in units with a sharded tensor the seed includes the rank (the first of the ranks sharing a
chunk, for replicated key-value heads), and their replicated tensors come from rank 0 by
broadcast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .executor import Executor

if TYPE_CHECKING:
    from .executor import TensorPlan


def run(x: Executor) -> None:
    if x.init == "random":
        _initialise(x)
        return
    for index, total, module, tensors in x.units():
        with x.unit(index, total, module, tensors):
            for t in tensors:
                local = x.shard(t)
                x.read_own(t, local)
                x.install(t, local)


def _initialise(x: Executor) -> None:
    for index, total, module, tensors in x.units():
        with x.unit(index, total, module, tensors):
            installed = [x.install(t, x.shard(t)) for t in tensors]
            sharded = any(t.shard_dim is not None for t in tensors)
            x.init_module(
                module, unit_seed(x.seed, index, _drawer(x, tensors) if sharded else None)
            )
            if sharded and x.world_size > 1:
                for t, local in zip(tensors, installed):
                    if t.shard_dim is None:
                        x.broadcast(local)


def _drawer(x: Executor, tensors: list[TensorPlan]) -> int:
    """Whose draw a rank's shards are: its own, or, where ranks share a chunk (replicated
    key-value heads), the first sharing rank's, so that the copies of a head agree."""
    groups = next((t.groups for t in tensors if t.groups), None)
    share = 1 if groups is None else x.world_size // groups
    return x.rank // share * share


def unit_seed(seed: int, index: int, rank: int | None) -> int:
    """The seed of unit `index`: the same on every rank, or (`rank` given) its own."""
    salt = 0 if rank is None else rank + 1
    return (seed * 1_000_003 + index * 7919 + salt) % (2**63)
