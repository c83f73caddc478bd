"""LoadJob: one load on local ranks, from spawn to shutdown.

It ties together the parts that each do one thing: the ranks' processes and the pump that reads
them (processes.py), the event log viewers subscribe to (eventlog.py), per-rank progress
(tracking.py), commands on the loaded model (commands.py), the typed result (results.py) and
verification (runtime/verify.py). What is left here is the job's state machine: starting ->
[verifying] -> loaded, or failed / cancelled; then closing -> closed.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .commands import CommandChannel, check_callable, first_failed
from .errors import CommandFailed, LoadError
from .eventlog import EventLog
from .events import LAUNCHER_RANK, Done, Error, Event, JobState, Phase, end_rank_files
from .liveness import (
    Silence,
    broken_group_message,
    check_seconds,
    death_message,
    server_lost_message,
    silence_message,
    timeout_message,
    unfinished,
    unforked_message,
)
from .messages import VERIFY_COMMANDS, Beat, CommandName, EventBatch, Reply
from .models import vocab_size
from .plan import ResolvedPlan
from .processes import Ranks
from .rankserver import load_imports, rank_imports, server_lost, stop_server
from .results import LoadResult
from .runtime.options import LoadOptions, WorkerSpec
from .token_ids import check_token_ids
from .tracking import ProgressTracker, RankProgress

HEARTBEAT_TIMEOUT = 30.0  # seconds of silence after which a rank counts as frozen


class LoadJob:
    """A running (or finished) load. Use it as a context manager, or call `shutdown()`.

    `reload(...)` loads again on the same ranks (warm: no new processes) and returns the next
    job; this one hands its ranks over and closes."""

    def __init__(
        self,
        plan: ResolvedPlan,
        options: LoadOptions,
        device: str = "cpu",
        timeout: float | None = None,
        verify: bool = False,
        events_dir: str | os.PathLike | None = None,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
        *,
        warm: Ranks | None = None,
        relaunch: Callable[..., LoadJob] | None = None,
    ):
        """`warm`: the ranks of a loaded job to load on (from `_hand_over`) instead of new
        ones; `relaunch(job, **changes)` starts the next load on this job's ranks."""
        self.plan = plan
        self.options = options
        self.device = device
        self.verify_requested = verify
        self.heartbeat_timeout = heartbeat_timeout
        self.state = JobState.STARTING
        self.error: LoadError | None = None
        self.result: LoadResult | None = None
        self.tracker = ProgressTracker(plan)
        self._log = EventLog()
        self._cond = threading.Condition()
        self.started = time.time()  # the launch (or reload) request: startup counts from it
        self._timeout = timeout
        self._launched = time.monotonic()
        self._deadline = self._launched + timeout if timeout else None
        self._silence = Silence(plan.world_size)
        self._vocab: int | None = None  # read from config.json on the first forward
        self._relaunch = relaunch
        self._warm = warm is not None
        self._ranks = ranks = warm or Ranks()
        self._procs = ranks.procs
        self._commands = CommandChannel(ranks, plan.world_size, self._cond)
        self._finalizer = weakref.finalize(self, ranks.request_close)  # at collection or exit
        self._events_dir = events_dir
        spec = self._spec(events_dir)
        if warm is None:
            preload = rank_imports(plan.source, plan.model)
            ranks.start(plan.world_size, spec, min(1.0, heartbeat_timeout / 4), self, preload)
        else:
            ranks.listen(self)
            self._commands.reload(spec)

    def _spec(self, events_dir: str | os.PathLike | None) -> WorkerSpec:
        world = self.plan.world_size
        return WorkerSpec(
            plan=self.plan,
            options=self.options,
            device=self.device,
            rendezvous=os.path.join(self._ranks.workdir, "rendezvous"),
            threads=max(1, (os.cpu_count() or 1) // world),
            timeout=self._timeout or 1800.0,
            events_dir=str(events_dir) if events_dir else None,
        )

    # --- events and progress ----------------------------------------------------------------

    @property
    def events(self) -> list[Event]:
        """Every event received so far."""
        return self._log.snapshot()

    def subscribe(
        self, callback: Callable[[Event], None], replay: bool = True
    ) -> Callable[[], None]:
        """Call `callback(event)` (from the pump thread) for every event as it arrives; with
        `replay`, first for those already received. Returns a function that unsubscribes."""
        return self._log.subscribe(callback, replay)

    @property
    def progress(self) -> dict[int, RankProgress]:
        """Each rank's progress, updated as its events arrive."""
        return self.tracker.ranks

    # --- what the pump hands in (processes.Listener) ----------------------------------------

    def _heard(self, rank: int) -> None:
        self._silence.heard(rank, time.monotonic())
        self.tracker.heard(rank, time.time())

    def _handle(self, rank: int, message: Any) -> None:
        if isinstance(message, EventBatch):
            self._receive(message.events)
        elif isinstance(message, Reply):
            self._commands.on_reply(rank, message)
        elif isinstance(message, Beat):  # the first says since when the rank is up
            self.tracker.beat(rank, message)

    def _receive(self, events: list[Event]) -> None:
        for event in events:
            self.tracker.track(event)
        self._log.append(events)
        for event in events:
            if isinstance(event, Error):
                self._fail(LoadError.from_event(event))
            elif isinstance(event, Done):
                self._rank_done()

    def _check(self, exited: dict[int, int]) -> None:
        """The ranks' health, on every pump tick: dead (`exited`: rank -> exit code, of ranks
        whose messages have all been handled), over time, silent or never forked."""
        if self.state.ended:
            return
        if exited:
            rank = min(exited)
            if server_lost(self._procs[rank].pid, exited[rank]):
                stop_server()  # what is left of it: the next launch starts a new one
                return self._fail(LoadError(server_lost_message()))
            loading, running = self.state is JobState.STARTING, self._commands.running
            progress = self.progress[rank]
            message = death_message(rank, exited[rank], progress, loading, self._warm, running)
            return self._rank_failed(rank, message)
        now = time.monotonic()
        if self._deadline and self.state is JobState.STARTING and now > self._deadline:
            return self._fail(LoadError(timeout_message(self._timeout, self.progress)))
        forked = len(self._procs)
        # a fork takes milliseconds once the server has imported torch (seconds; tens loaded)
        if forked < self.plan.world_size and now - self._launched > 2 * self.heartbeat_timeout:
            late = unforked_message(forked, now - self._launched, self.heartbeat_timeout)
            return self._rank_failed(forked, late)
        rank, silent = self._silence.longest(forked, now)
        if silent > self.heartbeat_timeout:
            running = self._commands.running
            message = silence_message(rank, silent, self.progress[rank], running)
            return self._rank_failed(rank, message)

    def _rank_failed(self, rank: int, message: str) -> None:
        """End the job for what `rank` did (or did not do), in its log and its error."""
        module = self.progress[rank].module
        self._log.append([Error(rank, time.time(), message=message, module=module)])
        self._fail(LoadError(message, rank, module))

    def _ranks_ended(self) -> None:
        """Every rank is gone: each rank file it left unended in the events dir says why."""
        if self._events_dir and self.result is None:
            why = str(self.error or "the job was shut down before every rank had loaded")
            modules = [self.progress[r].module for r in range(self.plan.world_size)]
            cause = self.error.rank if self.error is not None else None
            end_rank_files(self._events_dir, modules, why, time.time(), cause)

    def _pump_failed(self, error: Exception) -> None:
        self._fail(LoadError(f"tpviz's launcher failed: {type(error).__name__}: {error}"))

    # --- states -----------------------------------------------------------------------------

    def _rank_done(self) -> None:
        ranks = self.tracker.results()
        if ranks is None:
            return
        self.result = LoadResult.collect(
            self.plan,
            ranks,
            strategy=self.options.strategy,
            device=self.device,
            init=self.options.init,
            profile_dir=self.options.profile_dir,
            started=self.started,
            startup_marks=[p.startup_marks() for p in self.progress.values()],
        )
        self._check_released()
        if self.verify_requested:  # not a daemon: an exit amid its torch work aborts the process
            verify = self._verify_then_ready  # (the pump, which runs this, is one)
            threading.Thread(target=verify, name="tpviz-verify", daemon=False).start()
        else:
            self._set_state(JobState.LOADED)

    def _check_released(self) -> None:
        """On warm ranks, the result says if a rank did not give back the previous model."""
        reference = self._ranks.reference_baselines
        imports = load_imports(self.plan.source, self.plan.model)
        if self._ranks.first_to_import(imports) or reference is None:
            self._ranks.reference_baselines = [r.rss_baseline_bytes for r in self.result.ranks]
        else:
            self.result.warn_if_not_released(reference)

    def _verify_then_ready(self) -> None:
        try:
            self._set_state(JobState.VERIFYING)
            self.verify()
        except Exception as e:
            self.result.verify = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        if self.state is JobState.VERIFYING:
            self._set_state(JobState.LOADED)

    def _set_state(self, state: JobState) -> None:
        with self._cond:
            self.state = state
            self._cond.notify_all()
        self._log.append([Phase(LAUNCHER_RANK, time.time(), name=state)])

    def _fail(self, error: LoadError, state: JobState = JobState.FAILED) -> None:
        with self._cond:
            if self.state.ended:
                return
            self.error = error
            self.state = state
            self._cond.notify_all()
        self._finalizer()  # end every rank now: peers of a failed rank may wait in collectives
        self._log.append([Phase(LAUNCHER_RANK, time.time(), name=state)])

    # --- waiting and results ----------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> LoadResult:
        """The load result once every rank has loaded (and verified, if asked); raises the
        job's error. The ranks stay alive for commands."""
        check_seconds("timeout", timeout, zero=True)
        with self._cond:
            ok = self._cond.wait_for(lambda: self.state.finished, timeout)
        if not ok:
            raise TimeoutError(f"the load is still running after {timeout} s")
        if self.error is not None:
            raise self.error
        if self.result is None:
            raise LoadError(f"the job is {self.state}")
        return self.result

    def cancel(self) -> None:
        """End every rank now: a running load fails as cancelled; a done one keeps its result."""
        if self.state is JobState.LOADED:
            return self.shutdown(timeout=0.0)
        self._fail(LoadError("the load was cancelled"), state=JobState.CANCELLED)

    # --- commands on the loaded model -------------------------------------------------------

    def _command(self, name: CommandName, *args: Any) -> list[Any]:
        replies = self._replies(name, args)
        failed = first_failed(replies)
        if failed is not None:  # the traceback stays on the error, off its message
            reply = replies[failed]
            error = CommandFailed(reply.payload, failed, traceback=reply.traceback)
            self._end_if_group_broken(error)
            raise error
        return [replies[r].payload for r in range(self.plan.world_size)]

    def _admit(self, name: CommandName) -> None:
        """Raise unless the ranks can run command `name` now (called under `_cond`)."""
        verifying = self.state is JobState.VERIFYING and name in VERIFY_COMMANDS
        if self.state is not JobState.LOADED and not verifying:
            why = f" ({self.error})" if self.error is not None else ""
            raise LoadError(f"the job is {self.state}{why}; commands need a loaded model")

    def _replies(self, name: CommandName, args: tuple[Any, ...]) -> dict[int, Reply]:
        """Every rank's reply to a command, or the job's error (a rank died, or straggled)."""
        replies = self._commands.run(
            name, args, lambda: self._admit(name), lambda: self.state.ended, self.heartbeat_timeout
        )
        world = self.plan.world_size
        blame = unfinished(replies, world, name, self.heartbeat_timeout)
        if blame is not None and not self.state.ended:
            self._rank_failed(*blame)
        if self.error is not None:
            raise self.error
        if len(replies) < world:
            raise LoadError(f"the job is {self.state}; {name} was not finished")
        return replies

    def _end_if_group_broken(self, error: LoadError) -> None:
        """After a failed command, a barrier: a collective that timed out in it leaves the
        process group broken (gloo closes its connections), and every later command or reload
        would fail on that; the job ends instead, saying so."""
        replies = self._replies(CommandName.CHECK_GROUP, ())
        broken = first_failed(replies)
        if broken is not None:
            self._rank_failed(error.rank, broken_group_message(error, replies[broken].payload))
            raise self.error from error

    def forward(self, input_ids: torch.Tensor | list) -> torch.Tensor:
        """Run the sharded model on `input_ids`; the logits, gathered, on this side. Ids are
        checked here first (ValueError): no rank would notice one outside the vocabulary."""
        self._vocab = self._vocab or vocab_size(self.plan.source, self.plan.model)
        ids = check_token_ids(input_ids, self._vocab)
        return self._command(CommandName.FORWARD, ids)[0]

    def shard_report(self) -> list[list[dict[str, Any]]]:
        """Each rank's real local tensors (shape, dtype, device, placement) beside the plan."""
        return self._command(CommandName.SHARD_REPORT)

    def call(self, fn: Callable | str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run `fn(model, *args, **kwargs)` on every rank; `fn` is importable (or `"pkg.mod:fn"`).
        Returns the results, one per rank."""
        check_callable(fn)
        return self._command(CommandName.CALL, fn, args, kwargs)

    def verify(self) -> dict[str, Any]:
        """Logits of the fixed prompt from the sharded model against a single-process model
        built from the same checkpoint (or the same seed); stored in `result["verify"]`."""
        from .runtime.verify import fixed_prompt, verify_forward  # the ranks' imports: on use

        ids = fixed_prompt(self.plan)
        self.result.verify = verify_forward(self.plan, self.options, ids, self.forward)
        return self.result.verify

    # --- lifetime ---------------------------------------------------------------------------

    def reload(self, **changes: Any) -> LoadJob:
        """Load again on this job's ranks, without new processes: `changes` are `launch()`'s
        arguments to change (source, plan, strategy, dtype, init, seed, verify, timeout,
        events_dir, ...); the world size and device stay. Each rank frees the previous model
        first. Returns the new job at once; this one closes (its result stays)."""
        if self._relaunch is None:
            raise LoadError("this job cannot reload: start it with tpviz.launch")
        return self._relaunch(self, **changes)

    def _hand_over(self) -> Ranks:
        """Give the loaded ranks to the next job (`reload`); this job closes without ending
        them."""
        with self._cond:
            if self.error is not None:  # its ranks are gone: say why
                raise LoadError(f"a failed job cannot reload (launch a new one): {self.error}")
            if self.state is not JobState.LOADED:
                raise LoadError(f"the job is {self.state}; a reload needs a loaded job")
            if self._commands.in_flight:  # its replies would come from the next model
                raise LoadError(f"a {self._commands.running} is running: reload once it returns")
            self.state = JobState.CLOSED
            self._cond.notify_all()
        self._finalizer.detach()
        self._log.append([Phase(LAUNCHER_RANK, time.time(), name=JobState.CLOSED)])
        return self._ranks

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the ranks (each may take `timeout` s to exit) and release all; idempotent."""
        check_seconds("timeout", timeout, optional=False, zero=True)
        with self._cond:
            if self.state is JobState.CLOSED:
                return
            alive = self.state in (JobState.LOADED, JobState.VERIFYING)
            if alive:
                self.state = JobState.CLOSING
        if alive:
            self._commands.shutdown()
        self._ranks.request_close(grace=timeout if alive else 0.0)
        self._finalizer.detach()
        self._set_state(JobState.CLOSED)

    def __enter__(self) -> LoadJob:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"<LoadJob {self.options.strategy} world_size={self.plan.world_size} {self.state}>"
