"""One rank of benchmarks/vs_transformers.py, run under torchrun: load a checkpoint with
transformers' `from_pretrained(tp_plan="auto")`, with tpviz's `load_sharded`, or do only the
floor of any loader that owns its memory, timing and measuring inside the rank the same way.

    torchrun --nproc-per-node 2 benchmarks/peer_rank.py {transformers|tpviz|floor|floor-huge} \
        SOURCE OUT.json

`floor` takes fresh memory for exactly the bytes tpviz's plan gives this rank, made as tpviz
makes a shard's (torch's allocator, pages populated), and copies that many checkpoint bytes
into it with large reads: no model, no plan, no per-tensor work. `floor-huge` does the same in
a mapping of its own marked for transparent huge pages.
"""

from __future__ import annotations

import builtins
import json
import sys
import time

import psutil
import torch
import torch.distributed as dist
from common import floor_load

from tpviz.models import FIXED_PROMPT
from tpviz.runtime.memory import PeakRss


class Split:
    """Seconds of one tpviz call spent in each part, by timers put around the functions that
    do it; time goes to the innermost part running (an import inside the skeleton counts as
    imports), so the parts add up to at most the call."""

    PARTS = {  # part -> (module, attribute) of the function it is timed around
        "imports": (builtins, "__import__"),
        "plan": ("tpviz.runtime.in_group", "_resolve_on_rank0"),  # rank 0 resolves, others read
        "skeleton": ("tpviz.runtime.loader", "_prepare"),
        "allocation": ("tpviz.runtime.executor.LoadContext", "shard"),
        "reads": ("tpviz.runtime.executor", "read_into"),
        "wrapping": ("tpviz.runtime.executor.LoadContext", "install"),
        "checks": ("tpviz.runtime.loader", "_rank_result"),  # shards against the plan
    }

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(self.PARTS, 0.0)
        self._stack: list[str] = []
        self._since = 0.0
        for part, (owner, name) in self.PARTS.items():
            owner = _resolve(owner) if isinstance(owner, str) else owner
            setattr(owner, name, self._timed(part, getattr(owner, name)))

    def _timed(self, part: str, fn):
        def timed(*args, **kwargs):
            now = time.perf_counter()
            if self._stack:
                self.seconds[self._stack[-1]] += now - self._since
            self._stack.append(part)
            self._since = now
            try:
                return fn(*args, **kwargs)
            finally:
                now = time.perf_counter()
                self.seconds[self._stack.pop()] += now - self._since
                self._since = now

        return timed


def _resolve(path: str):
    module, _, cls = path.rpartition(".")
    if cls[0].isupper():
        return getattr(sys.modules[module], cls)
    return sys.modules[path]


def touch(tensors: list[torch.Tensor]) -> float:
    """Read every byte of every local tensor. A loader may hand out views of the mmap'd
    checkpoint that nothing has read yet; its load is done only once the bytes are in."""
    total = 0.0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.numel():
            total += float(local.detach().float().sum())
    return total


def main() -> None:
    which, source, out = sys.argv[1], sys.argv[2], sys.argv[3]
    # each loader's own modules, imported as its program would before loading (and only its
    # own: transformers' model classes import torch._dynamo, which a tpviz program does not
    # import, so it must not be imported ahead of tpviz's call either)
    import torch.distributed.tensor  # noqa: F401  (as in any TP program)

    if which == "transformers":
        import transformers

        transformers.AutoModelForCausalLM, transformers.LlamaForCausalLM  # noqa: B018
    else:
        import tpviz.models.llama  # noqa: F401
        import tpviz.runtime.in_group  # noqa: F401

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if which.startswith("floor"):
        shard_bytes = tpviz.resolve_plan(source, dist.get_world_size()).per_rank_bytes[rank]
    dist.barrier()
    split = Split() if which == "tpviz" else None
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
        call = time.perf_counter() - start
        tensors, forward = [*loaded.model.parameters(), *loaded.model.buffers()], loaded.forward
    else:
        huge = which == "floor-huge"
        memory = floor_load(source, shard_bytes, rank, dist.get_world_size(), huge)
        tensors = [memory.view(torch.float32)]
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
    if split is not None:
        row["split"] = {**split.seconds, "call": call}
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
