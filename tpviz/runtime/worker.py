"""The entry point of a rank started by `tpviz.launch`, and its command loop after loading.

It lives in tpviz (never in `__main__`) so that starting ranks works from a Jupyter kernel. Each
rank talks to the launcher over one duplex pipe: events, replies and heartbeats go up, commands
come down. The process starts in runtime/heartbeat.py, which also ends the rank within a
fraction of a second if the launcher process dies.

A loaded rank stays warm: a `reload` command brings the next load's spec, and the rank frees the
previous model (and returns its memory to the system) before loading again in the same process
group, so the next load's memory baseline means what a fresh rank's does.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import logging
import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout  # it has no public name yet

from ..errors import failed_in, failing_module
from ..events import Phase, RankPhase
from ..messages import Beat, Command, CommandName, Reply
from .channel import Channel
from .loader import (
    ShardedModel,
    error_text,
    failure_event,
    init_group,
    load_in_group,
    rank_device,
)
from .options import WorkerSpec
from .sink import EventSink

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
DTENSOR_MET_OUTSIDE = (
    "the model's code uses a tensor this rank holds as a DTensor outside its module; "
    "`tpviz plan --simulate` names it, `tpviz plan --suggest` finds a plan that runs"
)
UNREADABLE_ARGS = (
    "the rank cannot read its arguments (what it imports by name must be importable there: "
    "define functions and classes in a module, not in a notebook or `python -c`): "
)
OUT_OF_MEMORY = "the rank ran out of memory: give it a smaller input, or load over more ranks"
# a forward that fails inside a module on the ranks, where the whole model runs, fails on what
# the plan cut (a shipped plan may not fit its own model's code: Doge's)
CUTS_MAY_NOT_FIT = (
    "a plan whose cuts the model's code does not follow fails so: `tpviz plan --simulate` "
    "checks a plan on simulated ranks, `tpviz plan --suggest` finds one that runs"
)


def run_rank(rank: int, spec: WorkerSpec, channel: Channel) -> None:
    world = spec.plan.world_size
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        GLOO_SOCKET_IFNAME="lo",
        NCCL_SOCKET_IFNAME="lo",
    )
    torch.set_num_threads(spec.threads)
    fix_mmap_threshold()
    # torch logs some failures with their traceback before it raises them (fake tensors, in
    # DTensor's sharding propagation); the rank reports what it raises, in one line
    logging.getLogger("torch").setLevel(logging.CRITICAL)
    sink = EventSink(rank, channel.send, spec.events_dir)
    try:
        sink.emit(Phase(rank, time.time(), name=RankPhase.STARTING))
        device = rank_device(spec.device)
        init_group(
            device,
            init_method=f"file://{spec.rendezvous}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=spec.timeout),
        )
        while True:
            loaded = load_in_group(spec.plan, spec.options, sink, device)
            sink.flush()
            spec = _serve(loaded, channel)
            if spec is None:
                break
            del loaded  # the previous model, before the next one is built
            sink.close()
            release_memory(device)
            set_group_timeout(spec.timeout)  # the reload's own
            sink = EventSink(rank, channel.send, spec.events_dir)
            sink.emit(Phase(rank, time.time(), name=RankPhase.STARTING))
    except BaseException as e:  # report, then leave at once: peers may be stuck in collectives
        try:
            sink.emit(failure_event(rank, e))
            sink.close()
        finally:
            os._exit(1)
    sink.close()
    try:
        dist.barrier()  # no rank tears its group down while a peer still uses it
        dist.destroy_process_group()
    except Exception:  # a peer ended first (the launcher was closing anyway): leave quietly
        os._exit(1)


def fix_mmap_threshold() -> None:
    """Keep glibc's mmap threshold where it starts (128 KiB): every large allocation then gets
    pages of its own, given back when it is freed. glibc otherwise raises the threshold as
    large blocks are freed, and later allocations of up to that size come from its heap,
    which keeps freed pages: a second load on warm ranks then held more at its peak (a
    replicated load: 190-215 MiB against 157 MiB on fresh ranks) for the same tensors."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:  # glibc only; setting the threshold ends its adjustment
        mallopt(M_MMAP_THRESHOLD, 128 << 10)


