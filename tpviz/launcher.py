"""launch() and compare(): check the request, then start a LoadJob (job.py) on local ranks.

Ranks fork from tpviz's rank server (rankserver.py) with a file rendezvous in a private temp
dir and loopback-only sockets. A pump thread multiplexes the ranks' pipes and process
sentinels, so a rank that fails or dies ends the whole job within a fraction of a second; a rank
whose heartbeat falls silent (frozen, stopped) ends it after `heartbeat_timeout`, as does one
still running a command that long after its peers finished it (waiting in a collective they
never entered); ranks notice a dead launcher on their own (runtime/heartbeat.py).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import psutil
import torch

from .capacity import free_task_slots, host_shortfall
from .errors import LoadError, MemoryForecastError
from .events import check_apart_from_events, check_rank_files, remove_rank_files
from .job import HEARTBEAT_TIMEOUT, LoadJob
from .liveness import check_seconds
from .outputs import check_output_dir
from .plan import ResolvedPlan, forecast, resolve_plan
from .rankserver import rank_imports, start_server
from .results import LoadResult, add_ratios
from .runtime.options import LoadOptions, check_device, check_strategy
from .strategies import STRATEGIES
from .tempdirs import keep_torch_cache_out_of_tmpdir

__all__ = [
    "HEARTBEAT_TIMEOUT",
    "LoadError",
    "LoadJob",
    "MemoryForecastError",
    "add_ratios",
    "check_memory",
    "compare",
    "launch",
    "load_next",
]


def check_memory(plan: ResolvedPlan, strategy: str, device: str, init: str) -> None:
    """Refuse, with the figures, a load whose forecast (its tensors, and on CPU its ranks'
    processes) does not fit this machine."""
    fc = forecast(plan, strategy, device, init)
    gib = 1024**3
    if device == "cpu":
        available = psutil.virtual_memory().available
        problem = host_shortfall(
            plan.world_size, strategy, fc.peak_bytes, available, free_task_slots()
        )
        if problem:
            raise MemoryForecastError(problem)
        return
    for rank, need in enumerate(fc.peak_bytes):
        free, _ = torch.cuda.mem_get_info(rank)
        if need > free:
            raise MemoryForecastError(
                f"rank {rank} needs about {need / gib:.1f} GiB with {strategy}; GPU {rank} has "
                f"{free / gib:.1f} GiB free. Use the sliced strategy or force=True (--force)"
            )


def _check_strategies(strategies: Any) -> None:
    """compare()'s strategies, checked before any rank starts: a tuple or list of known ones."""
    if isinstance(strategies, str) or not isinstance(strategies, (tuple, list)) or not strategies:
        raise ValueError(
            f"strategies must be a non-empty tuple of strategy names, not {strategies!r}"
        )
    for strategy in strategies:
        check_strategy(strategy)


