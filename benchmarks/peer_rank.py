"""One rank of benchmarks/vs_transformers.py, run under torchrun: load a checkpoint with
transformers' `from_pretrained(tp_plan="auto")`, with tpviz's `load_sharded`, or do only the
floor of any loader that owns its memory, timing and measuring inside the rank the same way.

    torchrun --nproc-per-node 2 benchmarks/peer_rank.py {transformers|tpviz|floor} SOURCE OUT.json

`floor` takes fresh memory for exactly the bytes tpviz's plan gives this rank and copies that
many checkpoint bytes into it with large reads: no model, no plan, no per-tensor work.
"""

from __future__ import annotations

import json
import os
import sys
import time

import psutil
import torch
import torch.distributed as dist
import transformers

from tpviz.checkpoint import Checkpoint
from tpviz.models import FIXED_PROMPT
from tpviz.runtime.memory import PeakRss, prefault

CHUNK = 64 << 20


def touch(tensors: list[torch.Tensor]) -> float:
    """Read every byte of every local tensor. A loader may hand out views of the mmap'd
    checkpoint that nothing has read yet; its load is done only once the bytes are in."""
    total = 0.0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.numel():
            total += float(local.detach().float().sum())
    return total


def floor_load(source: str, nbytes: int, rank: int, world_size: int) -> torch.Tensor:
    """Fresh memory for `nbytes`, filled with `nbytes` of the checkpoint files' concatenated
    bytes (rank 0 from the start, the last rank up to the end: all are in the page cache)."""
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


def main() -> None:
    which, source, out = sys.argv[1], sys.argv[2], sys.argv[3]
    # import what each loader uses lazily, so neither pays for imports inside the timing
    transformers.AutoModelForCausalLM, transformers.LlamaForCausalLM  # noqa: B018
    import tpviz.models.llama  # noqa: F401
    import tpviz.runtime.loader  # noqa: F401

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if which == "floor":
        shard_bytes = tpviz.resolve_plan(source, dist.get_world_size()).per_rank_bytes[rank]
    dist.barrier()
    process = psutil.Process()
    before = process.memory_info()
    peak = PeakRss()  # baseline after imports and process-group setup
    start = time.perf_counter()
    forward = None
    if which == "transformers":
        model = transformers.AutoModelForCausalLM.from_pretrained(
            source, tp_plan="auto", dtype=torch.float32
        )
        tensors, forward = [*model.parameters(), *model.buffers()], model
    elif which == "tpviz":
        loaded = tpviz.load_sharded(source, memory_hz=0)
        tensors, forward = [*loaded.model.parameters(), *loaded.model.buffers()], loaded.forward
    else:
        tensors = [floor_load(source, shard_bytes, rank, dist.get_world_size()).view(torch.float32)]
    touched = touch(tensors)
    own = time.perf_counter() - start
    dist.barrier()
    seconds = time.perf_counter() - start
    growth = peak.growth()
    after = process.memory_info()
    row = {
        "rank": rank,
        "seconds": seconds,
        "own_seconds": own,
        "peak_rss_growth": growth,
        # resident growth split: file pages mapped (shared) and the rest (owned)
        "mapped_growth": after.shared - before.shared,
        "owned_growth": (after.rss - after.shared) - (before.rss - before.shared),
        "checksum": touched,
    }
    logits = None
    if forward is not None:
        with torch.no_grad():
            ids = torch.tensor(FIXED_PROMPT) % 32000
            logits = forward(ids).logits if which == "transformers" else forward(ids)
        if hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if rank == 0:
        if logits is not None:
            torch.save(logits.detach().cpu(), out + ".logits.pt")
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
