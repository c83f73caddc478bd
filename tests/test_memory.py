"""Fresh shard memory (runtime/memory.py, runtime/arena.py): `prefault` makes a tensor's pages
resident ahead of its read, and the tensor stays exactly its size and writable; a rank's CPU
shards are views of one block, which in spawned ranks torch's allocator marks for huge pages
(rankserver.RANK_ENVIRON); the resident set is read from /proc/self/statm."""

from __future__ import annotations

import mmap
import os

import pytest
import torch

import tpviz
from tpviz import rankserver
from tpviz.checkpoint import torch_dtype
from tpviz.models.demo import make_checkpoint
from tpviz.runtime import memory
from tpviz.runtime.arena import ALIGN, ShardArena
from tpviz.runtime.memory import PREFAULT_MIN_BYTES, prefault, resident

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
    if nbytes >= PREFAULT_MIN_BYTES and memory._populate:
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


def shard_memory(model) -> tuple[str | None, bool, bool, bool]:
    """Runs on every rank: the rank's THP switch; whether all its tensors loaded from the
    checkpoint are views of one block, without overlapping; and whether that block lies in
    memory marked for huge pages (as torch's allocator marks it only with the switch on)."""
    from tpviz.models.adapter import local_of

    # the state dict holds what the checkpoint fills (computed buffers are not in it)
    local = {local_of(t).data_ptr(): local_of(t) for t in model.state_dict(keep_vars=True).values()}
    shards = [local[address] for address in sorted(local)]
    block = shards[0].untyped_storage()
    ends = [t.data_ptr() + t.numel() * t.element_size() for t in shards]
    return (
        os.environ.get("THP_MEM_ALLOC_ENABLE"),
        all(t.untyped_storage().data_ptr() == block.data_ptr() for t in shards),
        all(end <= t.data_ptr() for end, t in zip(ends, shards[1:])),
        _madvised_huge(block.data_ptr()),
    )


@pytest.mark.slow
def test_a_rank_holds_its_shards_in_one_block_marked_for_huge_pages(checkpoints):
    # a 16384-word vocabulary: 4 MiB of embedding and of lm_head on each of 2 ranks
    wide = make_checkpoint(checkpoints / "wide-vocab", "tiny", vocab=16384)
    with tpviz.launch(wide, 2, timeout=120) as job:
        job.wait(120)
        assert job.call(shard_memory) == [("1", True, True, True)] * 2
    assert not _madvised_huge(torch.empty(HUGE_PAGE, dtype=torch.uint8).data_ptr())  # here: off


def test_shard_arena_hands_out_exact_separate_views_of_one_block(tiny):
    plan = tpviz.resolve_plan(tiny, 2)
    tensors = [t for _, unit in plan.units() for t in unit]
    arena = ShardArena(plan, 1)
    shards = [arena.take(t.ranks[1].shape, torch_dtype(t.dtype)) for t in tensors]
    for t, shard in zip(tensors, shards):
        assert list(shard.shape) == t.ranks[1].shape and shard.is_contiguous()
        assert shard.numel() * shard.element_size() == t.ranks[1].bytes
        assert shard.data_ptr() % ALIGN == 0
        assert shard.untyped_storage().data_ptr() == shards[0].untyped_storage().data_ptr()
    for i, shard in enumerate(shards):  # each is its own memory: filling one changes no other
        shard.view(-1).fill_(i)
    assert all(bool((shard == i).all()) for i, shard in enumerate(shards))
    with pytest.raises(RuntimeError, match="used up"):
        arena.take([1], torch.float32)


def test_resident_reads_the_resident_set_and_its_anonymous_part():
    region = _fresh_floats(8 << 20)  # 32 MiB, not resident until touched
    rss, anon = resident()
    region.fill_(1.0)
    grown_rss, grown_anon = (after - before for after, before in zip(resident(), (rss, anon)))
    assert abs(grown_rss - (32 << 20)) <= 4 * SLACK and abs(grown_anon - (32 << 20)) <= 4 * SLACK
    with open("/proc/self/status", encoding="ascii") as f:
        status = {line.split(":")[0]: int(line.split()[1]) << 10 for line in f if "kB" in line}
    rss, anon = resident()
    assert abs(rss - status["VmRSS"]) <= SLACK and abs(anon - status["RssAnon"]) <= SLACK


def test_a_thp_switch_the_caller_set_wins(monkeypatch):
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    assert rankserver.missing_defaults() == {}
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE")
    assert rankserver.missing_defaults() == {"THP_MEM_ALLOC_ENABLE": "1"}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["replicated", "rank0_broadcast"])
def test_a_load_on_warm_ranks_peaks_as_high_as_on_fresh_ones(small, strategy):
    """Whole tensors freed during a load: glibc's heap would keep them for the next load on
    the same ranks (its mmap threshold raised by the first), which then peaked 20-40% higher
    for the same tensors."""
    from tpviz.results import RSS_MARGIN_BYTES

    with tpviz.launch(small, 2, strategy=strategy) as job:
        fresh = job.wait(120)
        for _ in range(2):
            job = job.reload()
            warm = job.wait(120)
            for now, first in zip(warm.ranks, fresh.ranks):
                assert abs(now.peak_rss_bytes - first.peak_rss_bytes) <= RSS_MARGIN_BYTES
