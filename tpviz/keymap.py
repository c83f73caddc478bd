"""Checkpoint keys -> model tensors: renamed keys, and tensors assembled from several keys.

A model class may name a tensor differently from its checkpoints (transformers renames keys
as it loads), build one tensor from several checkpoint tensors (per-expert weights stacked
into one, projections concatenated), or several from one (a fused q/k/v split into q, k and
v). A `Source` says where one checkpoint tensor lies in the model tensor: a box, offset and
shape per dim of the model tensor. Stacking gives the box a new dim of size 1, which leaves the
source's row-major byte order as it is, so any sub-box of the box can be read as a block of the
source seen with the box's shape. A split leaves the box where it lies relative to each part,
reaching past the part's edges (a negative offset): only its overlap with a block is read. A
transpose swaps two dims of the box and records, in `order`, which box dim each of the saved
tensor's dims runs along: a sub-box is then read in the saved order and permuted into place.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from torch import nn

T = TypeVar("T")


@dataclass(slots=True)
class Source:
    """One checkpoint tensor's box in the model tensor it is assembled into."""

    key: str
    offset: list[int]
    shape: list[int]
    order: list[int] | None = None  # the box dim each saved dim runs along; None: in order


def in_saved_order(box: Sequence[int], order: Sequence[int] | None) -> list[int]:
    """`box` (offsets or sizes per box dim) in a source's saved dim order (its `order`)."""
    return list(box) if order is None else [box[d] for d in order]


@dataclass
class Layout:
    """A model tensor's shape and the sources that fill it (a symbolic tensor)."""

    shape: list[int]
    sources: list[Source]

    @classmethod
    def of(cls, key: str, shape: Sequence[int]) -> Layout:
        return cls(list(shape), [Source(key, [0] * len(shape), list(shape))])


class KeyMapError(ValueError):
    """Checkpoint tensors that cannot be assembled as the model class asks."""


def odd_one_out(items: Sequence[T], kept: Callable[[T], Hashable]) -> tuple[T, T] | None:
    """Where `kept(item)` (what must agree) differs between items: the first item that differs
    from most, and one that agrees; None where all agree."""
    counts = Counter(kept(item) for item in items)
    if len(counts) == 1:
        return None
    usual = counts.most_common(1)[0][0]
    odd = next(item for item in items if kept(item) != usual)
    like = next(item for item in items if kept(item) == usual)
    return odd, like


def _shapes_differ(odd: Layout, like: Layout) -> str:
    return f"{_named(odd)} is {odd.shape} where {_named(like)} is {like.shape}"


def _named(layout: Layout) -> str:
    keys = [s.key for s in layout.sources]
    return keys[0] if len(keys) == 1 else f"the tensor made from {keys[0]} ..."


def stack(layouts: Sequence[Layout], dim: int) -> Layout:
    """`torch.stack` of the layouts along a new dim `dim`."""
    differ = odd_one_out(layouts, lambda lay: tuple(lay.shape))
    if differ:
        raise KeyMapError(f"cannot stack them: {_shapes_differ(*differ)}")
    shape = list(layouts[0].shape)
    dim = dim % (len(shape) + 1)
    sources = [
        Source(
            s.key,
            [*s.offset[:dim], i, *s.offset[dim:]],
            [*s.shape[:dim], 1, *s.shape[dim:]],
            None if s.order is None else [dim, *(d + (d >= dim) for d in s.order)],
        )
        for i, lay in enumerate(layouts)
        for s in lay.sources
    ]
    return Layout([*shape[:dim], len(layouts), *shape[dim:]], sources)


def transpose(layout: Layout, dim0: int, dim1: int) -> Layout:
    """`torch.transpose` of the layout: dims `dim0` and `dim1` swapped."""
    rank = len(layout.shape)
    if not (-rank <= dim0 < rank and -rank <= dim1 < rank):
        raise KeyMapError(
            f"cannot transpose dims {dim0} and {dim1} of {_named(layout)}, which is {layout.shape}"
        )
    dim0, dim1 = dim0 % rank, dim1 % rank

    relabel = {dim0: dim1, dim1: dim0}

    def swapped(values: Sequence[int]) -> list[int]:
        return [values[relabel.get(d, d)] for d in range(rank)]

    sources = [
        Source(
            s.key,
            swapped(s.offset),
            swapped(s.shape),
            [relabel.get(d, d) for d in (s.order or range(rank))],
        )
        for s in layout.sources
    ]
    return Layout(swapped(layout.shape), sources)


def cat(layouts: Sequence[Layout], dim: int) -> Layout:
    """`torch.cat` of the layouts along `dim`."""
    first = layouts[0].shape
    dim = dim % len(first)

    def other_dims(lay: Layout) -> tuple[int, ...]:
        return len(lay.shape), *lay.shape[:dim], *lay.shape[dim + 1 :]

    differ = odd_one_out(layouts, other_dims)
    if differ:
        raise KeyMapError(f"cannot concatenate them along dim {dim}: {_shapes_differ(*differ)}")
    sources, start = [], 0
    for lay in layouts:
        for s in lay.sources:
            offset = list(s.offset)
            offset[dim] += start
            sources.append(Source(s.key, offset, list(s.shape), s.order))
        start += lay.shape[dim]
    shape = list(first)
    shape[dim] = start
    return Layout(shape, sources)


