"""The GPU path's staging logic, on the CPU: staged reads cut into chunks, and the ring of
pinned buffers that lets the read of one chunk overlap the copy of the one before.

A GPU copy launched with `non_blocking=True` may run at any time until its event is waited
for. The ring is run here with copies that happen as late as that allows (only when the
chunk is retired), into real checkpoint tensors read with the real BlockReader: a buffer
reused too early would hand the late copy someone else's bytes."""

from __future__ import annotations

import math

import pytest
import torch

from tpviz.checkpoint import BlockReader, Checkpoint
from tpviz.plan import resolve_plan
from tpviz.strategies import forecast
from tpviz.strategies.reads import Read, StagingRing, fill_part, own_reads, staged_chunks


@pytest.mark.parametrize(
    "shape, limit",
    [((37, 5), 4 * 5 * 4), ((37, 5), 4 * 5 * 4 + 3), ((3, 1000), 16), ((), 1), ((8,), 100)],
)
def test_chunks_cover_the_read_once_in_order_within_the_limit(shape, limit):
    offset = tuple(2 for _ in shape)
    read = Read(0, offset, tuple(1 for _ in shape), shape, True)
    chunks = staged_chunks(read, 4, limit)
    row = math.prod(shape[1:]) * 4
    assert sum(c.numel for c in chunks) == read.numel
    assert all(c.numel * 4 <= max(limit, row) for c in chunks)
    if shape:
        starts = [c.src_offset[0] for c in chunks]
        assert starts == sorted(starts) and starts[0] == offset[0]
        for c in chunks:  # destination moves with the source; other dims untouched
            assert c.dst_offset[0] - 1 == c.src_offset[0] - 2
            assert c.shape[1:] == shape[1:] and c.src_offset[1:] == offset[1:]
    else:
        assert chunks == [read]


def test_a_transposed_read_is_one_chunk_read_in_its_saved_order():
    # its saved rows cross the destination's: cut along the destination's first dim, a chunk
    # would not be one box of the saved tensor
    read = Read(0, (1, 2, 3), (0, 0, 0), (4, 5, 6), True, (0, 2, 1))
    assert staged_chunks(read, 4, 16) == [read]
    assert read.saved_box == ((1, 3, 2), (4, 6, 5))
    saved = torch.arange(4 * 6 * 5).reshape(4, 6, 5)
    assert torch.equal(read.placed(saved), saved.transpose(1, 2))


class LateCopies:
    """Two staging buffers and copies that run only when their chunk is retired: the latest
    a device copy may run before its event is waited for."""

    def __init__(self, buffers: int, slots: int) -> None:
        self.buffers = [torch.empty(0)] * buffers
        self.ring = StagingRing(self.retire, slots)
        self.held = self.most_held = 0
        self.retired: list[int] = []

    def retire(self, pending) -> None:
        index, dest, slot, shape = pending
        dest.copy_(self.buffers[slot][: math.prod(shape)].view(shape))  # the copy lands now
        self.retired.append(index)
        self.held -= 1

    def stage(self, reader: BlockReader, info, dest: torch.Tensor, read: Read, limit: int):
        for chunk in staged_chunks(read, info.torch_dtype.itemsize, limit):
            slot = self.ring.slot() % len(self.buffers)
            if self.buffers[slot].numel() < chunk.numel:
                self.buffers[slot] = torch.empty(chunk.numel, dtype=info.torch_dtype)
            staged = self.buffers[slot][: chunk.numel].view(chunk.shape)
            reader.read_block(info, chunk.src_offset, chunk.shape, staged)
            self.ring.hold((len(self.retired) + self.held, dest[chunk.target], slot, chunk.shape))
            self.held += 1
            self.most_held = max(self.most_held, self.held)


def _stage_every_shard(tiny, buffers: int, slots: int, limit: int):
    plan = resolve_plan(tiny, 2)
    ckpt = Checkpoint.open(tiny)
    copies = LateCopies(buffers, slots)
    shards, expected = {}, {}
    with BlockReader() as reader:
        for t in plan.params:
            if t.origin != "checkpoint":
                continue
            (info,) = [ckpt.tensors[k] for k in t.checkpoint_keys]
            full = reader.read_full(info)
            for rank in range(2):
                dest = torch.full(t.ranks[rank].shape, float("nan"), dtype=info.torch_dtype)
                for read in own_reads(t, rank, "cuda"):
                    assert read.staged
                    copies.stage(reader, info, dest, read, limit)
                shards[t.name, rank] = dest
                expected[t.name, rank] = fill_part(torch.empty_like(dest), full, t, rank)
    copies.ring.drain()
    return copies, shards, expected


def test_late_copies_through_two_buffers_give_exact_shards(tiny):
    copies, shards, expected = _stage_every_shard(tiny, buffers=2, slots=2, limit=4096)
    assert copies.most_held == 2  # the overlap happened: a read while a copy was pending
    assert copies.retired == list(range(len(copies.retired)))  # oldest first, every one
    assert len(copies.retired) > len(shards)  # reads were cut into chunks
    for key, dest in shards.items():
        assert torch.equal(dest, expected[key]), key


def test_a_ring_that_reuses_a_buffer_too_early_is_caught(tiny):
    """The same run with three chunks in flight over two buffers: late copies then read a
    buffer already refilled, and the shards come out wrong."""
    _, shards, expected = _stage_every_shard(tiny, buffers=2, slots=3, limit=4096)
    assert any(not torch.equal(dest, expected[key]) for key, dest in shards.items())


def test_the_forecast_on_cuda_holds_two_chunks_in_flight(tiny):
    """The forecast of sliced on CUDA: each rank's shard plus, at its peak, the two largest
    consecutive chunks in flight, which the pinned ring holds at most."""
    plan = resolve_plan(tiny, 2)
    on_cpu, on_cuda = forecast(plan, "sliced", "cpu"), forecast(plan, "sliced", "cuda")
    for rank in range(2):
        sizes = [
            plan.tensor(t.name).source_nbytes(c.numel)
            for t in plan.params
            if t.origin == "checkpoint"
            for read in own_reads(t, rank, "cuda")
            for c in staged_chunks(read, plan.tensor(t.name).source_nbytes(1))
        ]
        pairs = max(a + b for a, b in zip(sizes, sizes[1:]))
        assert plan.per_rank_bytes[rank] < on_cuda.peak_bytes[rank]
        assert on_cuda.peak_bytes[rank] <= plan.per_rank_bytes[rank] + pairs
        assert on_cpu.peak_bytes[rank] <= plan.per_rank_bytes[rank]
