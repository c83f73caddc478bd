"""What a rank reads from the checkpoint and copies between tensors: plain data, shared by the
runtime (which performs the reads) and the forecast (which counts their staging buffers)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..chunks import Block
from ..keymap import Piece, is_one_run, pieces

if TYPE_CHECKING:
    from .executor import TensorPlan


@dataclass(frozen=True, slots=True)
class Read:
    """One read of a box of a checkpoint tensor into a box of a destination tensor."""

    source: int  # index into the tensor's checkpoint keys
    src_offset: tuple[int, ...]
    dst_offset: tuple[int, ...]
    shape: tuple[int, ...]
    staged: bool  # through a CPU buffer in the checkpoint's dtype, then copied into place

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def target(self) -> tuple[slice, ...]:
        """The box in the destination, as an index."""
        return tuple(slice(o, o + n) for o, n in zip(self.dst_offset, self.shape))


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
    return Read(p.source, p.src_offset, p.dst_offset, p.shape, staged or not p.contiguous)


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
