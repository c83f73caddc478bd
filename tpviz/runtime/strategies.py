"""The three loading strategies, each from a checkpoint or as a random initialisation.

Every allocation goes through `LoadContext.empty` / `release`, which keep the tensor-byte
ledger; `tpviz.plan.forecast` replays exactly these steps, so forecast and measurement can be
compared byte for byte.

- sliced: each rank reads only its own blocks into its own tensors.
- rank0_broadcast: rank 0 reads one unit's full tensors and sends each rank its part with
  point-to-point sends (a scatter of slices: a receiver never holds more than its part, and
  uneven parts need no padding); replicated tensors are broadcast. A part that is a
  contiguous row block in the target dtype is sent straight from the full tensor; others go
  through one part-sized copy.
- replicated: every rank materialises the whole model on CPU, then keeps its own parts.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..checkpoint import BlockReader, Checkpoint, CheckpointError, TensorInfo, torch_dtype
from ..events import Event, UnitDone, UnitStart
from ..models import ModelAdapter, build_skeleton
from ..plan import (
    Ledger,
    ResolvedPlan,
    TensorPlan,
    needs_staging,
    read_pieces,
    sends_a_view,
)
from ..profiling import COLLECTIVE, COPY, READ, UNIT_PREFIX, no_span
from .memory import prefault
from .parallelize import install, is_distributed, local_of, owner_of


class LoadFailure(RuntimeError):
    """A rank's load failed; names the module, tensor and file involved."""

    def __init__(self, message: str, module: str | None = None, file: str | None = None):
        super().__init__(message)
        self.module = module
        self.file = file


@dataclass
class Traffic:
    sent: int = 0
    received: int = 0


