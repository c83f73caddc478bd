"""Forecasts: the peak of the loader's tensor accounting, and collective traffic, per rank and
strategy, replayed from the plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..chunks import Block
from ..keymap import Piece, pieces
from .types import ResolvedPlan, TensorPlan

STRATEGIES = ("sliced", "rank0_broadcast", "replicated")


@dataclass
class Forecast:
    """Expected peak of the loader's tensor accounting, and collective traffic, per rank."""

    peak_bytes: list[int]
    sent_bytes: list[int]
    received_bytes: list[int]

    def to_dict(self) -> dict[str, list[int]]:
        return {
            "peak_bytes": self.peak_bytes,
            "traffic_bytes": [s + r for s, r in zip(self.sent_bytes, self.received_bytes)],
            "sent_bytes": self.sent_bytes,
            "received_bytes": self.received_bytes,
        }


class Ledger:
    """Running total and peak of bytes; the forecast replays the loader's allocations on it."""

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0

    def alloc(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def free(self, nbytes: int) -> None:
        self.current -= nbytes

    def spike(self, nbytes: int) -> None:
        """A buffer allocated and freed again at once (a read's staging copy)."""
        self.peak = max(self.peak, self.current + nbytes)


def needs_staging(t: TensorPlan, device: str, init: str) -> bool:
    """Whether reading `t` goes through a CPU buffer before its final place."""
    if init != "checkpoint":
        return False
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


def forecast(
    plan: ResolvedPlan, strategy: str, device: str = "cpu", init: str = "checkpoint"
) -> Forecast:
    """Replay `strategy`'s allocations (see tpviz/runtime/strategies.py) on one ledger per
    rank. The loops go tensor by tensor, visiting every rank's shard of a tensor together:
    the order within each rank is the loader's, and a large plan is walked once."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r} (choose from {', '.join(STRATEGIES)})")
    w = plan.world_size
    ledgers = [Ledger() for _ in range(w)]
    for t in plan.params:
        if t.origin == "computed":  # made with the skeleton, before loading
            for ledger, shard in zip(ledgers, t.ranks):
                ledger.alloc(shard.bytes)
    units = plan.units()
    if strategy == "sliced":
        for _, unit in units:
            for t in unit:
                for rank, (ledger, shard) in enumerate(zip(ledgers, t.ranks)):
                    ledger.alloc(shard.bytes)
                    for n in staged_reads(t, rank, device, init):
                        ledger.spike(t.source_nbytes(n))
    elif strategy == "replicated":
        loaded = [t for _, unit in units for t in unit]
        for t in loaded:
            spikes = staged_reads(t, None, device, init)
            for ledger in ledgers:
                _read_full(ledger, t, init, spikes)
        for t in loaded:
            for ledger, shard in zip(ledgers, t.ranks):
                ledger.alloc(shard.bytes)
                ledger.free(_full_bytes(t, init))
    else:  # rank0_broadcast: rank 0 holds a unit's full tensors while it sends the parts
        rank0 = ledgers[0]
        for _, unit in units:
            full = sum(_full_bytes(t, init) for t in unit)
            for t in unit:
                _read_full(rank0, t, init, staged_reads(t, None, device, init))
            for t in unit:
                rank0.alloc(t.ranks[0].bytes)
                for r in range(1, w):
                    ledgers[r].alloc(t.ranks[r].bytes)
                    if t.shard_dim is not None and not sends_a_view(t, r, device):
                        rank0.spike(t.ranks[r].bytes)
            rank0.free(full)
    sent, received = [0] * w, [0] * w
    for _, unit in units:
        # rank 0 sends every other rank its part; a sliced random init broadcasts only the
        # replicated tensors of units that also hold a sharded one (see init_sliced)
        mixed = any(t.shard_dim is not None for t in unit)
        for t in unit:
            if strategy == "rank0_broadcast" or (
                strategy == "sliced" and init == "random" and mixed and t.shard_dim is None
            ):
                for r in range(1, w):
                    sent[0] += t.ranks[r].bytes
                    received[r] += t.ranks[r].bytes
    return Forecast([ledger.peak for ledger in ledgers], sent, received)


def read_pieces(t: TensorPlan, rank: int | None) -> list[Piece]:
    """The pieces of an assembled tensor's sources that `rank` reads into its shard, or
    (`rank` None) that make the whole tensor."""
    if rank is None:
        whole = [Block([0] * len(t.global_shape), t.global_shape)]
        return pieces(t.sources, whole, None, t.global_shape)
    shard = t.ranks[rank]
    return pieces(t.sources, shard.blocks, t.shard_dim, shard.shape)


def staged_reads(t: TensorPlan, rank: int | None, device: str, init: str) -> list[int]:
    """Element counts of the reads of `t` that go through a CPU buffer: every block when the
    read casts or lands off the CPU; for an assembled tensor also each piece whose place in
    the destination is not one contiguous run. `rank` None: a whole tensor read on the CPU
    in the checkpoint's dtype."""
    if init != "checkpoint":
        return []
    staged = rank is not None and needs_staging(t, device, init)
    if t.sources:
        return [p.numel for p in read_pieces(t, rank) if staged or not p.contiguous]
    return [math.prod(b.shape) for b in t.ranks[rank].blocks] if staged else []


def _read_full(ledger: Ledger, t: TensorPlan, init: str, staged: list[int]) -> None:
    ledger.alloc(_full_bytes(t, init))
    for n in staged:
        ledger.spike(t.source_nbytes(n))


def _full_bytes(t: TensorPlan, init: str) -> int:
    """Bytes of the whole tensor as the loader materialises it on CPU."""
    return t.source_nbytes() if init == "checkpoint" else t.nbytes
