"""Which Linear feeds which, seen by running the model once, not by reading names.

Every tensor a torch function makes is tagged with the Linears whose outputs it was computed
from (a Linear's output is tagged with that Linear alone, so tags do not leak past the next
Linear). A Linear's input tags are its sources. Megatron's col/row pair is then a closed set:
rows whose sources are exactly the cols, cols consumed only by those rows — the MLP's
gate/up -> down, attention's q/k/v -> o. A Linear whose output reaches a later layer through
the residual stream is consumed by many Linears and pairs with nothing; the check decides
everything else (what happens between the cols and the rows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten


@dataclass
class Dataflow:
    """Linear module names -> the Linears whose outputs reach their input (`sources`), in
    the order the forward first called them."""

    sources: dict[str, set[str]] = field(default_factory=dict)

    def consumers(self, name: str) -> set[str]:
        return {b for b, srcs in self.sources.items() if name in srcs}

    def pairs(self, model: nn.Module) -> list[tuple[list[str], list[str]]]:
        """Closed (cols, rows) pairs that lie inside one module other than the model and a
        ModuleList (the residual stream closes layers into one huge set), smallest first,
        none sharing a Linear; returned in forward order."""
        order = list(self.sources)
        closed = {self._close(row) for row in order if self.sources[row]}
        found, taken = [], set()
        for cols, rows in sorted(closed, key=lambda p: (len(p[0]) + len(p[1]), repr(p))):
            if cols & rows or (cols | rows) & taken or not _inside_a_block(model, cols | rows):
                continue
            taken |= cols | rows
            found.append((sorted(cols, key=order.index), sorted(rows, key=order.index)))
        return sorted(found, key=lambda p: order.index(p[0][0]))

    def _close(self, row: str) -> tuple[frozenset[str], frozenset[str]]:
        """Grow rows and cols until each row's sources are cols and each col's consumers
        rows."""
        cols: set[str] = set()
        rows = {row}
        while True:
            new_cols = set().union(*(self.sources[r] for r in rows))
            new_rows = rows | set().union(*(self.consumers(c) for c in new_cols))
            if new_cols == cols and new_rows == rows:
                return frozenset(cols), frozenset(rows)
            cols, rows = new_cols, new_rows


def _inside_a_block(model: nn.Module, names: set[str]) -> bool:
    common = []
    for parts in zip(*(n.split(".") for n in names)):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    parent = ".".join(common)
    return bool(parent) and not isinstance(model.get_submodule(parent), nn.ModuleList)


class _Tags(TorchFunctionMode):
    """Tags every tensor output with the union of its tensor inputs' tags."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: dict[int, frozenset[str]] = {}
        self.alive: list[torch.Tensor] = []  # keeps ids unique while the forward runs

    def of(self, value: object) -> frozenset[str]:
        leaves, _ = tree_flatten(value)
        found = [self.tags.get(id(t), frozenset()) for t in leaves if isinstance(t, torch.Tensor)]
        return frozenset().union(*found)

    def tag(self, value: object, tags: frozenset[str]) -> None:
        leaves, _ = tree_flatten(value)
        for t in leaves:
            if isinstance(t, torch.Tensor):
                self.tags[id(t)] = tags
                self.alive.append(t)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tags = self.of((args, kwargs))
        if tags:
            self.tag(out, tags | self.of(out))
        return out


def trace(model: nn.Module, run: Callable[[nn.Module], object]) -> Dataflow:
    """The dataflow between `model`'s Linears during `run(model)`."""
    flow = Dataflow()
    tags = _Tags()

    def before(name: str) -> Callable:
        def hook(module: nn.Module, inputs: tuple) -> None:
            flow.sources.setdefault(name, set()).update(tags.of(inputs) - {name})

        return hook

    def after(name: str) -> Callable:
        def hook(module: nn.Module, inputs: tuple, output: object) -> None:
            tags.tag(output, frozenset({name}))

        return hook

    handles = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            handles.append(module.register_forward_pre_hook(before(name)))
            handles.append(module.register_forward_hook(after(name)))
    try:
        with tags, torch.no_grad():
            run(model)
    finally:
        for h in handles:
            h.remove()
    return flow
