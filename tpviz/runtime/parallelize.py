"""Plan styles -> DTensor placements and forward hooks, and installing real shards.

The skeleton is distributed while still on meta (`distribute_tensor(..., src_data_rank=None)`
moves no data), which gives every tensor of a styled module its DTensor placement; loading
then swaps each meta local tensor for the real one. Forward hooks (via `distribute_module`)
annotate inputs and redistribute outputs as the style says. Inputs that arrive sharded are
annotated with their true global size, so uneven splits (torch.chunk semantics) work where
torch's stock styles would assume equal shards. Packed and replicated tensors stay plain
local tensors: a packed module's forward is an ordinary matmul on the rank's own blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)

from .. import styles
from ..plan import ResolvedPlan, TensorPlan


@dataclass(frozen=True)
class Layouts:
    input: Placement  # how the input arrives
    compute: Placement  # how the module wants it
    output: Placement  # what the module hands on (as a local tensor)


LAYOUTS: dict[str, Layouts] = {
    "colwise": Layouts(Replicate(), Replicate(), Shard(-1)),
    "colwise_gather_output": Layouts(Replicate(), Replicate(), Replicate()),
    "rowwise": Layouts(Shard(-1), Shard(-1), Replicate()),
    "rowwise_split_input": Layouts(Replicate(), Shard(-1), Replicate()),
    "embedding_rowwise": Layouts(Replicate(), Replicate(), Replicate()),
}


def _partition(style: styles.Style, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    if name:  # only the styled module itself
        return
    for leaf, param in list(module._parameters.items()):
        if param is None:
            continue
        dim = style.placement_dim(leaf)
        placement = Replicate() if dim is None else Shard(dim)
        module._parameters[leaf] = nn.Parameter(
            distribute_tensor(param, mesh, [placement], src_data_rank=None), requires_grad=False
        )


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def _prepare_input(layouts: Layouts, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    x, *rest = inputs
    if not isinstance(x, DTensor):
        shape = tuple(x.shape)
        if isinstance(layouts.input, Shard):  # the global size is the weight's input features
            shape = (*shape[:-1], module.weight.shape[1])
        x = DTensor.from_local(
            x, mesh, [layouts.input], run_check=False, shape=shape, stride=_contiguous_stride(shape)
        )
    if x.placements != (layouts.compute,):
        x = x.redistribute(mesh, [layouts.compute])
    return (x, *rest)


def _prepare_output(layouts: Layouts, module: nn.Module, output: DTensor, mesh: DeviceMesh):
    if output.placements != (layouts.output,):
        output = output.redistribute(mesh, [layouts.output])
    return output.to_local()


def apply_styles(model: nn.Module, plan: ResolvedPlan, mesh: DeviceMesh) -> None:
    """Give the (meta) model its placements and forward hooks, module by module."""
    for name, style_name in plan.module_styles.items():
        layouts = LAYOUTS.get(style_name)
        if layouts is None:
            continue  # packed / replicated: plain tensors, no hooks
        distribute_module(
            model.get_submodule(name),
            mesh,
            partial(_partition, styles.STYLES[style_name]),
            partial(_prepare_input, layouts),
            partial(_prepare_output, layouts),
        )


def owner_of(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """(module that owns tensor `name`, the tensor's leaf name)."""
    module, _, leaf = name.rpartition(".")
    return model.get_submodule(module), leaf


def install(model: nn.Module, entry: TensorPlan, local: torch.Tensor) -> torch.Tensor:
    """Put this rank's real `local` tensor in place of the meta one, for `entry` and the names
    tied to it (one storage)."""
    owner, leaf = owner_of(model, entry.name)
    if entry.kind == "buffer":
        owner._buffers[leaf] = local
        return local
    current = owner._parameters[leaf]
    if isinstance(current, DTensor):
        value = DTensor.from_local(
            local,
            current.device_mesh,
            current.placements,
            run_check=False,
            shape=current.shape,
            stride=current.stride(),
        )
    else:
        value = local
    param = nn.Parameter(value, requires_grad=False)
    owner._parameters[leaf] = param
    for alias in entry.tied_to:
        alias_owner, alias_leaf = owner_of(model, alias)
        alias_owner._parameters[alias_leaf] = param
    return param


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def placement_of(tensor: torch.Tensor, entry: TensorPlan) -> str:
    """How the tensor is really placed: a DTensor's placement, else `replicate` for a whole
    tensor and `local` for a plain tensor that holds a shard (packed styles)."""
    if isinstance(tensor, DTensor):
        (p,) = tensor.placements
        if isinstance(p, Shard):
            return f"shard({p.dim % tensor.dim()})"
        return "replicate" if isinstance(p, Replicate) else str(p)
    return "replicate" if list(tensor.shape) == entry.global_shape else "local"


def lookup(model: nn.Module, name: str) -> torch.Tensor:
    owner, leaf = owner_of(model, name)
    tensor = owner._parameters.get(leaf)
    return tensor if tensor is not None else owner._buffers[leaf]


def shard_report(model: nn.Module, plan: ResolvedPlan, rank: int) -> list[dict]:
    """This rank's real tensors next to what the plan says it holds."""
    rows = []
    for entry in plan.params:
        tensor = lookup(model, entry.name)
        local = local_of(tensor)
        planned = entry.ranks[rank]
        placement = placement_of(tensor, entry)
        placement_ok = placement == entry.placement or (
            placement == "local" and entry.placement.startswith("shard")
        )
        rows.append(
            {
                "name": entry.name,
                "shape": list(local.shape),
                "dtype": str(local.dtype).removeprefix("torch."),
                "device": str(local.device),
                "placement": placement,
                "bytes": local.numel() * local.element_size(),
                "planned_shape": planned.shape,
                "planned_placement": entry.placement,
                "matches": (
                    list(local.shape) == planned.shape
                    and placement_ok
                    and str(local.dtype).removeprefix("torch.") == entry.dtype
                    and local.device.type != "meta"
                ),
            }
        )
    return rows


def leftover_meta(model: nn.Module) -> list[str]:
    """Names of tensors still on meta (there should be none after loading)."""
    names = [n for n, t in model.named_parameters() if local_of(t).device.type == "meta"]
    names += [n for n, t in model.named_buffers() if t.device.type == "meta"]
    return names
