"""Forward hooks from each style's placements, and installing real shards.

The meta skeleton gets forward hooks only: they annotate a module's input and redistribute
its output as its style's `forward` says. Each real shard is wrapped as a DTensor
(`DTensor.from_local` with the plan's placement and global shape) when it is installed, so
nothing is ever built on meta but the skeleton. Inputs that arrive sharded are annotated with
their true global size, so uneven splits (torch.chunk semantics) work where torch's stock
styles assume equal shards. Packed and replicated tensors stay plain local tensors: a packed
module's forward is an ordinary matmul on the rank's own blocks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ..checkpoint import dtype_name
from ..models.adapter import local_of
from ..plan import ResolvedPlan, TensorPlan
from ..plan.rank_model import fit_rank_model
from ..styles import PARTIAL, REPLICATE, ROUTED, STYLES, Forward
from ..styles.expert_parallel import route_to_local_experts


def forward_of(plan: ResolvedPlan, module: str) -> Forward | None:
    """The forward placements of `module`'s style; None: no hooks, plain local tensors."""
    style = plan.module_styles.get(module)
    return STYLES[style].forward if style is not None else None


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def _prepare_input(forward: Forward, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    arrives, computes, _ = forward.placements
    x, *rest = inputs
    if not isinstance(x, DTensor):
        shape = tuple(x.shape)
        if isinstance(arrives, Shard):  # the global size is the weight's input features
            shape = (*shape[:-1], module.weight.shape[1])
        x = DTensor.from_local(
            x, mesh, [arrives], run_check=False, shape=shape, stride=_contiguous_stride(shape)
        )
    if x.placements != (computes,):
        x = x.redistribute(mesh, [computes])
    return (x, *rest)


def _prepare_output(forward: Forward, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
    hands_on = forward.placements[2]
    if output.placements != (hands_on,):
        output = output.redistribute(mesh, [hands_on])
    return output.to_local()


def _split_input(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    """A replicated input made a partial one: every rank holds 1/world of it."""
    x, *rest = inputs
    return (x / mesh.size(), *rest)


def _sum_output(module: nn.Module, inputs: tuple, output: torch.Tensor, mesh: DeviceMesh):
    """A partial output summed across the ranks, in place on the plain local tensor."""
    if output is not None:
        dist.all_reduce(output, group=mesh.get_group())
    return output


def _add_once(module: nn.Module, biases: list[str]) -> None:
    """Biases every rank holds whole, in a module whose ranks each compute one term of a sum
    (experts cut by TP add `down_proj_bias` to their partial outputs): on this rank (not rank
    0) the module runs with zeros in their place, so the all-reduce counts each bias once.
    The zeros live for one forward, the size of the biases."""
    held: dict[str, torch.Tensor] = {}

    def zero(mod: nn.Module, inputs: tuple) -> None:
        for leaf in biases:
            held[leaf] = mod._parameters[leaf]
            mod._parameters[leaf] = torch.zeros_like(held[leaf])

    def restore(mod: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        mod._parameters.update(held)
        held.clear()

    module.register_forward_pre_hook(zero)
    module.register_forward_hook(restore, always_call=True)


def _install_partial_hooks(
    module: nn.Module,
    forward: Forward,
    mesh: DeviceMesh,
    experts: tuple[int, int] | None,
    biases: list[str],
) -> None:
    """Hooks of a module computing a partial sum on plain local tensors (MoE experts): what
    DTensor would do for Replicate -> Partial (divide) and Partial -> Replicate (all-reduce);
    experts under expert parallelism (`experts`: this rank's first and count) see their routes
    remapped first; replicated `biases` are added by rank 0 only."""
    if forward.input == ROUTED and experts is not None:  # the plan checks it has experts
        route_to_local_experts(module, *experts)
    if forward.input == PARTIAL:
        module.register_forward_pre_hook(lambda mod, inputs: _split_input(mod, inputs, mesh))
    if forward.compute == PARTIAL and biases and mesh.get_local_rank() != 0:
        _add_once(module, biases)
    if forward.compute == PARTIAL and forward.output == REPLICATE:
        module.register_forward_hook(
            lambda mod, inputs, output: _sum_output(mod, inputs, output, mesh)
        )


def apply_styles(model: nn.Module, plan: ResolvedPlan, mesh: DeviceMesh) -> None:
    """Install the forward hooks of every module whose style redistributes activations, and
    give attention whose key-value heads are replicated its local head ratio and experts a
    kernel that takes their local widths."""
    experts = fit_rank_model(model, plan, mesh.get_local_rank())
    for name in plan.module_styles:
        forward = forward_of(plan, name)
        if forward is None:
            continue  # packed / replicated: plain tensors, no hooks
        module = model.get_submodule(name)
        if not forward.on_dtensors:
            biases = plan.replicated_biases(name)
            _install_partial_hooks(module, forward, mesh, experts.get(name), biases)
            continue
        module.register_forward_pre_hook(
            lambda mod, inputs, forward=forward: _prepare_input(forward, mod, inputs, mesh)
        )
        module.register_forward_hook(
            lambda mod, inputs, output, forward=forward: _prepare_output(forward, output, mesh)
        )


def is_distributed(plan: ResolvedPlan, entry: TensorPlan) -> bool:
    """Whether `entry` is held as a DTensor: every tensor of a module whose forward computes
    on DTensors is."""
    forward = forward_of(plan, entry.module)
    return forward is not None and forward.on_dtensors


def owner_of(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """(module that owns tensor `name`, the tensor's leaf name). Walks the registered
    submodules: `get_submodule` goes through `Module.__getattr__` for every step, about
    50 us a tensor, once per tensor per load."""
    path, _, leaf = name.rpartition(".")
    owner = model
    for step in path.split(".") if path else ():
        child = owner._modules.get(step)
        if child is None:
            raise AttributeError(f"{type(owner).__name__} has no submodule {step!r} ({name})")
        owner = child
    return owner, leaf


SpecKey = tuple[Shard | Replicate, tuple[int, ...], torch.dtype]


def install(
    model: nn.Module,
    entry: TensorPlan,
    local: torch.Tensor,
    mesh: DeviceMesh | None,
    specs: dict[SpecKey, DTensorSpec],
) -> torch.Tensor:
    """Put this rank's real `local` tensor in place of the meta one, for `entry` and the names
    tied to it (one storage). With a mesh it is wrapped as a DTensor with the plan's
    placement (see `is_distributed`); `specs` are the load's DTensor specs so far, shared by
    the parameters of one placement, shape and dtype (the same linear of every layer)."""
    owner, leaf = owner_of(model, entry.name)
    if entry.kind == "buffer":
        owner._buffers[leaf] = local
        return local
    if mesh is None:
        param = nn.Parameter(local, requires_grad=False)
    else:
        dim = entry.shard_dim
        key = (Replicate() if dim is None else Shard(dim), tuple(entry.global_shape), local.dtype)
        if key not in specs:
            specs[key] = _spec(mesh, *key)
        param = DTensor.__new__(DTensor, local, specs[key], requires_grad=False)
        param._is_param = True  # how nn.Parameter marks a tensor subclass (isinstance holds)
    owner._parameters[leaf] = param
    for alias in entry.tied_to:
        alias_owner, alias_leaf = owner_of(model, alias)
        alias_owner._parameters[alias_leaf] = param
    return param


def _spec(
    mesh: DeviceMesh, placement: Shard | Replicate, shape: tuple[int, ...], dtype: torch.dtype
) -> DTensorSpec:
    """The spec of a DTensor parameter with the plan's placement and global shape, so that
    `DTensor.__new__` makes what `nn.Parameter(DTensor.from_local(local, ...,
    run_check=False))` would. Both of those calls pass through `torch._disable_dynamo`
    (DTensor's `__init__` and its `__torch_dispatch__`), whose first call imports
    torch._dynamo: about a second, most of a load under torchrun. The forward dispatches
    through DTensor and pays it there instead. A spec costs about 0.1 ms to make (a tenth of
    a medium model's load on a rank, one per tensor); DTensors only read theirs (an op's
    output gets a new one), so parameters can share one."""
    meta = TensorMeta(torch.Size(shape), _contiguous_stride(shape), dtype)
    return DTensorSpec(mesh, (placement,), tensor_meta=meta)


def placement_of(tensor: torch.Tensor, entry: TensorPlan) -> str:
    """How the tensor is really placed: a DTensor's placement, else, for a plain tensor (packed
    styles), `local` where it holds less than the whole or the plan shards it (on one rank the
    shard is the whole), `replicate` otherwise; its shape is checked on its own."""
    if isinstance(tensor, DTensor):
        (p,) = tensor.placements
        if isinstance(p, Shard):
            return f"shard({p.dim % tensor.dim()})"
        return "replicate" if isinstance(p, Replicate) else str(p)
    whole = list(tensor.shape) == entry.global_shape
    return "replicate" if whole and entry.shard_dim is None else "local"


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
                "dtype": dtype_name(local.dtype),
                "device": str(local.device),
                "placement": placement,
                "bytes": local.numel() * local.element_size(),
                "planned_shape": planned.shape,
                "planned_placement": entry.placement,
                "matches": (
                    list(local.shape) == planned.shape
                    and placement_ok
                    and dtype_name(local.dtype) == entry.dtype
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
