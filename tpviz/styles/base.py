"""What every TP style is: its cut (which dim of each tensor is split, in how many packed
parts), its forward (how activations are placed around the module) and its cost (what a rank
holds, what the forward sends).

Pure: torch's DTensor placements are built only when a forward runs (importing
`torch.distributed.tensor` costs seconds, which `tpviz plan` does not need to pay).
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from torch import nn

from ..chunks import RankShard, local_shape, shard_blocks

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement

LINEAR = "linear"
EMBEDDING = "embedding"
EXPERTS = "experts"  # a module holding stacked expert tensors (experts, ...)
ANY = "any"
MODULE_NAMES = {
    LINEAR: "nn.Linear",
    EMBEDDING: "an nn.Embedding that looks up the ids it is given first and has no "
    "submodule (such as a norm) computing on the rows it looks up",
    EXPERTS: "an experts module (one holding stacked expert tensors of 3 or more dims)",
}

REPLICATE = "replicate"
SHARD_FEATURES = "shard(-1)"  # an activation cut along its last (feature) dim
# a sum over the ranks, each rank holding one term: computed on plain local tensors, never as
# a DTensor (DTensor turns a replicated value into a partial one by dividing it by the ranks)
PARTIAL = "partial"
# the input of an experts module under expert parallelism: the router's (global) expert ids,
# remapped on each rank to its own experts, every other route masked
ROUTED = "routed"


def is_bias(param_name: str) -> bool:
    """A Linear's `bias`, or a stacked experts bias (`down_proj_bias`, as transformers'
    experts name them): added to the output, one value per output feature."""
    return param_name == "bias" or param_name.endswith("_bias")


def module_kind(module: nn.Module) -> str:
    """The kind a style's `modules` names: LINEAR, EMBEDDING, EXPERTS, or the class name."""
    if isinstance(module, nn.Linear):
        return LINEAR
    if isinstance(module, nn.Embedding) and _looks_up_ids_first(type(module)):
        # a submodule (a norm, with or without weights) computes on the rows looked up, inside
        # the forward; DTensor sums a vocabulary-cut lookup only where it leaves the module
        if next(module.children(), None) is None:
            return EMBEDDING
    if any(p is not None and p.dim() >= 3 for p in module._parameters.values()):
        return EXPERTS
    return type(module).__name__


@functools.cache
def _looks_up_ids_first(cls: type) -> bool:
    """Whether an nn.Embedding class's forward takes the ids to look up first, as a
    vocabulary-cut embedding's hook needs (it masks its first input). Subclasses may compute
    their ids from other inputs: OPT's learned positions take the attention mask first, Bart's
    the ids' shape."""
    if cls.forward is nn.Embedding.forward:
        return True
    params = list(inspect.signature(cls.forward).parameters)[1:]
    return bool(params) and (params[0] in ("input", "x") or params[0].endswith("ids"))


@dataclass(frozen=True, slots=True)
class Cut:
    """How one tensor is cut: along `dim` (None: whole on every rank) in `parts` packed parts,
    each chunked over the ranks on its own (torch.chunk semantics); with `groups`, chunked
    into that many chunks, each held by world_size/groups consecutive ranks."""

    dim: int | None
    parts: int = 1
    groups: int | None = None

    @property
    def placement(self) -> str:
        if self.dim is None:
            return REPLICATE
        groups = "" if self.groups is None else f", groups={self.groups}"
        return f"shard({self.dim}{groups})"

    def splits_evenly(self, shape: list[int]) -> bool:
        """Whether the packed parts are equal (always true for an unpacked cut)."""
        return self.parts == 1 or shape[self.dim] % self.parts == 0

    def rank_shards(self, shape: list[int], world_size: int, itemsize: int) -> list[RankShard]:
        """What each rank holds of a tensor of `shape`: its blocks, their local shape and bytes
        (the memory cost of the cut)."""
        out = []
        per_rank = shard_blocks(shape, self.dim, world_size, self.parts, self.groups)
        for rank, blocks in enumerate(per_rank):
            lshape = local_shape(shape, self.dim, blocks)
            out.append(RankShard(rank, lshape, math.prod(lshape) * itemsize, blocks))
        return out


