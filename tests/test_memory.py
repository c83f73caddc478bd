"""Fresh shard memory (runtime/memory.py): `prefault` makes a tensor's pages resident ahead of
its read, and the tensor stays exactly its size and writable; in spawned ranks torch's
allocator backs shards of 2 MiB and more with huge pages (processes.RANK_ENVIRON)."""

from __future__ import annotations

import mmap
import os

import pytest
import torch

import tpviz
from tpviz import processes
from tpviz.models.demo import make_checkpoint
from tpviz.runtime import memory
from tpviz.runtime.memory import PREFAULT_MIN_BYTES, prefault

HUGE_PAGE = 2 << 20

SLACK = 512 << 10  # the interpreter's own allocations between two readings


def _anonymous() -> int:
    with open("/proc/self/smaps_rollup", encoding="ascii") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("Anonymous:"))


def _fresh_floats(count: int) -> torch.Tensor:
    """`count` float32 in a private anonymous mapping of their own: no page resident before it
    is touched (malloc may serve even a large tensor from heap memory touched before)."""
    region = mmap.mmap(-1, count * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(region, dtype=torch.float32)


@pytest.mark.parametrize("shape", [(1283, 1031), (7,)])  # 5.3 MiB, and below the minimum
def test_prefault_makes_pages_resident_and_keeps_the_tensor_exact(shape):
    numel = torch.Size(shape).numel()
    t = _fresh_floats(numel + 2)[1 : 1 + numel].view(shape)  # neither end on a page boundary
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


def _madvised_huge(address: int) -> bool:
    """Is the mapping that holds `address` marked MADV_HUGEPAGE ("hg" in its VmFlags)?"""
    inside = False
    with open("/proc/self/smaps", encoding="ascii") as f:
        for line in f:
            if "-" in line.split()[0] and not line.startswith("VmFlags"):
                low, high = (int(x, 16) for x in line.split()[0].split("-"))
                inside = low <= address < high
            elif inside and line.startswith("VmFlags:"):
                return "hg" in line.split()[1:]
    return False


def huge_page_shards(model) -> tuple[str | None, int, bool]:
    """Runs on every rank: the rank's THP switch, how many of its local tensors hold 2 MiB or
    more, and whether each of those lies in memory marked for huge pages (as torch's allocator
    marks it only with the switch on)."""
    from tpviz.runtime.parallelize import local_of

    local = [local_of(t) for t in model.state_dict(keep_vars=True).values()]
    large = [t for t in local if t.numel() * t.element_size() >= HUGE_PAGE]
    return (
        os.environ.get("THP_MEM_ALLOC_ENABLE"),
        len(large),
        all(_madvised_huge(t.data_ptr()) for t in large),
    )


@pytest.mark.slow
def test_spawned_ranks_back_large_shards_with_huge_pages(checkpoints):
    # a 16384-word vocabulary: 4 MiB of embedding and of lm_head on each of 2 ranks
    wide = make_checkpoint(checkpoints / "wide-vocab", "tiny", vocab=16384)
    with tpviz.launch(wide, 2, timeout=120) as job:
        job.wait(120)
        assert job.call(huge_page_shards) == [("1", 2, True)] * 2
    assert not _madvised_huge(torch.empty(HUGE_PAGE, dtype=torch.uint8).data_ptr())  # here: off


def test_a_thp_switch_the_caller_set_wins(monkeypatch):
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    assert processes._missing_defaults() == {}
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE")
    assert processes._missing_defaults() == {"THP_MEM_ALLOC_ENABLE": "1"}