@dataclass
class LoadContext:
    model: nn.Module
    plan: ResolvedPlan
    adapter: ModelAdapter
    rank: int
    device: torch.device
    comm_device: torch.device  # where collectives need their tensors (cpu for gloo)
    ledger: Ledger
    emit: Callable[[Event], None]
    sample: Callable[[], object]  # a memory sample at unit boundaries
    mesh: DeviceMesh | None = None
    checkpoint: Checkpoint | None = None
    reader: BlockReader | None = None
    seed: int = 0
    span: Callable[[str], contextlib.AbstractContextManager] = no_span  # profiler ranges
    traffic: Traffic = field(default_factory=Traffic)

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    # --- accounting -------------------------------------------------------------------------

    def empty(
        self, shape: list[int], dtype: str | torch.dtype, device: torch.device | str | None = None
    ) -> torch.Tensor:
        dtype = torch_dtype(dtype) if isinstance(dtype, str) else dtype
        tensor = torch.empty(shape, dtype=dtype, device=device or self.device)
        self.ledger.alloc(tensor.numel() * tensor.element_size())
        prefault(tensor)
        return tensor

    def release(self, tensor: torch.Tensor) -> None:
        self.ledger.free(tensor.numel() * tensor.element_size())

    def install(self, t: TensorPlan, local: torch.Tensor) -> torch.Tensor:
        mesh = self.mesh if is_distributed(self.plan, t) else None
        return install(self.model, t, local, mesh)

    # --- collectives ------------------------------------------------------------------------

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        with self.span(COLLECTIVE):
            dist.send(tensor, dst)
        self.traffic.sent += tensor.numel() * tensor.element_size()

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        with self.span(COLLECTIVE):
            dist.recv(tensor, src)
        self.traffic.received += tensor.numel() * tensor.element_size()

    def broadcast(self, tensor: torch.Tensor) -> None:
        with self.span(COLLECTIVE):
            dist.broadcast(tensor, 0)
        nbytes = tensor.numel() * tensor.element_size()
        if self.rank == 0:
            self.traffic.sent += nbytes * (self.world_size - 1)
        else:
            self.traffic.received += nbytes

    # --- units ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def unit(
        self, index: int, total: int, module: str, tensors: list[TensorPlan]
    ) -> Iterator[None]:
        nbytes = sum(t.ranks[self.rank].bytes for t in tensors)
        self.emit(
            UnitStart(self.rank, time.time(), module=module, bytes=nbytes, index=index, total=total)
        )
        start = time.perf_counter()
        try:
            with self.span(UNIT_PREFIX + module):
                yield
        except LoadFailure:
            raise
        except CheckpointError as e:
            raise LoadFailure(f"{module}: {e}", module, e.file) from e
        except Exception as e:
            raise LoadFailure(f"{module}: {type(e).__name__}: {e}", module) from e
        seconds = time.perf_counter() - start
        self.sample()
        self.emit(
            UnitDone(
                self.rank,
                time.time(),
                module=module,
                bytes=nbytes,
                seconds=seconds,
                index=index,
                total=total,
            )
        )

    def units(self) -> Iterator[tuple[int, int, str, list[TensorPlan]]]:
        units = self.plan.units()
        for index, (module, tensors) in enumerate(units):
            yield index, len(units), module, tensors

    # --- checkpoint reads -------------------------------------------------------------------

    def infos(self, t: TensorPlan) -> list[TensorInfo]:
        """The checkpoint entries `t` is read from, checked against the plan at read time; an
        assembled tensor's sources are seen with the shape of their box in it."""
        boxes = [s.shape for s in t.sources] or [t.global_shape]
        return [self._info(t, key, box) for key, box in zip(t.checkpoint_keys, boxes)]

    def _info(self, t: TensorPlan, key: str, box: list[int]) -> TensorInfo:
        info = self.checkpoint.tensors.get(key)
        if info is None:
            raise CheckpointError(
                f"tensor {key!r} is not in the checkpoint {self.checkpoint.path} (the plan "
                "expected it; did the checkpoint change?)",
                None,
                key,
            )
        # a stacked source's box has extra dims of size 1: the same bytes in the same order
        dims = (lambda shape: [d for d in shape if d != 1]) if t.sources else list
        if dims(info.shape) != dims(box):
            raise CheckpointError(
                f"{info.file}: tensor {key!r} has shape {list(info.shape)}, the plan expects {box}",
                info.file,
                key,
            )
        if t.source_dtype and info.dtype != t.source_dtype:
            raise CheckpointError(
                f"{info.file}: tensor {key!r} is {info.dtype}, the plan expected "
                f"{t.source_dtype}; resolve the plan again",
                info.file,
                key,
            )
        return info if list(info.shape) == box else replace(info, shape=tuple(box))

    def read_full(self, t: TensorPlan) -> torch.Tensor:
        infos = self.infos(t)
        full = self.empty(t.global_shape, infos[0].torch_dtype, "cpu")
        if t.sources:
            read_pieces_into(self, t, infos, full, None, staged=False)
            return full
        with self.span(READ):
            self.reader.read_full(infos[0], full)
        return full

    def fill_part(
        self, part: torch.Tensor, full: torch.Tensor, t: TensorPlan, rank: int
    ) -> torch.Tensor:
        with self.span(COPY):
            return fill_part(part, full, t, rank)


def _regions(local: torch.Tensor, t: TensorPlan, rank: int) -> Iterator[tuple[Any, torch.Tensor]]:
    """(block, the part of `local` it fills): blocks sit one after another along the shard dim."""
    dim, pos = t.shard_dim, 0
    for block in t.ranks[rank].blocks:
        if dim is None:
            yield block, local
            continue
        size = block.shape[dim]
        yield block, local.narrow(dim, pos, size)
        pos += size


def _block_view(full: torch.Tensor, block) -> torch.Tensor:
    return full[tuple(slice(o, o + s) for o, s in zip(block.offset, block.shape))]


def fill_part(part: torch.Tensor, full: torch.Tensor, t: TensorPlan, rank: int) -> torch.Tensor:
    """Copy rank `rank`'s blocks of `full` into `part` (its local shape; casts as it copies)."""
    for block, region in _regions(part, t, rank):
        region.copy_(_block_view(full, block))
    return part


# --- sliced -----------------------------------------------------------------------------------