@dataclass(frozen=True)
class Forward:
    """How a module's activations are placed when its tensors are DTensors: how the input
    arrives, how the module computes on it, what it hands on (as a local tensor), and the
    collective that costs."""

    input: str
    compute: str
    output: str
    collective: str

    @property
    def on_dtensors(self) -> bool:
        """Whether the module computes on DTensors (False: on plain local tensors, with the
        partial sums handled around it)."""
        return PARTIAL not in (self.input, self.compute, self.output)

    @functools.cached_property
    def placements(self) -> tuple[Placement, Placement, Placement]:
        """(input, compute, output) as DTensor placements on the one mesh dim."""
        from torch.distributed.tensor import Replicate, Shard

        def placement(text: str) -> Placement:
            return Shard(-1) if text == SHARD_FEATURES else Replicate()

        return placement(self.input), placement(self.compute), placement(self.output)


class Style:
    """One TP style. A subclass sets the class attributes; the registry holds one instance."""

    name: ClassVar[str]
    summary: ClassVar[str]
    modules: ClassVar[tuple[str, ...]] = (ANY,)  # module kinds the style applies to
    weight_dim: ClassVar[int | None] = None  # dim of the weight that is sharded; None: whole
    bias_sharded: ClassVar[bool] = False
    packed_parts: ClassVar[int] = 1  # fused parts along `weight_dim`, each chunked on its own
    local_output: ClassVar[bool] = False  # output stays sharded: the next module sees a part
    local_input: ClassVar[bool] = False  # input arrives sharded on its last dim
    places_params: ClassVar[bool] = True  # False: each tensor is placed by its own key
    needs_even_split: ClassVar[bool] = False  # its tensors' cuts must give equal slices
    # None: the module computes on plain local tensors (no hooks, nothing sent)
    forward: ClassVar[Forward | None] = None

    @property
    def forward_collective(self) -> str:
        """What the module's forward sends between ranks."""
        return self.forward.collective if self.forward else "none"

    @property
    def model_sees_cut(self) -> bool:
        """Whether the model computes on the cut features themselves: colwise's output stays
        cut along the weight's rows, rowwise's input arrives cut along its columns."""
        return (self.weight_dim == 0 and self.local_output) or (
            self.weight_dim == 1 and self.local_input
        )

    def applies_to(self, module: nn.Module) -> bool:
        return ANY in self.modules or module_kind(module) in self.modules

    def wanted_module(self) -> str:
        """The module kind the style needs, as an error message names it."""
        return " or ".join(MODULE_NAMES.get(kind, kind) for kind in self.modules)

    def placement_dim(self, param_name: str, ndim: int, transposed: bool = False) -> int | None:
        """Sharded dim of parameter `param_name` with `ndim` dims under this style; None:
        replicate. A bias follows `bias_sharded`, cut along its last (feature) dim; any other
        parameter is cut like the weight, and a 1-D one (attention sinks) along its only dim,
        as transformers does. `weight_dim` counts in the last two dims (out, in), so stacked
        experts (experts, out, in) are cut along their features, every expert alike, as
        transformers cuts them; `transposed` experts store (experts, in, out)."""
        if is_bias(param_name):
            return ndim - 1 if self.bias_sharded and ndim else None
        if self.weight_dim is None or ndim == 0:
            return None
        if ndim == 1:
            return 0
        return ndim - 2 + (1 - self.weight_dim if transposed else self.weight_dim)

    def cut(self, param_name: str, ndim: int, transposed: bool = False) -> Cut:
        """How this style cuts parameter `param_name` with `ndim` dims."""
        dim = self.placement_dim(param_name, ndim, transposed)
        return Cut(dim, self.packed_parts if dim is not None else 1)

    def __repr__(self) -> str:
        return f"<style {self.name}>"
