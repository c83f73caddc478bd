"""`load_sharded`: a load inside a process group the caller made (torchrun, several machines).

Rank 0 resolves the plan and sends it to the others; every rank checks that it was asked for
the same load as rank 0 before anything is read, then loads as a spawned rank does
(loader.py). Each rank writes its events from its start, failures included, so that a
follower of the events dir (`LoadMonitor.from_events_dir`) sees how the job ended.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..events import check_rank_files, remove_rank_files
from ..liveness import check_seconds
from ..outputs import check_output_dir
from ..plan import ResolvedPlan, resolve_plan
from ..plan.patterns import load_plan_patterns
from ..plan.resolve import SourceModel, read_source, resolve_and_keep
from ..tempdirs import keep_torch_cache_out_of_tmpdir, remove_stale_workdirs
from .loader import ShardedModel, failure_event, init_group, load_in_group, rank_device
from .options import LoadOptions
from .sink import EventSink


def load_sharded(
    source: str | os.PathLike,
    plan: dict | str | os.PathLike | ResolvedPlan | None = None,
    *,
    strategy: str = "sliced",
    dtype: str | None = None,
    model: str | None = None,
    device: str | None = None,
    init: str = "checkpoint",
    seed: int = 0,
    events_dir: str | os.PathLike | None = None,
    memory_hz: float = 20.0,
    profile_dir: str | os.PathLike | None = None,
    profile_forward: bool = False,
    kv_replication: bool = True,
    experts: str | None = None,
    timeout: float | None = None,
) -> ShardedModel:
    """Load a model tensor-parallel inside the caller's process group (e.g. under torchrun).

    Initialises the default process group from the environment if needed (gloo on CPU, nccl
    on CUDA). Rank 0 resolves the plan and sends it to the others, so every rank executes the
    same plan; the other ranks need only `config.json` (and, except for rank0_broadcast, the
    weights). With `events_dir`, each rank writes its events to `rank{r}.jsonl` there.
    `kv_replication` and `experts` choose as in `resolve_plan`. `timeout` (seconds), for the
    group load_sharded makes: every rank must call it within that time (a peer that exited
    first is not waited for 30 minutes), and it bounds each collective of the load.
    """
    remove_stale_workdirs()  # what killed ranks of earlier jobs left in $TMPDIR
    keep_torch_cache_out_of_tmpdir()  # before a transformers model or a forward imports dynamo
    check_seconds("timeout", timeout)
    local = rank_device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    _join_group(local, timeout)
    choices = dict(dtype=dtype, model=model, kv_replication=kv_replication, experts=experts)
    options = LoadOptions(strategy, init, seed, memory_hz, profile_dir, profile_forward)
    rank = dist.get_rank()
    directory, unusable = _own_events_dir(events_dir, source)
    sink = EventSink(rank, events_dir=directory)
    try:
        resolved, found = _resolve_on_rank0(source, plan, choices, options)
        request = dict(source=source, plan=plan, device=local.type, **choices)
        _agree(resolved, options, unusable, request)
        return load_in_group(resolved, options, sink, local, found)
    except BaseException as e:  # the rank's file ends with why, for those who follow it
        sink.emit(failure_event(rank, e))
        raise
    finally:
        sink.close()


def _join_group(device: torch.device, timeout: float | None) -> None:
    """The default process group: the caller's, or one made from torchrun's environment."""
    if dist.is_initialized():
        if timeout is not None:
            raise ValueError(
                "timeout bounds the process group load_sharded makes, and yours exists: give "
                "it to init_process_group(timeout=...) instead"
            )
        return
    if "RANK" not in os.environ:  # torch's own error names only the variable
        raise ValueError(
            "load_sharded loads inside a process group: run the script under torchrun "
            "(torchrun --nproc-per-node N script.py), or init one first; tpviz.launch "
            "starts ranks of its own"
        )
    limit = {"timeout": timedelta(seconds=timeout)} if timeout is not None else {}
    try:
        init_group(device, **limit)
    except dist.DistStoreError as e:  # a peer never came (it exited, or failed, first)
        within = f"{timeout} s" if timeout is not None else "the process group's timeout"
        raise TimeoutError(
            f"rank {os.environ['RANK']}: not every rank of {os.environ.get('WORLD_SIZE')} "
            f"called load_sharded within {within}: one exited or failed before it ({e})"
        ) from None


def _own_events_dir(
    events_dir: str | os.PathLike | None, source: str | os.PathLike
) -> tuple[str | None, str | None]:
    """(where this rank writes its events from the start, so that even a failure before
    loading ends its file; why it cannot, which `_agree` says on every rank). Each rank's
    file starts empty; rank 0 refuses a dir another running load writes in, and removes the
    files of ranks beyond this world (an earlier, larger load's), which a follower would take
    for this load's."""
    if events_dir is None:
        return None, None
    try:
        directory = check_output_dir(events_dir, "events dir", source)
        if dist.get_rank() == 0:  # the others may have begun theirs: see check_rank_files
            check_rank_files(directory, beyond=dist.get_world_size())
            remove_rank_files(directory, beyond=dist.get_world_size())
    except ValueError as e:  # OutputPathError, or a path that is none (said on every rank)
        return None, str(e)
    return directory, None


def _resolve_on_rank0(
    source: str | os.PathLike, plan: Any, choices: dict[str, Any], options: LoadOptions
) -> tuple[ResolvedPlan, SourceModel | None]:
    """The plan every rank executes, and what this rank read to resolve or while waiting
    for it (loading goes on from that skeleton and those headers rather than building and
    reading them again): rank 0 resolves, the others read their source meanwhile."""
    box: list[Any] = [None]
    found = None
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        try:
            if isinstance(plan, ResolvedPlan):  # checked against what this call asks for
                box = [resolve_plan(source, world, plan, **choices)]
            else:
                resolved, found = resolve_and_keep(source, world, plan, **choices)
                box = [resolved]
        except Exception as e:
            dist.broadcast_object_list([f"{type(e).__name__}: {e}"], src=0)
            raise
    else:
        found = _read_while_waiting(source, choices["model"], options)
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise RuntimeError(f"rank 0 could not resolve the plan: {box[0]}")
    resolved = box[0]
    if found and (found.adapter.name, found.source) != (resolved.model, resolved.source):
        found = None  # read for another model than the plan's: the load builds its own
    return resolved, found


def _agree(
    plan: ResolvedPlan,
    options: LoadOptions,
    problem: str | None,
    request: dict[str, Any],
) -> None:
    """Check, on every rank and before anything is loaded, what each rank was asked: outputs
    outside the checkpoint (tpviz never writes there) and the same load as rank 0's: the
    same source, plan and choices (every rank reads the plan's source: one given another
    would get rank 0's model without a word) and strategy (a rank running another would wait
    in collectives its peers never enter). One rank's problem (`problem`: its events dir's)
    fails them all, with the same error."""
    mine = None
    try:
        if options.profile_dir:
            options.profile_dir = check_output_dir(options.profile_dir, "profile dir", plan.source)
        seed = options.seed if options.init == "random" else None  # what it draws, if any
        load = dict(strategy=options.strategy, init=options.init, seed=seed)
        mine = {**load, **_comparable(request)}
    except Exception as e:  # noqa: BLE001 - said to every rank below: each must reach the broadcast
        problem = str(e)
    asked = [mine]
    dist.broadcast_object_list(asked, src=0)
    if problem is None and asked[0] is not None:
        problem = _differences(mine, asked[0])
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    for rank, found in enumerate(problems):
        if found:
            raise ValueError(f"rank {rank}: {found}")


def _comparable(request: dict[str, Any]) -> dict[str, Any]:
    """A rank's arguments as the ranks compare them: its source as a real path, and its plan
    as the keys it holds (a file is read here, on this rank)."""
    plan = request["plan"]
    if isinstance(plan, ResolvedPlan):  # and what it was resolved for
        keys = (plan.patterns, plan.source, plan.world_size, plan.dtype, plan.model, plan.experts)
    else:
        keys = load_plan_patterns(plan)
    return {**request, "source": os.path.realpath(request["source"]), "plan": keys}


def _differences(mine: dict[str, Any], rank0: dict[str, Any]) -> str | None:
    """What this rank asked for that rank 0 did not, in one line; None if nothing."""
    differ = [name for name in mine if mine[name] != rank0[name]]
    if not differ:
        return None
    asked = ", ".join(
        "another plan than rank 0's" if n == "plan" else f"{n} {mine[n]} (rank 0: {rank0[n]})"
        for n in differ
    )
    return f"asked for {asked}: every rank must ask for the same load"


def _read_while_waiting(
    source: str | os.PathLike, model: str | None, options: LoadOptions
) -> SourceModel | None:
    """What a rank other than 0 reads of its source while rank 0 resolves the plan; None if
    that fails. It must reach the plan's broadcast whatever happens (rank 0 would wait there
    until the timeout), and the load reports the same failure when it reads the files."""
    weights = source if options.reads_checkpoint(dist.get_rank()) else None
    try:
        return read_source(source, model, weights)
    except Exception:
        return None
