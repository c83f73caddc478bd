"""Helpers shared by the benchmarks: arguments, medians, sizes, and the owned-memory floor."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tpviz.checkpoint import Checkpoint
from tpviz.models.demo import demo_checkpoint
from tpviz.runtime.memory import fresh_tensor, populate

CHUNK = 64 << 20


def median(values) -> float:
    return statistics.median(values)


def gib(n: float) -> str:
    return f"{n / 1024**3:.2f} GiB" if abs(n) >= 1024**3 else f"{n / 1024**2:.0f} MiB"


def parse_args(description: str) -> tuple[argparse.Namespace, Path]:
    """`[SOURCE] [--world-size N] [--rounds N]`; SOURCE defaults to the medium demo."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("source", nargs="?", help="checkpoint dir (default: the medium demo)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    return args, Path(args.source) if args.source else demo_checkpoint("medium")


def floor_load(
    source: str, nbytes: int, rank: int, world_size: int, huge_pages: bool = True
) -> torch.Tensor:
    """Fresh memory for `nbytes`, filled with `nbytes` of the checkpoint files' concatenated
    bytes (rank 0 from the start, the last rank up to the end: all are in the page cache).
    The memory is made as tpviz makes a shard's (`fresh_tensor`: huge pages where the
    kernel has them), or (`huge_pages=False`) populated as 4 KiB pages."""
    if huge_pages:
        out = fresh_tensor([nbytes], torch.uint8)
    else:
        out = torch.empty(nbytes, dtype=torch.uint8)
        populate(out)
    view = memoryview(out.numpy())
    files = Checkpoint.open(source).files
    total = sum(os.path.getsize(f) for f in files)
    if total < nbytes:
        raise ValueError(f"{source} holds fewer than {nbytes} bytes")
    skip, filled = rank * (total - nbytes) // max(1, world_size - 1), 0
    for file in files:
        size = os.path.getsize(file)
        if skip >= size:
            skip -= size
            continue
        fd = os.open(file, os.O_RDONLY)
        try:
            position = skip
            while position < size and filled < nbytes:
                n = os.preadv(fd, [view[filled : filled + min(CHUNK, size - position)]], position)
                position, filled = position + n, filled + n
        finally:
            os.close(fd)
        skip = 0
        if filled == nbytes:
            break
    return out


def floor_in_rank(loaded, source: str, per_rank_bytes: list[int], huge_pages: bool = True) -> float:
    """Seconds of the floor inside a loaded job's rank (`job.call`): the ranks' own processes,
    all at once, as they load."""
    rank = dist.get_rank()
    start = time.perf_counter()
    out = floor_load(source, per_rank_bytes[rank], rank, len(per_rank_bytes), huge_pages)
    seconds = time.perf_counter() - start
    del out
    return seconds
