"""The unsharded model: the single-process reference, and the source of random
initialisation for `replicated` and `rank0_broadcast`."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..checkpoint import BlockReader, Checkpoint, torch_dtype
from ..keymap import in_saved_order
from ..models import ModelAdapter, build_skeleton
from ..plan import ResolvedPlan, TensorPlan
from ..plan.experts import fit_expert_kernels
from ..strategies.reads import whole_reads
from .executor import LoadContext, read_into
from .parallelize import owner_of


def plan_skeleton(
    plan: ResolvedPlan,
    adapter: ModelAdapter,
    config: dict,
    device: torch.device,
    skeleton: nn.Module | None = None,
) -> nn.Module:
    """The meta skeleton (`skeleton`, the one the plan was resolved on, or a new one) with
    every tensor in its dtype in the plan and the computed buffers made for real on `device`.
    Tensors that the plan keeps out of its dtype keep theirs: computed buffers the model's code
    makes float32 itself (rotary frequencies: transformers keeps them float32 in any dtype)
    and what the model keeps float32 (MoE routers)."""
    if skeleton is None:
        skeleton = build_skeleton(adapter, config, torch_dtype(plan.dtype))
    model = skeleton.to(torch_dtype(plan.dtype))
    for t in plan.params:
        if t.dtype != plan.dtype:
            owner, leaf = owner_of(model, t.name)
            tensor = owner._parameters.get(leaf)
            if tensor is None:
                owner._buffers[leaf] = owner._buffers[leaf].to(torch_dtype(t.dtype))
            else:  # in place, as Module.to does, so that tied names keep one parameter
                tensor.data = tensor.data.to(torch_dtype(t.dtype))
    adapter.compute_buffers(model, device)
    return model


class FullModel:
    """An unsharded model following a plan's tensors: the single-process reference, and the
    source of random initialisation for `replicated` and `rank0_broadcast`.

    Random init is: seed once, then each unit materialised and initialised, in unit order,
    here (`draw`) as in the strategies: an ancestor's init that reaches into a later unit
    finds it still on meta in both, and draws nothing for it.
    """

    def __init__(self, plan: ResolvedPlan, adapter: ModelAdapter, config: dict, seed: int = 0):
        self.plan = plan
        self.adapter = adapter
        self.model = plan_skeleton(plan, adapter, config, torch.device("cpu"))
        fit_expert_kernels(self.model)
        torch.manual_seed(seed)

    @property
    def loaded(self) -> list[TensorPlan]:
        return [t for t in self.plan.params if t.origin == "checkpoint"]

    def materialize(
        self, ctx: LoadContext | None, module: str | None, tensors: list[TensorPlan]
    ) -> list[torch.Tensor]:
        """Full CPU tensors in place of the meta ones (counted on `ctx`'s ledger when given);
        `module`, when given, is then initialised with its own init."""
        out = []
        for t in tensors:
            if ctx is not None:
                full = ctx.empty(t.global_shape, t.dtype, "cpu")
            else:
                full = torch.empty(t.global_shape, dtype=torch_dtype(t.dtype))
            self._assign(t, full)
            out.append(full)
        if module is not None:
            self.adapter.init_module(self.model, self.model.get_submodule(module))
        return out

    def draw(self) -> None:
        """Every loaded tensor drawn from the seed, unit by unit."""
        for module, tensors in self.plan.units():
            self.materialize(None, module, tensors)

    def load_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Every tensor read whole from the checkpoint and cast to the plan's dtype."""
        with BlockReader() as reader:
            for t, full in zip(self.loaded, self.materialize(None, None, self.loaded)):
                infos = [checkpoint.tensors[k] for k in t.checkpoint_keys]
                if t.sources:
                    boxes = [
                        replace(i, shape=tuple(in_saved_order(s.shape, s.order)))
                        for i, s in zip(infos, t.sources)
                    ]
                    read_into(full, whole_reads(t, cast=True), boxes, None, reader)
                else:
                    full.copy_(reader.read_full(infos[0]))

    def dematerialize(self, tensors: list[TensorPlan]) -> None:
        for t in tensors:
            self._assign(t, torch.empty(t.global_shape, dtype=torch_dtype(t.dtype), device="meta"))

    def _assign(self, t: TensorPlan, tensor: torch.Tensor) -> None:
        value = tensor if t.kind == "buffer" else nn.Parameter(tensor, requires_grad=False)
        for name in (t.name, *t.tied_to):  # tied names share one Parameter
            owner, leaf = owner_of(self.model, name)
            (owner._buffers if t.kind == "buffer" else owner._parameters)[leaf] = value