def load_sliced(ctx: LoadContext) -> None:
    for index, total, module, tensors in ctx.units():
        with ctx.unit(index, total, module, tensors):
            for t in tensors:
                infos = ctx.infos(t)
                local = ctx.empty(t.ranks[ctx.rank].shape, t.dtype)
                staged = needs_staging(t, ctx.device.type, "checkpoint")
                if t.sources:
                    read_pieces_into(ctx, t, infos, local, ctx.rank, staged)
                    ctx.install(t, local)
                    continue
                info = infos[0]
                for block, region in _regions(local, t, ctx.rank):
                    offset, shape = tuple(block.offset), tuple(block.shape)
                    if not staged:
                        with ctx.span(READ):
                            ctx.reader.read_block(info, offset, shape, region)
                        continue
                    buf = ctx.empty(block.shape, info.torch_dtype, "cpu")
                    with ctx.span(READ):
                        ctx.reader.read_block(info, offset, shape, buf)
                    with ctx.span(COPY):
                        region.copy_(buf)
                    ctx.release(buf)
                    del buf
                ctx.install(t, local)


def read_pieces_into(
    ctx: LoadContext | None,
    t: TensorPlan,
    infos: list[TensorInfo],
    dest: torch.Tensor,
    rank: int | None,
    staged: bool,
    reader: BlockReader | None = None,
) -> None:
    """Fill `dest`, `rank`'s shard of the assembled tensor `t` (rank None: all of it), with
    the pieces of its sources. A piece is read straight into its place when that place is one
    contiguous run and no cast or device move is needed, else through a piece-sized buffer.
    Without `ctx` (the single-process reference) nothing is counted."""
    reader = reader or ctx.reader
    span = ctx.span if ctx else no_span
    for p in read_pieces(t, rank):
        info = infos[p.source]
        target = dest[tuple(slice(o, o + n) for o, n in zip(p.dst_offset, p.shape))]
        if p.contiguous and not staged:
            with span(READ):
                reader.read_block(info, p.src_offset, p.shape, target)
            continue
        if ctx:
            buf = ctx.empty(list(p.shape), info.torch_dtype, "cpu")
        else:
            buf = torch.empty(p.shape, dtype=info.torch_dtype)
        with span(READ):
            reader.read_block(info, p.src_offset, p.shape, buf)
        with span(COPY):
            target.copy_(buf)
        if ctx:
            ctx.release(buf)
        del buf


def init_sliced(ctx: LoadContext) -> None:
    """Each rank draws its own shards in place; shards cannot reproduce a single-process draw.

    Units that hold only replicated tensors use a seed common to all ranks; in units with a
    sharded tensor the seed includes the rank, and their replicated tensors come from rank 0.
    """
    for index, total, module, tensors in ctx.units():
        with ctx.unit(index, total, module, tensors):
            params = [ctx.install(t, ctx.empty(t.ranks[ctx.rank].shape, t.dtype)) for t in tensors]
            sharded = any(t.shard_dim is not None for t in tensors)
            with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
                # on CPU, DTensor random ops run locally on the seeded default generator,
                # which is what is wanted here
                warnings.filterwarnings("ignore", "DTensor random operators may not have")
                torch.manual_seed(unit_seed(ctx.seed, index, ctx.rank if sharded else None))
                ctx.adapter.init_module(ctx.model, ctx.model.get_submodule(module))
            if sharded and ctx.world_size > 1:
                for t, param in zip(tensors, params):
                    if t.shard_dim is None:
                        ctx.broadcast(local_of(param))


def unit_seed(seed: int, index: int, rank: int | None) -> int:
    salt = 0 if rank is None else rank + 1
    return (seed * 1_000_003 + index * 7919 + salt) % (2**63)


# --- rank0_broadcast --------------------------------------------------------------------------


