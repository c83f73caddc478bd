"""Loading inside one rank of an existing process group: skeleton, strategy, checks, result.

`tpviz.launch` runs this in the ranks it spawns; `load_sharded` (in_group.py) runs it in a
process group the caller made (torchrun, several machines).
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ..checkpoint import BlockReader, Checkpoint, CheckpointError
from ..events import Done, Error, Phase, RankPhase
from ..format import first_line
from ..models import ModelAdapter, get_adapter, prompt_ids, read_config
from ..models.adapter import local_of
from ..plan import ResolvedPlan
from ..plan.resolve import SourceModel
from ..profiling import PHASE_PREFIX, rank_profiler
from ..results import RankResult
from ..strategies import STRATEGIES, Ledger, forecast
from .executor import LoadContext, LoadFailure
from .init_check import check_random_init
from .memory import MemorySampler, PeakRss
from .options import LoadOptions, check_device
from .parallelize import apply_styles, leftover_meta, lookup, shard_report
from .reference import FullModel, plan_skeleton
from .sink import EventSink
from .staging import PinnedStager


@dataclass
class ShardedModel:
    """One rank's loaded model and its entry of the load JSON (as its `done` event sent it)."""

    model: nn.Module
    plan: ResolvedPlan
    adapter: ModelAdapter
    rank: int
    device: torch.device
    result: dict[str, Any]

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.adapter.logits(self.model, input_ids.to(self.device))

    def shard_report(self) -> list[dict]:
        return shard_report(self.model, self.plan, self.rank)


def init_group(device: torch.device, **kwargs: Any) -> None:
    """The default process group for a rank on `device`: nccl bound to its GPU, or gloo on
    CPU; `kwargs` go to `init_process_group` (rendezvous, rank, timeout)."""
    if device.type == "cuda":
        dist.init_process_group("nccl", device_id=device, **kwargs)
    else:
        dist.init_process_group("gloo", **kwargs)


def rank_device(device: str) -> torch.device:
    """This rank's device: the CPU, or the GPU of its local rank."""
    index = int(os.environ.get("LOCAL_RANK", "0"))
    check_device(device, index + 1, f"local rank {index} has none")
    if device == "cuda":
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device(device)


