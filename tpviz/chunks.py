"""Chunk math: how a dim is cut into per-rank blocks (torch.chunk semantics, as DTensor's Shard).

Pure Python; the styles' cuts, the plan, the head checks and the widgets share it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Block:
    offset: list[int]
    shape: list[int]


@dataclass(slots=True)
class RankShard:
    """What one rank holds of a tensor: its blocks of the global tensor, in the order they are
    laid out in its local tensor, of local `shape` and `bytes`."""

    rank: int
    shape: list[int]
    bytes: int
    blocks: list[Block]


def chunk_sizes(n: int, parts: int) -> list[int]:
    """Sizes `torch.chunk` gives for `n` items in `parts` (ceil division; trailing parts may be
    smaller or empty), padded with zeros to exactly `parts` entries, as DTensor's Shard does."""
    step = -(-n // parts) if n else 0
    sizes = []
    for _ in range(parts):
        size = min(step, n)
        sizes.append(size)
        n -= size
    return sizes


def chunk_offsets(n: int, parts: int) -> list[tuple[int, int]]:
    """(offset, size) of every part under `chunk_sizes`."""
    out, start = [], 0
    for size in chunk_sizes(n, parts):
        out.append((start, size))
        start += size
    return out


def shard_blocks(
    shape: list[int],
    dim: int | None,
    world_size: int,
    packed_parts: int = 1,
    groups: int | None = None,
) -> list[list[Block]]:
    """Blocks each rank holds, in the order they are laid out in its local tensor. With
    `groups` (a divisor of `world_size`), the dim is cut into that many chunks and chunk g is
    held by the world_size/groups consecutive ranks g*world_size/groups, ... (key-value heads
    replicated over the ranks whose query heads use them)."""
    if dim is None:
        return [[Block([0] * len(shape), list(shape))] for _ in range(world_size)]
    chunks = groups or world_size
    share = world_size // chunks  # ranks holding each chunk
    part_len = shape[dim] // packed_parts
    offsets = chunk_offsets(part_len, chunks)
    per_rank: list[list[Block]] = [[] for _ in range(world_size)]
    for part in range(packed_parts):
        for rank in range(world_size):
            start, size = offsets[rank // share]
            if size:
                offset = [0] * len(shape)
                offset[dim] = part * part_len + start
                block_shape = list(shape)
                block_shape[dim] = size
                per_rank[rank].append(Block(offset, block_shape))
    return per_rank


def local_shape(shape: list[int], dim: int | None, blocks: list[Block]) -> list[int]:
    if dim is None:
        return list(shape)
    out = list(shape)
    out[dim] = sum(b.shape[dim] for b in blocks)
    return out
