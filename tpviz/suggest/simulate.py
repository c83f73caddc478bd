"""A resolved plan run on simulated ranks: one thread per rank, in one process.

Each rank gets a copy of a real (small, random) instance holding only its blocks of every
tensor, exactly as the plan's `ranks` say, and the collectives of each module's style
(`forward` of tpviz.styles) happen between the threads: a rowwise output summed over the
ranks with its bias added once, a gathered output concatenated, a split input cut to the
rank's columns, an embedding looked up in the rank's rows only, an experts module's routes
remapped to the rank's own experts and its partial outputs summed. The module code itself runs
unchanged on local tensors, as on real ranks: forward code that reshapes by a head-count
attribute, or normalises over features the plan cut, fails or differs here as it would there.
Real ranks hold the tensors of a module computing on DTensors as DTensors, which only that
module's own forward can use: code elsewhere reading one (Gemma 4 takes the pad row of the
embedding's weight) fails there, so it fails here too (`_DTensorWatch`).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ..chunks import Block
from ..errors import failed_in, failing_module
from ..format import first_line
from ..plan import ResolvedPlan, TensorPlan
from ..plan.rank_model import fit_rank_model
from ..styles import PARTIAL, REPLICATE, ROUTED, STYLES, Forward
from ..styles.expert_parallel import route_to_local_experts

BARRIER_SECONDS = 60.0  # liveness bound: a rank that never reaches a collective fails the run


class _Collective:
    """Exchange of one tensor per rank between the rank threads."""

    def __init__(self, world_size: int):
        self.barrier = threading.Barrier(world_size, timeout=BARRIER_SECONDS)
        self.slots: list[torch.Tensor | None] = [None] * world_size

    def exchange(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = tensor
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()  # no rank refills its slot before every rank has read them
        return got

    def all_reduce(self, rank: int, tensor: torch.Tensor) -> torch.Tensor:
        return torch.stack(self.exchange(rank, tensor)).sum(0)  # rank order: same on all

    def all_gather(self, rank: int, tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.exchange(rank, tensor), dim=-1)


def _local(full: torch.Tensor, blocks: list[Block]) -> torch.Tensor:
    """The rank's blocks of `full`, laid out along the dim they cut (packed parts)."""
    parts = [full[tuple(slice(o, o + s) for o, s in zip(b.offset, b.shape))] for b in blocks]
    if not parts:
        return full.new_empty((0, *full.shape[1:]))
    cut = [d for d in range(full.dim()) if blocks[0].shape[d] != full.shape[d]]
    return torch.cat(parts, dim=cut[0] if cut else 0).clone()


def _rank_copy(model: nn.Module, plan: ResolvedPlan, rank: int) -> nn.Module:
    local = copy.deepcopy(model)
    for name, p in local.named_parameters():
        e = plan.tensor(name)  # tied aliases too
        if e.placement != REPLICATE:
            p.data = _local(p.data, e.ranks[rank].blocks)
    return local


class _DTensorWatch(TorchFunctionMode):
    """Fails an op that makes a tensor from a parameter real ranks hold as a DTensor, run
    anywhere but in the forward of a module holding it (metadata reads, such as its dtype, make
    no tensor and pass). One per rank thread: torch function modes are thread-local."""

    def __init__(self):
        super().__init__()
        self.running: set[nn.Module] = set()
        self.held: dict[int, tuple[str, list[nn.Module]]] = {}

    def hold(self, name: str, module: nn.Module) -> None:
        """`module` (named `name`) computes on DTensors: its parameters are watched."""
        module.register_forward_pre_hook(lambda m, a: self.running.add(m), prepend=True)
        module.register_forward_hook(lambda m, a, o: self.running.discard(m), always_call=True)
        for leaf, p in module._parameters.items():
            if p is not None:
                self.held.setdefault(id(p), (f"{name}.{leaf}", []))[1].append(module)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(x, torch.Tensor) for x in tree_leaves(out)):
            for x in tree_leaves((args, kwargs)):
                name, owners = self.held.get(id(x), (None, ()))
                if name is not None and not self.running.intersection(owners):
                    raise RuntimeError(
                        f"the model's code reads {name} outside its module's forward; real "
                        "ranks hold it as a DTensor, which fails there: keep "
                        f"{name.rpartition('.')[0]} whole ('replicate')"
                    )
        return out