def load_rank0_broadcast(ctx: LoadContext, reference: FullModel | None = None) -> None:
    """From the checkpoint, or from `reference` (rank 0's random init) when given."""
    for index, total, module, tensors in ctx.units():
        with ctx.unit(index, total, module, tensors):
            if ctx.rank != 0:
                for t in tensors:
                    local = ctx.empty(t.ranks[ctx.rank].shape, t.dtype)
                    if t.shard_dim is None:
                        ctx.broadcast(local)
                    elif local.numel():
                        ctx.recv(local, 0)
                    ctx.install(t, local)
                continue
            if reference is not None:
                fulls = reference.materialize(ctx, module, tensors)
            else:
                fulls = [ctx.read_full(t) for t in tensors]
            for t, full in zip(tensors, fulls):
                local = ctx.fill_part(ctx.empty(t.ranks[0].shape, t.dtype), full, t, 0)
                if t.shard_dim is None:
                    ctx.broadcast(local)
                else:
                    for r in range(1, ctx.world_size):
                        if not t.ranks[r].bytes:
                            continue
                        if sends_a_view(t, r, ctx.comm_device.type):
                            ctx.send(_block_view(full, t.ranks[r].blocks[0]), r)
                            continue
                        part = ctx.empty(t.ranks[r].shape, t.dtype, ctx.comm_device)
                        ctx.fill_part(part, full, t, r)
                        ctx.send(part, r)
                        ctx.release(part)
                        del part
                ctx.install(t, local)
            for full in fulls:
                ctx.release(full)
            if reference is not None:
                reference.dematerialize(tensors)
            del fulls


# --- replicated -------------------------------------------------------------------------------


def load_replicated(ctx: LoadContext, reference: FullModel | None = None) -> None:
    """Every rank holds the whole model on CPU first: read from the checkpoint, or the
    random init of `reference`; then keeps its own parts. No collectives."""
    fulls: dict[str, torch.Tensor] = {}
    if reference is not None:
        loaded = reference.loaded
        fulls = dict(zip((t.name for t in loaded), reference.materialize(ctx, None, loaded)))
        reference.init_all(ctx)
    else:
        for index, total, module, tensors in ctx.units():
            with ctx.unit(index, total, module, tensors):
                for t in tensors:
                    fulls[t.name] = ctx.read_full(t)
    for t in ctx.plan.params:
        if t.origin != "checkpoint":
            continue
        full = fulls.pop(t.name)
        local = ctx.fill_part(ctx.empty(t.ranks[ctx.rank].shape, t.dtype), full, t, ctx.rank)
        ctx.install(t, local)
        ctx.release(full)
        del full
    if reference is not None:
        reference.dematerialize(reference.loaded)


# --- the single-process model -----------------------------------------------------------------


def plan_skeleton(
    plan: ResolvedPlan, adapter: ModelAdapter, config: dict, device: torch.device
) -> nn.Module:
    """The meta skeleton with every tensor in the plan's dtype and the computed buffers made
    for real on `device`. Computed buffers (rotary caches) keep the dtype the model class gives
    them: casting the skeleton first would compute them in a 16-bit target dtype, where
    transformers keeps them in float32."""
    model = build_skeleton(adapter, config).to(torch_dtype(plan.dtype))
    for t in plan.params:
        if t.origin == "computed":
            owner, leaf = owner_of(model, t.name)
            owner._buffers[leaf] = owner._buffers[leaf].to(torch_dtype(t.dtype))
    adapter.compute_buffers(model, device)
    return model


class FullModel:
    """An unsharded model following a plan's tensors: the single-process reference, and the
    source of random initialisation for `replicated` and `rank0_broadcast`.

    Random init is: seed once, then each unit's own init in unit order. Materialising draws
    no random numbers, so initialising unit by unit (rank 0 of `rank0_broadcast`) and all at
    once (every rank of `replicated`, or the reference) give the same tensors.
    """

    def __init__(self, plan: ResolvedPlan, adapter: ModelAdapter, config: dict, seed: int = 0):
        self.plan = plan
        self.adapter = adapter
        self.model = plan_skeleton(plan, adapter, config, torch.device("cpu"))
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

    def init_all(self, ctx: LoadContext | None = None) -> None:
        units = self.plan.units()
        for index, (module, tensors) in enumerate(units):
            with ctx.unit(index, len(units), module, tensors) if ctx else contextlib.nullcontext():
                self.adapter.init_module(self.model, self.model.get_submodule(module))

    def load_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Every tensor read whole from the checkpoint and cast to the plan's dtype."""
        with BlockReader() as reader:
            for t, full in zip(self.loaded, self.materialize(None, None, self.loaded)):
                infos = [checkpoint.tensors[k] for k in t.checkpoint_keys]
                if t.sources:
                    boxes = [replace(i, shape=tuple(s.shape)) for i, s in zip(infos, t.sources)]
                    read_pieces_into(None, t, boxes, full, None, True, reader)
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
