"""replicated: every rank makes the whole model on the CPU (reads it, or draws it with
`init="random"`), then keeps its own parts. No collectives. Peak: the whole model per rank.
"""

from __future__ import annotations

from .executor import Executor, Handle


def run(x: Executor) -> None:
    fulls: dict[str, Handle] = {}
    for index, total, module, tensors in x.units():
        with x.unit(index, total, module, tensors):
            fulls.update(zip((t.name for t in tensors), x.full_tensors(module, tensors)))
    for t in x.plan.params:
        if t.origin != "checkpoint":
            continue
        full = fulls.pop(t.name)
        x.install(t, x.fill(x.shard(t), full, t, x.rank))
        x.free_full(t, full)