def _install(module: nn.Module, style_name: str, weight: TensorPlan, rank: int, c: _Collective):
    """Hooks doing what the style's forward placements do around the module."""
    style = STYLES[style_name]
    blocks = weight.ranks[rank].blocks
    if isinstance(module, nn.Embedding):
        lo = blocks[0].offset[0] if blocks else 0
        hi = lo + (blocks[0].shape[0] if blocks else 0)

        def lookup(mod, inputs):
            ids = inputs[0]
            mod._tpviz_outside = (ids < lo) | (ids >= hi)
            return (torch.where(mod._tpviz_outside, 0, ids - lo), *inputs[1:])

        def masked_sum(mod, inputs, out):
            return c.all_reduce(rank, out.masked_fill(mod._tpviz_outside[..., None], 0))

        module.register_forward_pre_hook(lookup)
        module.register_forward_hook(masked_sum)
    elif style.weight_dim == 1:
        if style.forward.input == REPLICATE:  # split a replicated input to the rank's columns
            lo = blocks[0].offset[1] if blocks else 0
            n = blocks[0].shape[1] if blocks else 0
            module.register_forward_pre_hook(lambda m, a: (a[0][..., lo : lo + n], *a[1:]))

        def summed(mod, inputs, out):
            bias = mod.bias if mod.bias is not None else 0
            return c.all_reduce(rank, out - bias) + bias

        module.register_forward_hook(summed)
    elif style.forward.output == REPLICATE:
        module.register_forward_hook(lambda m, a, out: c.all_gather(rank, out))


def _install_partial(
    module: nn.Module,
    forward: Forward,
    experts: tuple[int, int] | None,
    biases: list[str],
    rank: int,
    c: _Collective,
) -> None:
    """Hooks of a module that computes one term of a sum on each rank (experts cut by TP, or
    whole experts per rank): routes remapped to the rank's own `experts` (first, count), a
    replicated input divided over the ranks, replicated biases added by rank 0 alone, the
    terms summed."""
    if forward.input == ROUTED and experts is not None:
        route_to_local_experts(module, *experts)
    if forward.input == PARTIAL:
        world = len(c.slots)
        module.register_forward_pre_hook(lambda m, a: (a[0] / world, *a[1:]))
    if forward.compute == PARTIAL and rank != 0:
        for leaf in biases:
            getattr(module, leaf).data.zero_()  # this rank's copy only
    if forward.compute == PARTIAL and forward.output == REPLICATE:
        module.register_forward_hook(lambda m, a, out: c.all_reduce(rank, out))


def run_ranks(
    model: nn.Module, plan: ResolvedPlan, run: Callable[[nn.Module], torch.Tensor]
) -> list[torch.Tensor]:
    """`run` on every simulated rank of `plan` (resolved against `model`); each rank's result.
    Raises RankForwardError for the rank that failed first."""
    collective = _Collective(plan.world_size)
    copies, watches = [], []
    for rank in range(plan.world_size):
        local, watch = _rank_copy(model, plan, rank), _DTensorWatch()
        experts = fit_rank_model(local, plan, rank)
        for mod_name, style_name in plan.module_styles.items():
            forward = STYLES[style_name].forward
            module = local.get_submodule(mod_name)
            if forward is not None and forward.on_dtensors:
                weight = plan.tensor(f"{mod_name}.weight")
                _install(module, style_name, weight, rank, collective)
                watch.hold(mod_name, module)
            elif forward is not None:
                biases = plan.replicated_biases(mod_name)
                _install_partial(module, forward, experts.get(mod_name), biases, rank, collective)
        watches.append(watch)
        copies.append(local)
    results: list[torch.Tensor | None] = [None] * plan.world_size
    errors: list[BaseException | None] = [None] * plan.world_size

    def work(rank: int) -> None:
        try:
            with torch.inference_mode(), watches[rank]:
                results[rank] = run(copies[rank])
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            errors[rank] = e
            collective.barrier.abort()  # the others stop at their next collective

    threads = [threading.Thread(target=work, args=(r,)) for r in range(plan.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [r for r, e in enumerate(errors) if e is not None]
    if failed:
        # the rank that failed first, not one its abort stopped at a collective
        aborted = threading.BrokenBarrierError
        rank = next((r for r in failed if not isinstance(errors[r], aborted)), failed[0])
        raise RankForwardError(rank, failing_module(errors[rank], copies[rank]), errors[rank])
    return results


class RankForwardError(RuntimeError):
    """A simulated rank's forward failed; `module` is the innermost module it was running."""

    def __init__(self, rank: int, module: str | None, error: BaseException):
        super().__init__(
            f"rank {rank}'s forward fails{failed_in(module)} "
            f"({type(error).__name__}: {first_line(error)})"
        )
        self.rank, self.module = rank, module