def split(layout: Layout, dim: int, sizes: Sequence[int]) -> list[Layout]:
    """`torch.split` of the layout along `dim` into parts of `sizes`: each part keeps the
    sources it overlaps, their boxes placed relative to the part."""
    dim = dim % len(layout.shape)
    if sum(sizes) != layout.shape[dim] or min(sizes, default=0) < 1:
        raise KeyMapError(f"cannot split {layout.shape[dim]} along dim {dim} into {list(sizes)}")
    parts, start = [], 0
    for size in sizes:
        sources = []
        for s in layout.sources:
            if s.offset[dim] < start + size and s.offset[dim] + s.shape[dim] > start:
                offset = list(s.offset)
                offset[dim] -= start
                sources.append(Source(s.key, offset, list(s.shape), s.order))
        shape = list(layout.shape)
        shape[dim] = size
        parts.append(Layout(shape, sources))
        start += size
    return parts


@dataclass
class Assembly:
    """How one model tensor is read: its checkpoint keys; for several, each one's box and the
    operations that combine them (e.g. `stack(0), cat(1)`), or why tpviz cannot."""

    keys: list[str]
    shape: list[int]
    sources: list[Source] = field(default_factory=list)
    combine: str | None = None
    error: str | None = None


@dataclass
class KeyMap:
    """Model tensor name -> its assembly, for every checkpoint key the model class maps;
    `ignored`: checkpoint keys the model class drops on purpose when it loads."""

    assemblies: dict[str, Assembly] = field(default_factory=dict)
    ignored: set[str] = field(default_factory=set)


def prefixed_key_map(
    model: nn.Module,
    shapes: Mapping[str, Sequence[int]],
    prefix: str,
    ignored_suffixes: Sequence[str] = (),
) -> KeyMap:
    """Checkpoint keys read as transformers reads them for a model whose base model sits under
    `prefix`: a key the model names is its own tensor; a key missing the prefix (a checkpoint
    saved from the base model alone) is the prefixed tensor; keys ending in `ignored_suffixes`
    (caches older checkpoints hold, such as per-layer rotary `inv_freq`) are dropped."""
    names = set(model.state_dict())
    out = KeyMap()
    for key, shape in shapes.items():
        name = key if key in names else f"{prefix}.{key}"
        if name in names:
            out.assemblies.setdefault(name, Assembly([key], list(shape)))
        elif key.endswith(tuple(ignored_suffixes)):
            out.ignored.add(key)
    return out


@dataclass(frozen=True, slots=True)
class Piece:
    """The part of one source that falls in one block of a destination tensor."""

    source: int  # index into the tensor's sources
    src_offset: tuple[int, ...]  # in the source's box
    dst_offset: tuple[int, ...]  # in the destination tensor
    shape: tuple[int, ...]
    contiguous: bool  # the destination box is one contiguous run: read straight into it
    order: tuple[int, ...] | None = None  # the source's `order`: read permuted

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def pieces(
    sources: Sequence[Source], blocks: Iterable, dim: int | None, dest_shape: Sequence[int]
) -> list[Piece]:
    """The pieces of `sources` that fill `blocks` (offset and shape in the model tensor), laid
    one after another along `dim` in a destination tensor of `dest_shape`."""
    out, pos = [], 0
    for block in blocks:
        b_lo, b_hi = block.offset, [o + n for o, n in zip(block.offset, block.shape)]
        for i, s in enumerate(sources):
            for b0, b1, o, n in zip(b_lo, b_hi, s.offset, s.shape):
                if o >= b1 or o + n <= b0:
                    break  # most sources miss a block in their first dim: stop there
            else:
                out.append(_piece(i, s, b_lo, b_hi, dim, pos, dest_shape))
        if dim is not None:
            pos += block.shape[dim]
    return out


def _piece(i: int, s: Source, b_lo, b_hi, dim: int | None, pos: int, dest_shape) -> Piece:
    """Source `i`'s overlap with the block spanning `b_lo`..`b_hi`, placed at `pos` along
    `dim` in the destination."""
    lo = [max(a, b) for a, b in zip(b_lo, s.offset)]
    shape = tuple(min(a, b + n) - low for a, b, n, low in zip(b_hi, s.offset, s.shape, lo))
    dst = [low - b for low, b in zip(lo, b_lo)]
    if dim is not None:
        dst[dim] += pos
    src = tuple(low - o for low, o in zip(lo, s.offset))
    order = None if s.order is None else tuple(s.order)
    straight = order is None and is_one_run(dest_shape, dst, shape)
    return Piece(i, src, tuple(dst), shape, straight, order)


def is_one_run(shape: Sequence[int], offset: Sequence[int], box: Sequence[int]) -> bool:
    """Whether the box at `offset` in a row-major tensor of `shape` is one contiguous run:
    after its leading dims of size 1, one dim may be partial, every later one must be whole."""
    d = 0
    while d < len(box) - 1 and box[d] == 1:
        d += 1
    return all(box[k] == shape[k] and offset[k] == 0 for k in range(d + 1, len(box)))