def load_in_group(
    plan: ResolvedPlan,
    options: LoadOptions,
    sink: EventSink,
    device: torch.device,
    found: SourceModel | None = None,
) -> ShardedModel:
    """Load `plan` on this rank. Every rank of the default process group calls it; `found`:
    what this process read to resolve the plan (its skeleton, config and checkpoint), reused."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != plan.world_size:
        raise ValueError(f"the plan is for {plan.world_size} ranks, the process group has {world}")
    options.validate(plan)
    plan.raise_for_errors()
    sink.emit(Phase(rank, time.time(), name=RankPhase.SKELETON))
    config = found.config if found else read_config(plan.source)
    ctx = _prepare(plan, config, rank, device, sink.emit, found)
    ctx.seed = options.seed + options.seed_skew.get(rank, 0)
    if options.reads_checkpoint(rank):
        ctx.checkpoint = found.ckpt if found and found.ckpt else _open_checkpoint(plan)
        ctx.reader = BlockReader()
        if device.type == "cuda":
            ctx.stager = PinnedStager(device, ctx.ledger, ctx.reader)
    sampler = MemorySampler(
        rank, ctx.ledger, sink.emit, options.memory_hz, device, on_tick=sink.flush
    )
    ctx.sample = sampler.sample
    with contextlib.ExitStack() as stack:
        if ctx.reader is not None:
            stack.enter_context(ctx.reader)
        sampler.start()
        stack.callback(sampler.stop)
        measured = _measured_load(ctx, options, config, sampler, sink)
    sink.emit(Phase(rank, time.time(), name=RankPhase.CHECKING))
    entry = _rank_result(ctx, options, measured)
    if options.init == "random":
        entry.init = check_random_init(ctx, options, config)
    sink.emit(Phase(rank, time.time(), name=RankPhase.LOADED))
    result = entry.to_dict()
    sink.emit(Done(rank, time.time(), result=result))
    return ShardedModel(ctx.model, plan, ctx.adapter, rank, device, result)


def _prepare(
    plan: ResolvedPlan,
    config: dict,
    rank: int,
    device: torch.device,
    emit,
    found: SourceModel | None,
) -> LoadContext:
    """The meta skeleton with computed buffers made for real and styles installed."""
    adapter = found.adapter if found else get_adapter(config, plan.model, plan.source)
    model = plan_skeleton(plan, adapter, config, device, found.skeleton if found else None)
    ledger = Ledger()
    for t in plan.params:
        if t.origin == "computed":
            ledger.alloc(local_of(lookup(model, t.name)).nbytes)
    mesh = init_device_mesh(device.type, (plan.world_size,))
    apply_styles(model, plan, mesh)
    return LoadContext(
        model=model,
        plan=plan,
        adapter=adapter,
        rank=rank,
        device=device,
        comm_device=device if dist.get_backend() == "nccl" else torch.device("cpu"),
        ledger=ledger,
        emit=emit,
        sample=lambda: None,
        mesh=mesh,
    )


@dataclass
class _Measured:
    seconds: float  # this rank's own loading
    load_seconds: float  # barrier (all ready) to barrier (all loaded)
    peak: PeakRss
    profile: dict | None


def _measured_load(
    ctx: LoadContext,
    options: LoadOptions,
    config: dict,
    sampler: MemorySampler,
    sink: EventSink,
) -> _Measured:
    rank, device = ctx.rank, ctx.device
    sink.emit(Phase(rank, time.time(), name=RankPhase.READY))
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sampler.peak = peak = PeakRss()
    sampler.sample()  # the baseline sample viewers measure growth from
    sink.emit(Phase(rank, time.time(), name=RankPhase.LOADING))
    with rank_profiler(options.profile_dir, rank, device) as profiler:
        if profiler is not None:
            ctx.span = profiler.span
        start = time.perf_counter()
        with ctx.span(PHASE_PREFIX + "loading"):
            _run_strategy(ctx, options, config)
        seconds = time.perf_counter() - start
        dist.barrier()
        load_seconds = time.perf_counter() - start
        sampler.sample()
        if profiler is not None and options.profile_forward:
            with ctx.span(PHASE_PREFIX + "forward"), torch.no_grad():
                ctx.adapter.logits(ctx.model, prompt_ids(ctx.adapter, config).to(device))
    # the trace is written when the profiler stops; summarise after that
    return _Measured(seconds, load_seconds, peak, profiler.summary() if profiler else None)


def _rank_result(ctx: LoadContext, options: LoadOptions, measured: _Measured) -> RankResult:
    """This rank's entry of the load JSON: real shards checked against the plan."""
    plan, rank = ctx.plan, ctx.rank
    rows = shard_report(ctx.model, plan, rank)
    mismatches = [r["name"] for r in rows if not r["matches"]] + leftover_meta(ctx.model)
    fc = forecast(plan, options.strategy, ctx.device.type, options.init)
    cuda = ctx.device.type == "cuda"
    return RankResult(
        rank=rank,
        seconds=measured.seconds,
        load_seconds=measured.load_seconds,
        param_bytes=sum(r["bytes"] for r in rows),
        planned_bytes=plan.per_rank_bytes[rank],
        peak_rss_bytes=measured.peak.growth(),
        rss_baseline_bytes=measured.peak.baseline,
        peak_tensor_bytes=ctx.ledger.peak,
        forecast_peak_bytes=fc.peak_bytes[rank],
        bytes_sent=ctx.traffic.sent,
        bytes_received=ctx.traffic.received,
        forecast_bytes_sent=fc.sent_bytes[rank],
        forecast_bytes_received=fc.received_bytes[rank],
        plan_matches_shards=not mismatches,
        mismatches=mismatches[:20],
        peak_cuda_allocated_bytes=torch.cuda.max_memory_allocated(ctx.device) if cuda else None,
        profile=measured.profile,
    )


def _open_checkpoint(plan: ResolvedPlan) -> Checkpoint:
    """The checkpoint's metadata as this rank sees it; a failure names the module too."""
    try:
        return Checkpoint.open(plan.source)
    except CheckpointError as e:
        try:
            module = plan.tensor(e.tensor).module if e.tensor else None
        except KeyError:
            module = None
        raise LoadFailure(str(e), module, e.file) from e


@torch.no_grad()  # no tensor of a load needs autograd (its DTensors' to_local skip it too)
def _run_strategy(ctx: LoadContext, options: LoadOptions, config: dict) -> None:
    ctx.init = options.init
    ctx.make_reference = lambda: FullModel(ctx.plan, ctx.adapter, config, ctx.seed)
    STRATEGIES[options.strategy](ctx)
    if ctx.stager is not None:
        ctx.stager.finish()


def failure_event(rank: int, error: BaseException) -> Error:
    """The `error` event of a rank that failed with `error` (being handled)."""
    failure = error if isinstance(error, LoadFailure) else None
    return Error(
        rank,
        time.time(),
        message=error_text(error),
        module=failure.module if failure else None,
        file=failure.file if failure else getattr(error, "file", None),
        traceback=traceback.format_exc(),
    )


def error_text(error: BaseException) -> str:
    """What a rank's failure says: the error's first line (`SystemExit` names the exit)."""
    if isinstance(error, SystemExit):
        return f"the rank called sys.exit({error.code!r})"
    return first_line(error)
