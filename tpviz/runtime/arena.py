"""One block of memory for all of a rank's CPU shards, handed out shard by shard.

Why one block: torch's allocator marks each large allocation for transparent huge pages (in
spawned ranks, `THP_MEM_ALLOC_ENABLE=1`), but a huge page backs only a 2 MiB-aligned stretch
that lies wholly inside one allocation, so every separately allocated shard begins and ends in
4 KiB pages, each faulted in on its own. With the medium preset's 75 shards of 4 MiB per rank
only about half of the bytes got huge pages and a load took about twice the floor (fresh
memory for exactly the rank's bytes, filled from the page cache); one block for all of them is
backed by huge pages nearly throughout, as the floor's own memory is.

The block is taken when the first shard is (loading has begun: nothing is allocated during
startup) and only reserves address space; each shard's pages are faulted in when it is handed
out, so the resident set still grows module by module as the plan's ledger does. The shards
are views of the block: it is freed when the last of them is.
"""

from __future__ import annotations

import math

import torch

from ..plan import ResolvedPlan
from .memory import prefault

ALIGN = 64  # bytes: where each shard begins, as torch aligns a CPU tensor of its own


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class ShardArena:
    """The CPU memory of one rank's shards under `plan`: room for each of the tensors it loads."""

    def __init__(self, plan: ResolvedPlan, rank: int) -> None:
        size = sum(aligned(t.ranks[rank].bytes) for _, tensors in plan.units() for t in tensors)
        self._memory = torch.empty(size, dtype=torch.uint8)
        self._taken = 0

    def take(self, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        """A new shard of `shape` and `dtype`, its pages faulted in."""
        nbytes = math.prod(shape) * dtype.itemsize
        start, end = self._taken, self._taken + nbytes
        if end > self._memory.numel():
            raise RuntimeError(
                f"the rank's shard memory ({self._memory.numel()} bytes) is used up: a shard "
                "was asked for that the plan does not hold (a bug in tpviz)"
            )
        self._taken += aligned(nbytes)
        shard = self._memory[start:end].view(dtype).view(shape)
        prefault(shard)
        return shard
