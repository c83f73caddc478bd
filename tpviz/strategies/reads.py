"""What a rank reads from the checkpoint and copies between tensors: plain data, shared by the
runtime (which performs the reads) and the forecast (which counts their staging buffers)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Generic, TypeVar

import torch

from ..chunks import Block
from ..keymap import Piece, in_saved_order, is_one_run, pieces

if TYPE_CHECKING:
    from .executor import TensorPlan

# Staged reads to a GPU go through this many pinned host buffers in turn, in chunks of at
# most this many bytes (or one row of the box, when a row is larger): the read of one chunk
# overlaps the host-to-device copy of the one before.
STAGING_SLOTS = 2
STAGING_CHUNK_BYTES = 16 << 20

H = TypeVar("H")


@dataclass(frozen=True, slots=True)
class Read:
    """One read of a box of a checkpoint tensor into a box of a destination tensor."""

    source: int  # index into the tensor's checkpoint keys
    src_offset: tuple[int, ...]
    dst_offset: tuple[int, ...]
    shape: tuple[int, ...]
    staged: bool  # through a CPU buffer in the checkpoint's dtype, then copied into place
    order: tuple[int, ...] | None = None  # a transposed source's dim order (keymap.Source)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def target(self) -> tuple[slice, ...]:
        """The box in the destination, as an index."""
        return tuple(slice(o, o + n) for o, n in zip(self.dst_offset, self.shape))

    @property
    def saved_box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offset, shape) of the box in the source as saved: what is read."""
        return (
            tuple(in_saved_order(self.src_offset, self.order)),
            tuple(in_saved_order(self.shape, self.order)),
        )

    def placed(self, buffer: torch.Tensor) -> torch.Tensor:
        """A buffer read with `saved_box`'s shape, seen in the destination's dim order."""
        if self.order is None:
            return buffer
        return buffer.permute([self.order.index(d) for d in range(len(self.order))])


def needs_staging(t: TensorPlan, device: str) -> bool:
    """Whether a rank's reads of `t` go through a CPU buffer: they cast or land off the CPU."""
    return device != "cpu" or (t.source_dtype or t.dtype) != t.dtype


def sends_a_view(t: TensorPlan, rank: int, device: str) -> bool:
    """Whether rank 0 of rank0_broadcast can send `rank`'s part of `t` straight from the full
    tensor (a contiguous row block already in the target dtype) instead of a copy."""
    return (
        t.shard_dim == 0
        and len(t.ranks[rank].blocks) == 1
        and device == "cpu"
        and (t.source_dtype or t.dtype) == t.dtype
    )


def own_reads(t: TensorPlan, rank: int, device: str) -> list[Read]:
    """The reads that fill `rank`'s shard of `t` on `device`, in order. An assembled tensor's
    piece, or a block of a tensor packed along a later dim (stacked experts), is read straight
    into place only when its place is one contiguous run."""
    staged = needs_staging(t, device)
    if t.sources:
        return [_piece_read(p, staged) for p in read_pieces(t, rank)]
    local = t.ranks[rank].shape
    return [
        Read(0, tuple(b.offset), dst, tuple(b.shape), staged or not is_one_run(local, dst, b.shape))
        for b, dst in _placed_blocks(t, rank)
    ]


def whole_reads(t: TensorPlan, cast: bool = False) -> list[Read]:
    """The reads that make the whole of `t` on the CPU in the checkpoint's dtype, or (`cast`)
    in the plan's dtype, every read then going through a buffer."""
    if t.sources:
        return [_piece_read(p, cast) for p in read_pieces(t, None)]
    origin = (0,) * len(t.global_shape)
    return [Read(0, origin, origin, tuple(t.global_shape), cast)]


def read_pieces(t: TensorPlan, rank: int | None) -> list[Piece]:
    """The pieces of an assembled tensor's sources that `rank` reads into its shard, or
    (`rank` None) that make the whole tensor."""
    if rank is None:
        whole = [Block([0] * len(t.global_shape), t.global_shape)]
        return pieces(t.sources, whole, None, t.global_shape)
    shard = t.ranks[rank]
    return pieces(t.sources, shard.blocks, t.shard_dim, shard.shape)


def _piece_read(p: Piece, staged: bool) -> Read:
    return Read(p.source, p.src_offset, p.dst_offset, p.shape, staged or not p.contiguous, p.order)


def _placed_blocks(t: TensorPlan, rank: int) -> Iterator[tuple[Block, tuple[int, ...]]]:
    """Each of `rank`'s blocks with its offset in the shard: the blocks sit one after another
    along the shard dim."""
    dim, pos = t.shard_dim, 0
    for block in t.ranks[rank].blocks:
        dst = [0] * len(block.shape)
        if dim is not None:
            dst[dim] = pos
            pos += block.shape[dim]
        yield block, tuple(dst)


def block_view(full: torch.Tensor, block: Block) -> torch.Tensor:
    return full[tuple(slice(o, o + s) for o, s in zip(block.offset, block.shape))]


def fill_part(part: torch.Tensor, full: torch.Tensor, t: TensorPlan, rank: int) -> torch.Tensor:
    """Copy rank `rank`'s blocks of `full` into `part` (its local shape; casts as it copies)."""
    for block, dst in _placed_blocks(t, rank):
        region = part[tuple(slice(o, o + n) for o, n in zip(dst, block.shape))]
        region.copy_(block_view(full, block))
    return part


def staged_chunks(read: Read, itemsize: int, limit: int = STAGING_CHUNK_BYTES) -> list[Read]:
    """`read` cut along its first dim into reads of at most `limit` bytes each (at least one
    row each), in order: the pieces a staged read passes through a pinned buffer in. A
    transposed read is one piece: its saved rows cross the destination's."""
    row = math.prod(read.shape[1:]) * itemsize
    if not read.shape or read.shape[0] * row <= limit or read.order is not None:
        return [read]
    step = max(1, limit // max(row, 1))
    return [
        replace(
            read,
            src_offset=(read.src_offset[0] + r, *read.src_offset[1:]),
            dst_offset=(read.dst_offset[0] + r, *read.dst_offset[1:]),
            shape=(min(step, read.shape[0] - r), *read.shape[1:]),
        )
        for r in range(0, read.shape[0], step)
    ]


class StagingRing(Generic[H]):
    """The staged chunks in flight to the device, oldest first. Chunk i goes through buffer
    i % `slots`; before it takes its buffer, the chunk that used that buffer last is retired
    (`retire` waits for its copy to end, and frees its bytes), so a buffer is never
    overwritten while a copy out of it may still run, and at most `slots` are held. The
    runtime holds (copy event, bytes); the forecast holds bytes alone."""

    def __init__(self, retire: Callable[[H], None], slots: int = STAGING_SLOTS) -> None:
        self._retire = retire
        self._slots = slots
        self._held: deque[H] = deque()
        self._taken = 0

    def slot(self) -> int:
        """The buffer the next chunk goes through, free for it once this returns."""
        if len(self._held) == self._slots:
            self._retire(self._held.popleft())
        return self._taken % self._slots

    def hold(self, handle: H) -> None:
        """The chunk given its slot by `slot()` is on its way (its copy launched)."""
        self._held.append(handle)
        self._taken += 1

    def drain(self) -> None:
        """Retire every chunk still held, oldest first."""
        while self._held:
            self._retire(self._held.popleft())
