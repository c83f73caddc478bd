"""One rank of benchmarks/vs_transformers.py, run under torchrun: load a checkpoint with
transformers' `from_pretrained(tp_plan="auto")` or with tpviz's `load_sharded`, timing and
measuring inside the rank the same way for both.

    torchrun --nproc-per-node 2 benchmarks/peer_rank.py {transformers|tpviz} SOURCE OUT.json
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist
import transformers

from tpviz.models import FIXED_PROMPT
from tpviz.runtime.memory import PeakRss


def touch(model: torch.nn.Module) -> float:
    """Read every byte of every local tensor. A loader may hand out views of the mmap'd
    checkpoint that nothing has read yet; its load is done only once the bytes are in."""
    total = 0.0
    for tensor in [*model.parameters(), *model.buffers()]:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.numel():
            total += float(local.detach().float().sum())
    return total


def main() -> None:
    which, source, out = sys.argv[1], sys.argv[2], sys.argv[3]
    # import what each loader uses lazily, so neither pays for imports inside the timing
    transformers.AutoModelForCausalLM, transformers.LlamaForCausalLM  # noqa: B018
    import tpviz.models.llama  # noqa: F401
    import tpviz.runtime.loader  # noqa: F401

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.barrier()
    peak = PeakRss()  # baseline after imports and process-group setup
    start = time.perf_counter()
    if which == "transformers":
        model = transformers.AutoModelForCausalLM.from_pretrained(
            source, tp_plan="auto", dtype=torch.float32
        )
        forward = model
    else:
        loaded = tpviz.load_sharded(source, memory_hz=0)
        model, forward = loaded.model, loaded.forward
    touched = touch(model)
    own = time.perf_counter() - start
    dist.barrier()
    seconds = time.perf_counter() - start
    growth = peak.growth()
    with torch.no_grad():
        ids = torch.tensor(FIXED_PROMPT) % 32000
        logits = forward(ids).logits if which == "transformers" else forward(ids)
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(
        rows,
        {
            "rank": rank,
            "seconds": seconds,
            "own_seconds": own,
            "peak_rss_growth": growth,
            "checksum": touched,
        },
    )
    if rank == 0:
        torch.save(logits.detach().cpu(), out + ".logits.pt")
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
