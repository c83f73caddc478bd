"""LoadJob: spawn the ranks, pump their events, run commands, cancel, and clean up.

`launch()` returns at once; ranks start under the `spawn` start method with a file rendezvous
in a private temp dir and loopback-only sockets (see processes.py). A pump thread multiplexes
the ranks' pipes and process sentinels, so a rank that fails or dies ends the whole job within
a fraction of a second; a rank whose heartbeat falls silent (frozen, stopped, deadlocked) ends
it after `heartbeat_timeout`; ranks notice a dead launcher on their own (runtime/heartbeat.py).
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import pickle
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import wait
from typing import Any

import psutil
import torch

from .capacity import free_task_slots, host_shortfall
from .events import Done, Error, Event, Phase, UnitDone, UnitStart
from .models import get_adapter, prompt_ids, read_config
from .outputs import check_output_dir, collect_output_errors
from .plan import ResolvedPlan, forecast, resolve_plan
from .processes import Ranks
from .runtime.loader import LoadOptions
from .runtime.worker import WorkerSpec
from .token_ids import check_token_ids

LAUNCHER = -1  # the `rank` of events the launcher itself makes
HEARTBEAT_TIMEOUT = 30.0  # seconds of silence after which a rank counts as frozen


class LoadError(RuntimeError):
    """The job failed: names the rank, module and file where known."""

    def __init__(
        self,
        message: str,
        rank: int | None = None,
        module: str | None = None,
        file: str | None = None,
        traceback: str = "",
    ):
        super().__init__(message)
        self.rank, self.module, self.file, self.traceback = rank, module, file, traceback


class MemoryForecastError(LoadError):
    pass


@dataclass
class RankProgress:
    """What the launcher knows of one rank: updated by the pump thread as events arrive."""

    units_done: int = 0
    units_total: int = 0
    bytes_done: int = 0
    bytes_total: int = 0
    module: str | None = None
    phase: str = "starting"
    phase_times: dict[str, float] = field(default_factory=dict)


class LoadJob:
    """A running (or finished) load. Use it as a context manager, or call `shutdown()`."""

    def __init__(
        self,
        plan: ResolvedPlan,
        options: LoadOptions,
        device: str = "cpu",
        timeout: float | None = None,
        verify: bool = False,
        events_dir: str | os.PathLike | None = None,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
    ):
        self.plan = plan
        self.options = options
        self.device = device
        self.verify_requested = verify
        self.state = "starting"  # -> loaded | failed | cancelled, then closed
        self.error: LoadError | None = None
        self.result: dict[str, Any] | None = None
        units = plan.units()
        self.progress = {
            r: RankProgress(
                units_total=len(units),
                bytes_total=sum(t.ranks[r].bytes for _, ts in units for t in ts),
            )
            for r in range(plan.world_size)
        }
        self._vocab: int | None = None  # read from config.json on the first forward
        self._events: list[Event] = []
        self._subscribers: list[Callable[[Event], None]] = []
        self._replies: dict[int, dict[int, tuple[bool, Any]]] = {}
        self._done: dict[int, dict[str, Any]] = {}
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._started = time.time()
        self._timeout = timeout
        self._deadline = time.monotonic() + timeout if timeout else None
        self.heartbeat_timeout = heartbeat_timeout
        self._heard = [time.monotonic()] * plan.world_size  # when each rank was last heard
        self._running: str | None = None  # the command the ranks are running, if any
        self._ranks = ranks = Ranks()
        self._procs = ranks.procs
        # at collection or interpreter exit: end the ranks, remove the temp dir
        self._finalizer = weakref.finalize(self, ranks.request_close)
        spec = WorkerSpec(
            plan=plan,
            options=options,
            device=device,
            rendezvous=os.path.join(ranks.workdir, "rendezvous"),
            threads=max(1, (os.cpu_count() or 1) // plan.world_size),
            timeout=timeout or 1800.0,
            events_dir=str(events_dir) if events_dir else None,
        )
        ranks.start(plan.world_size, spec, beat=min(1.0, heartbeat_timeout / 4))
        ranks.pump = threading.Thread(
            target=_pump, args=(weakref.ref(self), ranks), name="tpviz-pump", daemon=True
        )
        ranks.pump.start()

    # --- events -----------------------------------------------------------------------------

    @property
    def events(self) -> list[Event]:
        """Every event received so far."""
        with self._cond:
            return list(self._events)

    def subscribe(
        self, callback: Callable[[Event], None], replay: bool = True
    ) -> Callable[[], None]:
        """Call `callback(event)` (from the pump thread) for every event as it arrives; with
        `replay`, first for those already received. Returns a function that unsubscribes."""
        with self._cond:
            self._subscribers.append(callback)
            past = list(self._events) if replay else []
        for event in past:
            callback(event)

        def unsubscribe() -> None:
            with self._cond:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def _deliver(self, events: list[Event]) -> None:
        with self._cond:
            self._events.extend(events)
            subscribers = list(self._subscribers)
        for event in events:
            for callback in subscribers:
                try:
                    callback(event)
                except Exception:  # a broken viewer must not stop the job
                    pass

    def _launcher_event(self, name: str) -> None:
        self._deliver([Phase(LAUNCHER, time.time(), name=name)])

    # --- the pump ---------------------------------------------------------------------------

    def _handle(self, rank: int, message: tuple) -> None:
        kind = message[0]
        if kind == "beat":  # `_heard` is all a heartbeat updates
            return
        if kind == "events":
            batch = message[1]
            for event in batch:
                self._track(event)
            self._deliver(batch)
            for event in batch:
                if isinstance(event, Error):
                    where = f" loading {event.module}" if event.module else ""
                    self._fail(
                        LoadError(
                            f"rank {rank} failed{where}: {event.message}",
                            rank,
                            event.module,
                            event.file,
                            event.traceback,
                        )
                    )
                elif isinstance(event, Done):
                    self._rank_done(rank, event.result)
        elif kind == "reply":
            _, command_id, ok, payload = message
            with self._cond:
                self._replies.setdefault(command_id, {})[rank] = (ok, payload)
                self._cond.notify_all()

    def _track(self, event: Event) -> None:
        progress = self.progress.get(event.rank)
        if progress is None:
            return
        if isinstance(event, Phase):
            progress.phase = event.name
            progress.phase_times[event.name] = event.t
        elif isinstance(event, UnitStart):
            progress.module = event.module
        elif isinstance(event, UnitDone):
            progress.units_done = event.index + 1
            progress.bytes_done += event.bytes

    def _rank_done(self, rank: int, entry: dict[str, Any]) -> None:
        self._done[rank] = entry
        if len(self._done) < self.plan.world_size:
            return
        ranks = [self._done[r] for r in range(self.plan.world_size)]
        ready = [self.progress[r].phase_times.get("ready", self._started) for r in self.progress]
        result: dict[str, Any] = {
            "strategy": self.options.strategy,
            "world_size": self.plan.world_size,
            "dtype": self.plan.dtype,
            "device": self.device,
            "init": self.options.init,
            "source": self.plan.source,
            "startup_seconds": max(ready) - self._started,
            "load_seconds": max(r["load_seconds"] for r in ranks),
            "plan_matches_shards": all(r["plan_matches_shards"] for r in ranks),
            "ranks": ranks,
            "warnings": [asdict(w) for w in self.plan.warnings],
        }
        if self.options.init == "random":
            result["init_check"] = ranks[0]["init"]
        if self.options.profile_dir:
            result["profile"] = {
                "dir": self.options.profile_dir,
                "ranks": [r.get("profile") for r in ranks],
            }
        errors = collect_output_errors(ranks)
        if errors:
            result["output_errors"] = errors
        self.result = result
        if self.verify_requested:
            threading.Thread(
                target=self._verify_then_ready, name="tpviz-verify", daemon=True
            ).start()
        else:
            self._set_state("loaded")

    def _verify_then_ready(self) -> None:
        try:
            self._set_state("verifying")
            self.verify()
        except Exception as e:
            self.result["verify"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        if self.state == "verifying":
            self._set_state("loaded")

    def _set_state(self, state: str) -> None:
        with self._cond:
            self.state = state
            self._cond.notify_all()
        self._launcher_event(state)

    def _fail(self, error: LoadError, state: str = "failed") -> None:
        with self._cond:
            if self.state in ("failed", "cancelled", "closing", "closed"):
                return
            self.error = error
            self.state = state
            self._cond.notify_all()
        self._finalizer()  # end every rank now: peers of a failed rank may wait in collectives
        self._launcher_event(state)

    def _check_ranks(self) -> None:
        if self.state in ("failed", "cancelled", "closing", "closed"):
            return
        for rank, proc in enumerate(self._procs):
            if proc.exitcode is not None:
                code = proc.exitcode
                how = f"signal {-code}" if code < 0 else f"exit code {code}"
                if code == -9:
                    how += " (SIGKILL)"
                where = self.progress[rank].module
                doing = f" while loading {where}" if where and self.state == "starting" else ""
                if not self.progress[rank].phase_times:
                    doing = (
                        " before it started; a script that calls tpviz.launch must guard "
                        "the call with `if __name__ == '__main__':`"
                    )
                message = f"rank {rank} died ({how}){doing}"
                self._deliver([Error(rank, time.time(), message=message)])
                self._fail(LoadError(message, rank, where))
                return
        if self._deadline and self.state == "starting" and time.monotonic() > self._deadline:
            self._fail(
                LoadError(f"the load did not finish within its timeout ({self._timeout:g} s)")
            )
            return
        self._check_heartbeats()

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        for rank, heard in enumerate(self._heard):
            silence = now - heard
            if silence > self.heartbeat_timeout:
                progress = self.progress[rank]
                if self._running:
                    doing = f"while running {self._running}"
                elif progress.phase == "loaded":
                    doing = "while waiting for commands"
                else:
                    doing = f"during {progress.phase}"
                    if progress.phase == "loading" and progress.module:
                        doing += f" of {progress.module}"
                message = (
                    f"rank {rank} stopped responding (no heartbeat for {silence:.0f} s) {doing}; "
                    "it was ended with the job"
                )
                self._deliver([Error(rank, time.time(), message=message, module=progress.module)])
                self._fail(LoadError(message, rank, progress.module))
                return

    # --- waiting and results ----------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        """The load result once every rank has loaded (and verified, if asked); raises the
        job's error. The ranks stay alive for commands."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self.state not in ("starting", "verifying"), timeout)
        if not ok:
            raise TimeoutError(f"the load is still running after {timeout} s")
        if self.error is not None:
            raise self.error
        if self.result is None:
            raise LoadError(f"the job is {self.state}")
        return self.result

    def cancel(self) -> None:
        """Stop the job: every rank is ended."""
        self._fail(LoadError("the load was cancelled"), state="cancelled")

    # --- commands on the loaded model -------------------------------------------------------

    def _command(self, command: str, *args: Any) -> list[Any]:
        if self.state != "loaded" and not (self.state == "verifying" and command == "forward"):
            raise LoadError(f"the job is {self.state}; commands need a loaded model")
        command_id = next(self._ids)
        world = self.plan.world_size
        self._running = command
        try:
            # a dead rank breaks its pipe; the pump reports it and fails the job
            with contextlib.suppress(OSError):
                self._ranks.send_all((command, command_id, args))
            # no wall-clock limit: user code may take long; a silent rank fails the job
            with self._cond:
                self._cond.wait_for(
                    lambda: (
                        len(self._replies.get(command_id, {})) == world
                        or self.state in ("failed", "cancelled", "closing", "closed")
                    )
                )
                replies = self._replies.pop(command_id, {})
        finally:
            self._running = None
        if self.error is not None:
            raise self.error
        if len(replies) < world:
            raise LoadError(f"the job is {self.state}; {command} was not finished")
        errors = [payload for ok, payload in replies.values() if not ok]
        if errors:
            raise LoadError(errors[0])
        return [replies[r][1] for r in range(world)]

    def forward(self, input_ids: torch.Tensor | list) -> torch.Tensor:
        """Run the sharded model on `input_ids`; the logits, gathered, on this side. Ids are
        checked here first (ValueError): no rank would notice one outside the vocabulary."""
        ids = check_token_ids(input_ids, self._vocab_size())
        return self._command("forward", ids)[0]

    def _vocab_size(self) -> int:
        if self._vocab is None:
            config = read_config(self.plan.source)
            vocab = config.get("vocab_size")  # what every model family tpviz runs writes
            if not isinstance(vocab, int):  # nested (text_config): the adapter knows where
                vocab = get_adapter(config, self.plan.model, self.plan.source).vocab_size(config)
            self._vocab = vocab
        return self._vocab

    def shard_report(self) -> list[list[dict[str, Any]]]:
        """Each rank's real local tensors (shape, dtype, device, placement) beside the plan."""
        return self._command("shard_report")

    def call(self, fn: Callable | str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run `fn(model, *args, **kwargs)` on every rank; `fn` is importable (or `"pkg.mod:fn"`).
        Returns the results, one per rank."""
        return self._command("call", fn, args, kwargs)

    def verify(self) -> dict[str, Any]:
        """Logits of the fixed prompt from the sharded model against a single-process model
        built from the same checkpoint (or the same seed); stored in `result["verify"]`."""
        from .checkpoint import Checkpoint
        from .runtime.reference import FullModel

        config = read_config(self.plan.source)
        adapter = get_adapter(config, self.plan.model, self.plan.source)
        ids = prompt_ids(adapter, config)
        sharded = self.forward(ids)
        reference = FullModel(self.plan, adapter, config, self.options.seed)
        if self.options.init == "random":
            reference.materialize(None, None, reference.loaded)
            reference.init_all()
        else:
            reference.load_checkpoint(Checkpoint.open(self.plan.source))
        with torch.no_grad():
            expected = adapter.logits(reference.model, ids)
        del reference
        diff = (sharded.float() - expected.float()).abs().max().item()
        tolerance = 1e-4 if self.plan.dtype == "float32" else 5e-2
        report = {
            "max_abs_diff": diff,
            "tolerance": tolerance,
            "ok": diff <= tolerance,
            "prompt": ids.tolist(),
        }
        if self.options.init == "random" and self.options.strategy == "sliced":
            report["note"] = "sliced random init cannot match a single-process draw"
            report["ok"] = None
        self.result["verify"] = report
        return report

    # --- lifetime ---------------------------------------------------------------------------

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the ranks and release everything; safe to call more than once."""
        with self._cond:
            if self.state == "closed":
                return
            alive = self.state in ("loaded", "verifying")
            self.state = "closing" if alive else self.state
        if alive:
            with contextlib.suppress(OSError):
                self._ranks.send_all(("shutdown", -1, ()))
        self._ranks.request_close(grace=timeout if alive else 0.0)
        self._finalizer.detach()
        self._set_state("closed")

    def __enter__(self) -> LoadJob:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"<LoadJob {self.options.strategy} world_size={self.plan.world_size} {self.state}>"


def _pump(ref: weakref.ref[LoadJob], ranks: Ranks) -> None:
    """Multiplex the ranks' pipes and sentinels until asked to stop, then close them all (the
    pump is their one owner). Holds the job only weakly so that an abandoned job is collected
    (and its ranks ended)."""
    try:
        while not ranks.stop.is_set():
            job = ref()
            if job is None:
                return
            _pump_once(job, ranks)
            del job
    except Exception as e:  # a bug here must not leave callers waiting for replies forever
        job = ref()
        if job is not None:
            job._fail(LoadError(f"tpviz's event pump failed: {type(e).__name__}: {e}"))
        raise
    finally:
        ranks.close()


def _pump_once(job: LoadJob, ranks: Ranks) -> None:
    conns = ranks.conns
    ready = wait(conns + [p.sentinel for p in ranks.procs], timeout=0.1)
    for item in ready:
        if item in conns:
            rank = conns.index(item)
            job._heard[rank] = time.monotonic()  # a readable pipe is a live (or ended) rank
            try:
                message = pickle.loads(item.recv_bytes())  # plain pickles: runtime/heartbeat
            except (EOFError, OSError):
                continue  # the rank ended; its sentinel says how
            job._handle(rank, message)
    job._check_ranks()


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


def _check_seconds(name: str, value: float | None) -> None:
    """A duration argument: None, or a positive finite number (not a bool; NaN fails too)."""
    if value is not None and (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value < float("inf")
    ):
        raise ValueError(f"{name} must be a positive, finite number of seconds, not {value!r}")


def _end_rank_running_an_unguarded_script() -> None:
    """A script without the `__main__` guard runs again in each spawned rank while it starts,
    and calls launch there: multiprocessing would refuse with a long traceback from every rank.
    End that rank quietly instead; the parent's job says what to do (guard the call)."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise SystemExit(1)


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
) -> LoadJob:
    """Start loading `source` on `world_size` local ranks; returns a LoadJob at once.

    `plan` is a pattern dict, a plan file or a ResolvedPlan (whose world size must match).
    `init="random"` initialises from `seed` instead of loading (a config-only source needs it).
    `profile_dir` writes torch.profiler traces (one TensorBoard worker per rank);
    `profile_forward` also profiles one forward of the fixed prompt after loading.
    `timeout` bounds the load in wall time; `heartbeat_timeout` (seconds) is how long a rank
    may stay silent (frozen, stopped, deadlocked) before the job fails, at any time from start
    to shutdown: long-running `forward` or `call` commands are bounded only by it.
    """
    _end_rank_running_an_unguarded_script()
    _check_seconds("timeout", timeout)
    _check_seconds("heartbeat_timeout", heartbeat_timeout)
    resolved = resolve_plan(source, world_size, plan, dtype=dtype, model=model)
    resolved.raise_for_errors()
    if resolved.source is None:
        raise ValueError(
            "a plan resolved from an in-memory module cannot be launched; pass a "
            "checkpoint directory"
        )
    if device == "cuda":
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if world_size > available:
            raise ValueError(
                f"device='cuda' runs one rank per GPU: {world_size} ranks asked, "
                f"{available} GPU(s) visible"
            )
    elif device != "cpu":
        raise ValueError(f"device must be 'cpu' or 'cuda', not {device!r}")
    if events_dir:
        events_dir = check_output_dir(events_dir, "events dir", resolved.source)
    if profile_dir:
        profile_dir = check_output_dir(profile_dir, "profile dir", resolved.source)
    options = LoadOptions(strategy, init, seed, memory_hz, profile_dir, profile_forward)
    options.validate(resolved)
    if not force:
        check_memory(resolved, strategy, device, options.init)
    return LoadJob(
        resolved,
        options,
        device=device,
        timeout=timeout,
        verify=verify,
        events_dir=events_dir,
        heartbeat_timeout=heartbeat_timeout,
    )


def add_ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add `ratio_to_sliced` to each result (and each rank) of a comparison."""
    base = next((r for r in results if r["strategy"] == "sliced"), None)
    if base is None:
        return results

    def ratio(a: float, b: float) -> float | None:
        return a / b if b else None

    base_rss = max(r["peak_rss_bytes"] for r in base["ranks"])
    for res in results:
        res["ratio_to_sliced"] = {
            "load_seconds": ratio(res["load_seconds"], base["load_seconds"]),
            "peak_rss_bytes": ratio(max(r["peak_rss_bytes"] for r in res["ranks"]), base_rss),
        }
        for rank, b in zip(res["ranks"], base["ranks"]):
            rank["ratio_to_sliced"] = {
                "seconds": ratio(rank["seconds"], b["seconds"]),
                "peak_rss_bytes": ratio(rank["peak_rss_bytes"], b["peak_rss_bytes"]),
                "peak_tensor_bytes": ratio(rank["peak_tensor_bytes"], b["peak_tensor_bytes"]),
            }
    return results


def compare(
    source: str | os.PathLike,
    world_size: int,
    plan: dict | str | os.PathLike | ResolvedPlan | None = None,
    strategies: tuple[str, ...] = ("sliced", "rank0_broadcast", "replicated"),
    follow: Callable[[LoadJob], dict[str, Any]] | None = None,
    **launch_kwargs: Any,
) -> list[dict[str, Any]]:
    """Load with each strategy in turn (one job at a time) and return the results, each with
    `ratio_to_sliced`. `follow(job)` waits for a job (e.g. drawing progress); default `wait`."""
    resolved = resolve_plan(
        source,
        world_size,
        plan,
        dtype=launch_kwargs.pop("dtype", None),
        model=launch_kwargs.pop("model", None),
    )
    results = []
    for strategy in strategies:
        with launch(source, world_size, resolved, strategy=strategy, **launch_kwargs) as job:
            results.append(follow(job) if follow else job.wait())
    return add_ratios(results)
