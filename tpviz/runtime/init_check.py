"""Whether a random initialisation holds one consistent model: copies of a tensor agree
across the ranks holding them, and (replicated, rank0_broadcast) the gathered tensors equal a
single-process initialisation with the same seed."""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist

from ..models.adapter import local_of
from ..plan import TensorPlan
from ..strategies.reads import fill_part
from .executor import LoadContext
from .options import LoadOptions
from .parallelize import lookup
from .reference import FullModel

SLICED_INIT_NOTE = (
    "sliced draws each shard on its own rank, so its shards cannot equal a single-process "
    "draw with the same seed; only replicated tensors are checked (they agree across ranks)"
)


def _checksum(tensor: torch.Tensor) -> int:
    data = tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
    return zlib.crc32(data)


def check_random_init(ctx: LoadContext, options: LoadOptions, config: dict) -> dict[str, Any]:
    """Do the ranks hold one consistent model? Copies must agree: a replicated tensor across
    all ranks, a `shard(D, groups=G)` chunk across the ranks that share it; for replicated and
    rank0_broadcast the gathered tensors must equal a single-process initialisation with the
    same seed (streamed unit by unit through rank 0)."""
    plan = ctx.plan
    copied = [
        t
        for t in plan.params
        if t.origin == "checkpoint" and (t.shard_dim is None or t.groups is not None)
    ]
    mine = [_checksum(local_of(lookup(ctx.model, t.name))) for t in copied]
    every: list[list[int]] = [None] * plan.world_size  # type: ignore[list-item]
    dist.all_gather_object(every, mine)
    inconsistent = [
        t.name for i, t in enumerate(copied) if _copies_differ(t, [c[i] for c in every])
    ]
    report: dict[str, Any] = {
        "seed": options.seed,
        "strategy": options.strategy,
        "replicated_consistent": not inconsistent,
        "inconsistent": inconsistent[:20],
    }
    if options.strategy == "sliced":
        report.update(matches_single_process=None, mismatched=[], note=SLICED_INIT_NOTE)
    else:
        mismatched = _compare_with_single_process(ctx, config, options.seed)
        report.update(matches_single_process=not mismatched, mismatched=mismatched[:20])
    report["ok"] = not inconsistent and not report["mismatched"]
    report["drawn_without_init"] = ctx.adapter.drawn_without_init()
    return report


def _copies_differ(tensor: TensorPlan, checksums: list[int]) -> bool:
    """Whether ranks holding the same copy of `tensor` hold different values."""
    sharing = len(checksums) // (tensor.groups or 1)  # consecutive ranks holding one copy
    copies: dict[int, set[int]] = {}
    for rank, checksum in enumerate(checksums):
        copies.setdefault(rank // sharing, set()).add(checksum)
    return any(len(values) > 1 for values in copies.values())


def _compare_with_single_process(ctx: LoadContext, config: dict, seed: int) -> list[str]:
    """Names of tensors whose gathered value differs from a single-process init (rank 0's
    list; other ranks return []). Ranks send their shards to rank 0 unit by unit."""
    plan, rank = ctx.plan, ctx.rank
    reference = FullModel(plan, ctx.adapter, config, seed) if rank == 0 else None
    mismatched: list[str] = []
    for module, tensors in plan.units():
        if reference is not None:
            fulls = reference.materialize(None, module, tensors)
        for i, t in enumerate(tensors):
            local = local_of(lookup(ctx.model, t.name)).detach()
            if t.shard_dim is None:
                if reference is not None and not torch.equal(local.cpu(), fulls[i]):
                    mismatched.append(t.name)
                continue
            if rank != 0:
                if local.numel():
                    dist.send(local.to(ctx.comm_device).contiguous(), 0)
                continue
            same = True
            for r in range(plan.world_size):
                if not t.ranks[r].bytes:
                    continue
                part = local
                if r:
                    part = torch.empty(t.ranks[r].shape, dtype=local.dtype, device=ctx.comm_device)
                    dist.recv(part, r)
                expected = torch.empty(t.ranks[r].shape, dtype=local.dtype)
                same &= torch.equal(part.cpu(), fill_part(expected, fulls[i], t, r))
            if not same:
                mismatched.append(t.name)
        if reference is not None:
            reference.dematerialize(tensors)
    return mismatched
