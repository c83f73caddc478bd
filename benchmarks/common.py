"""Helpers shared by the benchmarks: arguments, medians, sizes, and the owned-memory floor."""

from __future__ import annotations

import argparse
import compileall
import contextlib
import mmap
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import tpviz
from tpviz.checkpoint import BlockReader, Checkpoint, torch_dtype
from tpviz.models.demo import demo_checkpoint
from tpviz.runtime.arena import ShardArena
from tpviz.runtime.executor import read_into
from tpviz.runtime.memory import prefault
from tpviz.strategies.reads import own_reads

CHUNK = 64 << 20


def compile_tpviz() -> None:
    """Write tpviz's bytecode, as `pip install` does for an installed package; torch's and
    transformers' have theirs. An editable install under PYTHONDONTWRITEBYTECODE=1 (set on the
    machines this is built on) would otherwise compile tpviz's sources in every process that
    imports it, 0.05-0.07 s each, and a rank's first plan twice as slowly: a cost no installed
    copy pays. (`compileall` writes even under that setting; the files are gitignored.)"""
    compileall.compile_dir(Path(tpviz.__file__).parent, quiet=1)


def median(values) -> float:
    return statistics.median(values)


def gib(n: float) -> str:
    return f"{n / 1024**3:.2f} GiB" if abs(n) >= 1024**3 else f"{n / 1024**2:.0f} MiB"


VIRTIO_BALLOON = "0x0005"  # virtio device id of a memory balloon
BALLOON_FREE_PAGE_REPORTING = 5  # its feature bit: free guest pages go back to the host


def fresh_memory_note() -> str:
    """What the machine says of the cost of fresh memory. Under a virtio balloon with free
    page reporting, the host takes back free 2 MiB blocks of guest memory a few seconds
    after they are freed, and the next first touch of them waits on the host: here 305 MiB
    took 0.05-0.07 s when freed a moment before and 0.41-0.45 s when freed 8 s before. Every
    loader that owns its memory (tpviz, the floor) pays that in a fresh process, and a
    loader of mmap'd page cache (transformers) does not, so ratios swing with it."""
    bit = BALLOON_FREE_PAGE_REPORTING
    for device in Path("/sys/bus/virtio/devices").glob("*"):
        with contextlib.suppress(OSError):
            balloon = (device / "device").read_text().strip() == VIRTIO_BALLOON
            if balloon and (device / "features").read_text()[bit : bit + 1] == "1":
                return (
                    "memory balloon with free page reporting: fresh memory is slow to fault "
                    "in when the host has taken it back (see common.py)"
                )
    return "no free page reporting seen"


def parse_args(description: str) -> tuple[argparse.Namespace, Path]:
    """`[SOURCE] [--world-size N] [--rounds N]`; SOURCE defaults to the medium demo."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("source", nargs="?", help="checkpoint dir (default: the medium demo)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    compile_tpviz()  # before anything is measured
    return args, Path(args.source) if args.source else demo_checkpoint("medium")


def floor_load(
    source: str, nbytes: int, rank: int, world_size: int, huge_pages: bool = False
) -> torch.Tensor:
    """Fresh memory for `nbytes`, filled with `nbytes` of the checkpoint files' concatenated
    bytes (rank 0 from the start, the last rank up to the end: all are in the page cache).
    The memory is made as tpviz makes a shard's (torch's allocator, then `prefault`), or
    (`huge_pages`) backed by transparent huge pages."""
    if huge_pages:
        out = huge_page_tensor(nbytes)
    else:
        out = torch.empty(nbytes, dtype=torch.uint8)
        prefault(out)
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


def huge_page_tensor(nbytes: int) -> torch.Tensor:
    """`nbytes` of fresh memory in a private mapping of its own, aligned to a huge page and
    marked MADV_HUGEPAGE: faulted in 2 MiB at a time as it is filled (where the kernel has
    transparent huge pages; as 4 KiB pages elsewhere). Unmapped when the tensor is freed."""
    huge = 2 << 20
    region = mmap.mmap(-1, nbytes + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(region, dtype=torch.uint8).data_ptr()
    offset = -base % huge
    with contextlib.suppress(AttributeError, OSError):  # a hint: not every kernel has it
        region.madvise(mmap.MADV_HUGEPAGE, offset, nbytes // huge * huge)
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset)


def floor_in_rank(
    loaded, source: str, per_rank_bytes: list[int], huge_pages: bool = False
) -> float:
    """Seconds of the floor inside a loaded job's rank (`job.call`): the ranks' own processes,
    all at once, as they load."""
    rank = dist.get_rank()
    start = time.perf_counter()
    out = floor_load(source, per_rank_bytes[rank], rank, len(per_rank_bytes), huge_pages)
    seconds = time.perf_counter() - start
    del out
    return seconds


def plan_reads_in_rank(model, plan: tpviz.ResolvedPlan) -> float:
    """Seconds of the plan's own reads inside a loaded job's rank (`job.call`): fresh memory for
    the rank's bytes made as tpviz makes it (one block, runtime/arena.py), filled by exactly the
    block reads the plan gives this rank, and nothing else (no DTensors, events or checks). The
    floor for this plan's read pattern: a rank whose shards are column blocks reads each row's
    part on its own, which costs more than the same bytes read as one run."""
    rank = dist.get_rank()
    checkpoint = Checkpoint.open(plan.source)
    start = time.perf_counter()
    arena = ShardArena(plan, rank)
    with BlockReader() as reader:
        for _, tensors in plan.units():
            for t in tensors:
                local = arena.take(t.ranks[rank].shape, torch_dtype(t.dtype))
                infos = [checkpoint.tensors[key] for key in t.checkpoint_keys]
                read_into(local, own_reads(t, rank, "cpu"), infos, None, reader)
    seconds = time.perf_counter() - start
    del arena, local
    return seconds
