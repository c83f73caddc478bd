"""Fresh shard memory (runtime/memory.py): `prefault` makes a tensor's pages resident ahead of
its read, and the tensor stays exactly its size and writable."""

from __future__ import annotations

import pytest
import torch

from tpviz.runtime import memory
from tpviz.runtime.memory import PREFAULT_MIN_BYTES, prefault

SLACK = 512 << 10  # the interpreter's own allocations between two readings


def _anonymous() -> int:
    with open("/proc/self/smaps_rollup", encoding="ascii") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("Anonymous:"))


@pytest.mark.parametrize("shape", [(1283, 1031), (7,)])  # 5.3 MiB, and below the minimum
def test_prefault_makes_pages_resident_and_keeps_the_tensor_exact(shape):
    # larger than malloc's largest mmap threshold: fresh pages of its own, freed on release
    t = torch.empty((40 << 20) // 4 + 1, dtype=torch.float32)[: torch.Size(shape).numel()]
    t = t.view(shape)
    nbytes = t.numel() * 4
    before = _anonymous()
    prefault(t)
    grown = _anonymous() - before
    if nbytes >= PREFAULT_MIN_BYTES and memory._libc is not False:
        assert -SLACK <= grown - nbytes <= SLACK  # resident before anything was written
    else:
        assert grown <= SLACK  # too small to bother, or no MADV_POPULATE_WRITE here
    assert t.shape == shape and t.is_contiguous()
    torch.arange(t.numel(), dtype=torch.float32, out=t.view(-1))
    assert torch.equal(t.view(-1), torch.arange(t.numel(), dtype=torch.float32))