def release_memory(device: torch.device) -> None:
    """Free what the previous model left: cycles, the CUDA cache, and the C heap's free pages
    (small blocks stay in glibc's heap): the next load's memory baseline means what a fresh
    rank's does."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:  # glibc only
        trim(0)


def set_group_timeout(seconds: float) -> None:
    """The default group's collective timeout (gloo and nccl take a new one between
    collectives; a reload may ask for another than the launch's)."""
    _set_pg_timeout(timedelta(seconds=seconds))


def _serve(loaded: ShardedModel, channel: Channel) -> WorkerSpec | None:
    """Run commands on the loaded model; the next load's spec on `reload`, None on shutdown."""
    while True:
        command: Command = channel.recv()
        if command.name is CommandName.SHUTDOWN:
            channel.send(Reply(command.command_id, True, None))
            return None
        if command.name is CommandName.RELOAD:
            # heard at once, so the release of this model is the reload's `imports` phase
            channel.send(Beat(time.time()))
            return command.args()[0]
        reply = _run_command(loaded, command)
        try:
            channel.send(reply)
        except Exception as e:  # the value cannot be pickled (nothing was sent): say so
            channel.send(_failed(loaded, command, e, "its result cannot be sent back: "))


def _run_command(loaded: ShardedModel, command: Command) -> Reply:
    try:
        args = command.args()
    except Exception as e:  # e.g. a function of the caller's __main__, which the rank lacks
        return _failed(loaded, command, e, UNREADABLE_ARGS)
    try:
        payload = COMMANDS[command.name](loaded, *args)
    except Exception as e:
        return _failed(loaded, command, e)
    return Reply(command.command_id, True, _own_storage(payload))


def _own_storage(value: Any) -> Any:
    """`value` with each tensor in it (in lists, tuples and dicts) that views a larger
    storage copied out: pickle sends a tensor's whole storage, and a CPU shard is a view of
    the block holding all of the rank's shards (runtime/arena.py)."""
    if type(value) in (torch.Tensor, torch.nn.Parameter):  # not a subclass without storage
        whole = value.untyped_storage().nbytes()
        return value.clone() if whole > value.numel() * value.element_size() else value
    if type(value) in (list, tuple):
        return type(value)(_own_storage(v) for v in value)
    if type(value) is dict:
        return {k: _own_storage(v) for k, v in value.items()}
    return value


def _out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocation that failed: CUDA's, or the CPU allocator's (a
    RuntimeError in its own words), or Python's."""
    cpu = isinstance(error, RuntimeError) and "DefaultCPUAllocator" in str(error)
    return cpu or isinstance(error, MemoryError | torch.OutOfMemoryError)


def _failed(loaded: ShardedModel, command: Command, error: Exception, why: str = "") -> Reply:
    """A command's failure: one line for the caller, naming the module that raised it where
    one did (a plan whose styles do not compose fails in the module they break), the
    traceback beside it."""
    said = error_text(error)
    module = failing_module(error, loaded.model)
    if _out_of_memory(error):  # not the plan's doing, wherever it happened
        said += f" ({OUT_OF_MEMORY})"
    elif "mixed torch.Tensor and DTensor" in said:  # DTensor's words for it
        said += f" ({DTENSOR_MET_OUTSIDE})"
    elif command.name is CommandName.FORWARD and module is not None:
        said += f" ({CUTS_MAY_NOT_FIT})"
    kind = type(error).__name__
    where = failed_in(module)
    text = f"rank {loaded.rank}: {command.name} failed{where}: {why}{kind}"
    text += f": {said}" if said != kind else ""
    return Reply(command.command_id, False, text, traceback.format_exc())


def _forward(loaded: ShardedModel, input_ids: torch.Tensor) -> torch.Tensor | None:
    logits = loaded.forward(input_ids)
    return logits.cpu() if loaded.rank == 0 else None


def resolve_callable(fn: Callable | str) -> Callable:
    """A function, or its import path `pkg.mod:fn`."""
    if callable(fn):
        return fn
    module, _, name = str(fn).partition(":")
    return getattr(importlib.import_module(module), name)


def _call(loaded: ShardedModel, fn: Callable | str, args: tuple, kwargs: dict) -> Any:
    return resolve_callable(fn)(loaded.model, *args, **kwargs)


COMMANDS: dict[CommandName, Callable[..., Any]] = {
    CommandName.FORWARD: _forward,
    CommandName.SHARD_REPORT: lambda loaded: loaded.shard_report(),
    CommandName.CALL: _call,
    CommandName.CHECK_GROUP: lambda loaded: dist.barrier(),
}