def _end_rank_running_an_unguarded_script() -> None:
    """A script without the `__main__` guard runs again in each spawned rank while it starts,
    and calls launch there: multiprocessing would refuse with a long traceback from every rank.
    End that rank quietly instead; the parent's job says what to do (guard the call)."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise SystemExit(1)


def _check_main_importable() -> None:
    """Each rank imports the caller's `__main__` as multiprocessing's spawn does: by module
    name, else from its file. A program read from standard input (`python - < script.py`)
    names a file that is not there, `<stdin>`, and every rank would fail to start with a bare
    broken pipe: say so before any starts."""
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None):
        return
    path = getattr(main, "__file__", None)
    if path and not os.path.isfile(os.path.join(multiprocessing.process.ORIGINAL_DIR or "", path)):
        raise RuntimeError(
            f"this program was read from {path}, not from a file: each rank imports the "
            f"caller's __main__ from its file, as multiprocessing does; save the program to a "
            f"file and run that (or call tpviz.launch from a notebook or `python -c`)"
        )


def launch(
    source: str | os.PathLike,
    world_size: int,
    plan: dict | str | os.PathLike | ResolvedPlan | None = None,
    strategy: str = "sliced",
    device: str = "cpu",
    dtype: str | None = None,
    *,
    model: str | None = None,
    init: str = "checkpoint",
    seed: int = 0,
    timeout: float | None = None,
    heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
    verify: bool = False,
    events_dir: str | os.PathLike | None = None,
    profile_dir: str | os.PathLike | None = None,
    profile_forward: bool = False,
    memory_hz: float = 20.0,
    force: bool = False,
    kv_replication: bool = True,
    experts: str | None = None,
) -> LoadJob:
    """Start loading `source` on `world_size` local ranks; returns a LoadJob at once.

    `plan` is a pattern dict, a plan file or a ResolvedPlan (whose world size must match).
    `experts`: "tp" (default) or "ep", the mixture-of-experts layout (see `resolve_plan`).
    `init="random"` initialises from `seed` instead of loading (a config-only source needs it).
    `profile_dir` writes torch.profiler traces (one TensorBoard worker per rank);
    `profile_forward` also profiles one forward of the fixed prompt after loading.
    `timeout` bounds the load in wall time and is the ranks' collective timeout;
    `heartbeat_timeout` (seconds) is how long a rank may stay silent (frozen, stopped) before
    the job fails, at any time from start to shutdown, and how long one may run a `forward`
    or `call` after the other ranks finished it; a rank tpviz's rank server has not forked
    within twice that fails the job too.
    `kv_replication=False` refuses world sizes past the key-value heads (see `resolve_plan`)."""
    _end_rank_running_an_unguarded_script()
    _check_main_importable()
    request = dict(locals())
    # the server's imports (torch; transformers for its models) overlap resolving the plan
    keep_torch_cache_out_of_tmpdir()  # resolving a transformers model imports torch._dynamo
    start_server(rank_imports(source, model))
    return _start(request, warm=None)


def _start(args: dict[str, Any], warm: LoadJob | None) -> LoadJob:
    """Check a request (`launch()`'s arguments) and start its job: on new ranks, or on those
    of the loaded job `warm`, which hands them over only once the request is found valid."""
    a = SimpleNamespace(**args)
    # "no" would read as true (kv_replication: resolve_plan checks it, for every caller)
    for flag in ("verify", "force", "profile_forward"):
        if not isinstance(args[flag], bool):
            raise ValueError(f"{flag} must be True or False, not {args[flag]!r}")
    check_seconds("timeout", a.timeout)
    check_seconds("heartbeat_timeout", a.heartbeat_timeout, optional=False)
    resolved = resolve_plan(
        a.source,
        a.world_size,
        a.plan,
        dtype=a.dtype,
        model=a.model,
        kv_replication=a.kv_replication,
        experts=a.experts,
    )
    resolved.raise_for_errors()
    if resolved.source is None:
        raise ValueError(
            "a plan resolved from an in-memory module cannot be launched; pass a "
            "checkpoint directory"
        )
    check_device(a.device, a.world_size, f"{a.world_size} ranks asked")
    events_dir, profile_dir = a.events_dir, a.profile_dir
    if events_dir is not None:  # "" is refused, not taken for none
        events_dir = check_output_dir(events_dir, "events dir", resolved.source)
        check_rank_files(events_dir)
    if profile_dir is not None:
        profile_dir = check_output_dir(profile_dir, "profile dir", resolved.source)
        check_apart_from_events(profile_dir, "profile dir", events_dir)
    options = LoadOptions(a.strategy, a.init, a.seed, a.memory_hz, profile_dir, a.profile_forward)
    options.validate(resolved)
    if not a.force:
        check_memory(resolved, a.strategy, a.device, options.init)
    ranks = warm._hand_over() if warm is not None else None  # raises if it cannot: first
    if events_dir:
        remove_rank_files(events_dir)
    return LoadJob(
        resolved,
        options,
        device=a.device,
        timeout=a.timeout,
        verify=a.verify,
        events_dir=events_dir,
        heartbeat_timeout=a.heartbeat_timeout,
        warm=ranks,
        relaunch=lambda job, **changes: _reload(args, job, changes),
    )


RESOLVED_BY = frozenset({"plan", "source", "dtype", "model", "kv_replication", "experts"})


def _reload(args: dict[str, Any], job: LoadJob, changes: dict[str, Any]) -> LoadJob:
    """The next load on `job`'s ranks: `args` (the request that started it) with `changes`."""
    unknown = sorted(set(changes) - set(args))
    if unknown:
        raise TypeError(f"reload() got unexpected arguments: {', '.join(unknown)}")
    for fixed in ("world_size", "device", "heartbeat_timeout"):
        if fixed in changes and changes[fixed] != args[fixed]:
            raise ValueError(
                f"a reload keeps the ranks' {fixed} ({args[fixed]!r}); launch a new job to "
                f"change it"
            )
    plan = changes.get("plan")
    if isinstance(plan, ResolvedPlan):  # it says what it was resolved for, unless changes do
        inherited = {"source": plan.source, "dtype": None, "model": None, "experts": None}
        changes = {**{k: v for k, v in inherited.items() if k not in changes}, **changes}
    elif isinstance(args["plan"], ResolvedPlan) and RESOLVED_BY & set(changes):
        # a resolved plan is for one source, dtype and layout: its keys are resolved again
        changes = {**_resolved_for(args["plan"], changes), **changes}
    return _start({**args, **changes}, warm=job)


def _resolved_for(plan: ResolvedPlan, changes: dict[str, Any]) -> dict[str, Any]:
    """What `plan` was resolved with, for resolving its keys again under `changes`: its
    layout choices stay; its dtype and model too, unless the source changes (another
    checkpoint loads in its own dtype, with its own model class, unless they are given)."""
    kept = {
        "plan": plan.given_patterns,
        "experts": plan.experts,
        "kv_replication": plan.kv_replication,
    }
    source = changes.get("source", plan.source)
    if isinstance(source, str | os.PathLike) and os.path.realpath(source) == plan.source:
        kept |= {"dtype": plan.dtype, "model": plan.model}
    return kept


def load_next(
    previous: LoadJob | None,
    source: str | os.PathLike,
    world_size: int,
    plan: dict | str | os.PathLike | ResolvedPlan | None = None,
    device: str = "cpu",
    **kwargs: Any,
) -> LoadJob:
    """The load after `previous`: on its ranks, warm (`reload`), when it is loaded with the
    same world size and device; otherwise `previous` is shut down and new ranks start."""
    if previous is not None and previous.state == "loaded":
        if (previous.plan.world_size, previous.device) == (world_size, device):
            return previous.reload(source=source, plan=plan, **kwargs)
    if previous is not None:
        previous.shutdown()
    return launch(source, world_size, plan, device=device, **kwargs)


def compare(
    source: str | os.PathLike,
    world_size: int,
    plan: dict | str | os.PathLike | ResolvedPlan | None = None,
    strategies: tuple[str, ...] = tuple(STRATEGIES),
    follow: Callable[[LoadJob], LoadResult] | None = None,
    **launch_kwargs: Any,
) -> list[LoadResult]:
    """Load with each strategy in turn on the same ranks (each after the first a reload) and
    return the results, each with `ratio_to_sliced`. `follow(job)` waits for a job (e.g.
    drawing progress); default `wait`. Each strategy writes its events and profiler traces
    to a subdirectory of `events_dir` and `profile_dir` named after it (one load per events
    dir; one TensorBoard run per strategy)."""
    resolved = resolve_plan(
        source,
        world_size,
        plan,
        dtype=launch_kwargs.pop("dtype", None),
        model=launch_kwargs.pop("model", None),
        kv_replication=launch_kwargs.pop("kv_replication", True),
        experts=launch_kwargs.pop("experts", None),
    )
    _check_strategies(strategies)
    results: list[LoadResult] = []
    job = None
    try:
        for strategy in strategies:  # the first on new ranks, the others on the same, warm
            outputs = _outputs_of(strategy, launch_kwargs)
            job = load_next(job, source, world_size, resolved, strategy=strategy, **outputs)
            results.append(follow(job) if follow else job.wait())
    finally:
        if job is not None:
            job.shutdown()
    return add_ratios(results)


def _outputs_of(strategy: str, launch_kwargs: dict[str, Any]) -> dict[str, Any]:
    """`launch_kwargs` with its output dirs made `strategy`'s subdirectories."""
    out = dict(launch_kwargs)
    for key in ("events_dir", "profile_dir"):
        if out.get(key):
            out[key] = os.path.join(out[key], strategy)
    return out
