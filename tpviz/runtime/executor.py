"""The real executor of a strategy's steps inside one rank: reads, torch.distributed, and the
tensor-byte ledger that the forecast is compared with.

Every allocation goes through `LoadContext.shard` (a rank's final shards: on the CPU, views of
one block, runtime/arena.py) or `empty` / `release`, which keep the ledger; the
strategies (tpviz/strategies/) call only the operations of `tpviz.strategies.Executor`, and
the forecast runs those same steps over a counting executor.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from ..checkpoint import BlockReader, Checkpoint, CheckpointError, TensorInfo, torch_dtype
from ..events import Event, UnitDone, UnitStart
from ..keymap import in_saved_order
from ..models import ModelAdapter
from ..plan import ResolvedPlan, TensorPlan
from ..profiling import COLLECTIVE, COPY, READ, UNIT_PREFIX, no_span
from ..strategies import Ledger
from ..strategies.executor import Unit, plan_units
from ..strategies.reads import Read, block_view, fill_part, own_reads, whole_reads
from .arena import ShardArena
from .memory import prefault
from .parallelize import SpecKey, install, is_distributed
from .staging import PinnedStager


class LoadFailure(RuntimeError):
    """A rank's load failed; names the module, tensor and file involved."""

    def __init__(self, message: str, module: str | None = None, file: str | None = None):
        super().__init__(message)
        self.module = module
        self.file = file


class Reference(Protocol):
    """The single-process model that draws a random initialisation (runtime/reference.py)."""

    def materialize(
        self, ctx: LoadContext | None, module: str | None, tensors: list[TensorPlan]
    ) -> list[torch.Tensor]: ...

    def dematerialize(self, tensors: list[TensorPlan]) -> None: ...


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
    stager: PinnedStager | None = None  # on CUDA: reads into shards, double-buffered
    seed: int = 0
    span: Callable[[str], contextlib.AbstractContextManager] = no_span  # profiler ranges
    traffic: Traffic = field(default_factory=Traffic)
    init: str = "checkpoint"  # or "random"
    # builds the random initialisation's model on the ranks whose strategy asks for it
    make_reference: Callable[[], Reference] | None = None
    _reference: Reference | None = field(default=None, init=False, repr=False)
    _arena: ShardArena | None = field(default=None, init=False, repr=False)
    _specs: dict[SpecKey, DTensorSpec] = field(default_factory=dict, init=False, repr=False)

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def comm_device_type(self) -> str:
        return self.comm_device.type

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

    def shard(self, t: TensorPlan) -> torch.Tensor:
        shape = t.ranks[self.rank].shape
        if self.device.type != "cpu":  # the caching allocator pools device memory already
            return self.empty(shape, t.dtype)
        if self._arena is None:
            self._arena = ShardArena(self.plan, self.rank)
        local = self._arena.take(shape, torch_dtype(t.dtype))
        self.ledger.alloc(local.numel() * local.element_size())
        return local

    def part(self, t: TensorPlan, rank: int) -> torch.Tensor:
        return self.empty(t.ranks[rank].shape, t.dtype, self.comm_device)

    def install(self, t: TensorPlan, local: torch.Tensor) -> torch.Tensor:
        _refuse_overflow(t, local)
        mesh = self.mesh if is_distributed(self.plan, t) else None
        install(self.model, t, local, mesh, self._specs)
        return local  # what the installed parameter holds (the same storage)

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

    def units(self) -> Iterator[Unit]:
        return iter(plan_units(self.plan))

    # --- whole tensors and parts ------------------------------------------------------------

    def read_own(self, t: TensorPlan, local: torch.Tensor) -> None:
        read_into(local, own_reads(t, self.rank, self.device.type), self.infos(t), self)

    def full_tensors(self, module: str, tensors: list[TensorPlan]) -> list[torch.Tensor]:
        if self.init == "checkpoint":
            return [self._read_full(t) for t in tensors]
        if self._reference is None:
            self._reference = self.make_reference()
        return self._reference.materialize(self, module, tensors)

    def free_full(self, t: TensorPlan, full: torch.Tensor) -> None:
        self.release(full)
        if self._reference is not None:
            self._reference.dematerialize([t])

    def fill(
        self, dest: torch.Tensor, full: torch.Tensor, t: TensorPlan, rank: int
    ) -> torch.Tensor:
        with self.span(COPY):
            return fill_part(dest, full, t, rank)

    def view(self, full: torch.Tensor, t: TensorPlan, rank: int) -> torch.Tensor:
        return block_view(full, t.ranks[rank].blocks[0])

    def init_module(self, module: str, seed: int) -> None:
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            # on CPU, DTensor random ops run locally on the seeded default generator,
            # which is what is wanted here
            warnings.filterwarnings("ignore", "DTensor random operators may not have")
            torch.manual_seed(seed)
            self.adapter.init_module(self.model, self.model.get_submodule(module))

    def _read_full(self, t: TensorPlan) -> torch.Tensor:
        infos = self.infos(t)
        full = self.empty(t.global_shape, infos[0].torch_dtype, "cpu")
        read_into(full, whole_reads(t), infos, self)
        return full

    # --- checkpoint entries -----------------------------------------------------------------

    def infos(self, t: TensorPlan) -> list[TensorInfo]:
        """The checkpoint entries `t` is read from, checked against the plan at read time; an
        assembled tensor's sources are seen with the shape of their box in it (in their saved
        dim order)."""
        boxes = [in_saved_order(s.shape, s.order) for s in t.sources] or [t.global_shape]
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


def _refuse_overflow(t: TensorPlan, local: torch.Tensor) -> None:
    """float16 holds magnitudes up to 65504: a larger checkpoint value cast to it becomes inf,
    silently in torch (and in transformers), and every logit it reaches is lost."""
    cast = local.dtype == torch.float16 and t.source_dtype not in (None, "float16")
    if cast and local.numel() and bool(local.isinf().any()):
        raise ValueError(
            f"{t.name}: inf after the cast from {t.source_dtype} to float16 (values beyond "
            "+-65504 overflow it, or were inf already); load in bfloat16 or float32 (--dtype)"
        )


def read_into(
    dest: torch.Tensor,
    reads: list[Read],
    infos: list[TensorInfo],
    ctx: LoadContext | None,
    reader: BlockReader | None = None,
) -> None:
    """Perform `reads` into `dest`: straight into place, or (staged) through a buffer of the
    read's shape in the checkpoint's dtype (into a GPU tensor: through `ctx.stager`). Without
    `ctx` (the single-process reference) nothing is counted and `reader` reads."""
    reader = reader or ctx.reader
    span = ctx.span if ctx else no_span
    for read in reads:
        info = infos[read.source]
        target = dest[read.target]
        if not read.staged:
            with span(READ):
                reader.read_block(info, read.src_offset, read.shape, target)
            continue
        if ctx and ctx.stager and dest.device.type == "cuda":
            with span(READ):
                ctx.stager.stage(dest, read, info)
            continue
        offset, shape = read.saved_box
        if ctx:
            buf = ctx.empty(list(shape), info.torch_dtype, "cpu")
        else:
            buf = torch.empty(shape, dtype=info.torch_dtype)
        with span(READ):
            reader.read_block(info, offset, shape, buf)
        with span(COPY):
            target.copy_(read.placed(buf))
        if ctx:
            ctx.release(buf)
        del buf
