"""The ranks' processes, pipes and private temp dir, with one owner for closing them.

One pump thread per job multiplexes the ranks' pipes and process sentinels and hands what it
reads to the job, so a rank that fails or dies ends the whole job within a fraction of a second.
It is also the one that closes pipes and processes (`close`); other threads ask it to
(`request_close`) and wait for it. Closing a pipe from another thread while the pump is inside
`recv()` breaks the pump.

The temp dir (`$TMPDIR/tpviz-<pid>-*`: the rendezvous file, and the ranks' own $TMPDIR) is locked
with `flock` for as long as its launcher lives, so a later launcher can prove a dir stale (its
lock is free: the owner was killed with SIGKILL) and remove it.

Ranks start from multiprocessing's forkserver with torch and tpviz's rank code preloaded
(`start_server`): each rank is a fork of a process that has imported them and done nothing
else, so it pays no import. This is as safe as `spawn` for what fork usually breaks: the
server is a fresh interpreter (started by exec, not forked from this process, so none of its
threads, locks, OpenMP pools or CUDA context), preloading only imports modules (no torch op
runs there, so no intra-op or OpenMP thread pool exists to be forked, and CUDA is never
initialised), and its only thread is the one that forks. Each rank still imports the caller's
`__main__` as spawn does (hence the `__main__` guard), gets the caller's current environment
(with `RANK_ENVIRON`'s defaults, which the server also starts with), and watches its pipe to
this process rather than its parent (the server), see heartbeat.py.
The server's socket lives in multiprocessing's temp dir (`$TMPDIR/pymp-*`), which tpviz locks
like its own: removed at interpreter exit, or as stale by the next launcher if this process
was killed.

Forking a rank waits on the server (multiprocessing gives that wait no deadline), so ranks are
started by a thread of their own while the pump keeps checking the job: a server that is
stopped or stuck cannot keep a timeout, a cancel or a signal from ending the job. Ending a
job whose ranks are still being started ends the server too (`stop_server`); the next launch
starts a fresh one.
"""

from __future__ import annotations

import contextlib
import fcntl
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from multiprocessing import forkserver
from multiprocessing import util as mp_util
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Protocol

from .choices import model_family
from .inputs import read_json
from .runtime.heartbeat import boot

TERMINATE_GRACE_SECONDS = 3.0
PREFIX = "tpviz-"
LOCK = "owner.lock"
MP_PREFIX = "pymp-"  # multiprocessing's temp dir: ours to remove when it holds our lock
# what the forkserver imports before it forks ranks: torch, torch.distributed and the rank code.
# Not torch._dynamo: about a second more on every cold start's critical path, and a load never
# imports it (parallelize builds DTensors directly); a rank's first forward does.
PRELOAD = ["tpviz.runtime.worker"]
# Defaults for the server's and the ranks' environment, where the caller has not set them.
# THP_MEM_ALLOC_ENABLE=1 makes torch's CPU allocator (which reads it once) mark allocations of
# 2 MiB and more MADV_HUGEPAGE, so a shard's fresh memory faults in 2 MiB at a time rather
# than 4 KiB: loads 1.3-4x faster on the machines tpviz is built on (README, "Huge pages").
# A caller's own value wins (0 turns it off).
RANK_ENVIRON = {"THP_MEM_ALLOC_ENABLE": "1"}
_server_lock = threading.Lock()
_server_started = False
_temp_dir_lock: int | None = None  # the fd whose flock marks multiprocessing's temp dir ours
_temp_dir_guard = threading.Lock()


def remove_stale_workdirs() -> None:
    """Remove tpviz temp dirs whose owner is gone: only those whose lock can be taken."""
    root = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(root) if n.startswith((PREFIX, MP_PREFIX))]
    except OSError:
        return
    for name in names:
        path = os.path.join(root, name)
        try:
            fd = os.open(os.path.join(path, LOCK), os.O_RDONLY)
        except OSError:  # not ours, or not (yet) locked: not provably stale
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass  # its launcher is alive
        finally:
            os.close(fd)


def rank_imports(source: str | os.PathLike | None, model: str | None) -> list[str]:
    """What a rank of the model at `source` imports to build its skeleton, for the server to
    preload: transformers, and the model type's modeling module (a name that does not exist
    is skipped there), for a transformers model; nothing for tpviz's own Llama, and not a user
    factory's module (its import could start threads or CUDA). Read from config.json without
    importing torch; [] when it cannot tell (the load reports what is wrong with the source)."""
    if source is None:
        return []
    path = Path(source)
    try:
        config = read_json((path if path.is_dir() else path.parent) / "config.json", "config")
    except (OSError, ValueError):
        return []
    family = model_family(config, model) if isinstance(config, dict) else None
    if family not in ("hf", "hf-remote-code"):
        return []
    model_type = str(config.get("model_type") or "").replace("-", "_")
    if family == "hf-remote-code" or not model_type.isidentifier():
        return ["transformers"]  # remote code's own modules come from the checkpoint
    return ["transformers", f"transformers.models.{model_type}.modeling_{model_type}"]


def start_server(preload: Sequence[str] = ()) -> mp.context.BaseContext:
    """Start the forkserver ranks are forked from (once per process, or again after
    `stop_server`; at once, so that its imports overlap the caller's own work), preloading
    `preload` too (see `rank_imports`), and return its context."""
    global _server_started
    ctx = mp.get_context("forkserver")
    with _server_lock:
        if _server_started:
            return ctx
        ctx.set_forkserver_preload([*PRELOAD, *preload])
        # the server's socket (a path of at most ~107 bytes, so nothing is nested deeper) and
        # its own temp files (torch's inductor cache dir) go in this process's temp dir
        path = private_temp_dir()
        with _environ({**_missing_defaults(), "TMPDIR": path}):
            forkserver.ensure_running()  # the server takes this process's environment now
        _server_started = True
    return ctx


def private_temp_dir() -> str:
    """This process's temp dir: multiprocessing's, which it removes at exit, locked like a
    workdir so that the next launcher removes it if this process was killed."""
    global _temp_dir_lock
    path = mp_util.get_temp_dir()
    with _temp_dir_guard:
        if _temp_dir_lock is None:  # locked once: a second flock of ours would wait on the first
            _temp_dir_lock = os.open(os.path.join(path, LOCK), os.O_CREAT | os.O_RDWR, 0o600)
            fcntl.flock(_temp_dir_lock, fcntl.LOCK_EX)  # held for as long as this process lives
    return path


def stop_server() -> None:
    """End the forkserver now, even a stopped or stuck one (SIGKILL), so that a rank start
    waiting on it returns; the next `start_server` starts a fresh one. The server's pid and
    `_stop` (which reaps it and removes its socket) are multiprocessing's own, unexported."""
    global _server_started
    with _server_lock:
        server = forkserver._forkserver
        pid = server._forkserver_pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            server._stop()
        _server_started = False


def _missing_defaults() -> dict[str, str]:
    """`RANK_ENVIRON`'s defaults that this process's environment has no value for."""
    return {name: value for name, value in RANK_ENVIRON.items() if name not in os.environ}


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """This process's environment with `values` set, restored afterwards (what
    `unittest.mock.patch.dict` does, whose import costs the CLI's start about 60 ms)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


class Listener(Protocol):
    """What the pump tells its job (held weakly, so that an abandoned job is collected and its
    ranks ended): a rank was heard, what it sent, a tick to check the ranks' health (with the
    exit codes of the ranks that had exited before what they sent was read), and the pump's
    own failure (a bug there must not leave callers waiting for replies forever)."""

    def _heard(self, rank: int) -> None: ...
    def _handle(self, rank: int, message: Any) -> None: ...
    def _check(self, exited: dict[int, int]) -> None: ...
    def _pump_failed(self, error: Exception) -> None: ...


class Ranks:
    """Processes, pipes and the temp dir of one job; `close` is idempotent."""

    def __init__(self) -> None:
        remove_stale_workdirs()
        self.workdir = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")  # private (0700)
        self._lock_fd = os.open(os.path.join(self.workdir, LOCK), os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        self.procs: list = []
        self.conns: list[Connection] = []
        self.stop = threading.Event()
        self.pump: threading.Thread | None = None
        self.starter: threading.Thread | None = None  # forks the ranks, one after another
        self.start_error: Exception | None = None  # why the starter could not fork a rank
        # ranks forked and not yet in procs/conns, which only the pump changes: one pump tick
        # sees a rank's pipe and its exit together, so a message is read before a death
        self._forked: list[tuple[Any, Connection]] = []
        self.listener: weakref.ref[Listener] | None = None  # the job the ranks now serve
        # each rank's RSS before the load whose release later loads are checked against: the
        # first, or the first since the ranks last ran a forward or a call
        self.reference_baselines: list[int] | None = None
        self.grace = 0.0  # seconds the ranks get to exit by themselves once asked to stop
        self._send_lock = threading.Lock()
        self._closed = False

    def start(
        self, world: int, spec: Any, beat: float, listener: Listener, preload: Sequence[str] = ()
    ) -> None:
        """Start `world` ranks running `spec` (a WorkerSpec), each with its own pipe, and the
        pump that serves `listener`. A thread of its own starts the processes, so this returns
        at once even while the forkserver is still importing (a rank is forked only after
        that), and the pump checks the job meanwhile."""
        ctx = start_server(preload)
        payload = pickle.dumps(spec)
        environ = {**os.environ, **_missing_defaults()}  # now, not when the server started

        def start_rank(rank: int) -> None:
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=boot,
                args=(rank, payload, child_end, environ, beat, self.workdir),
                name=f"tpviz-rank{rank}",
                daemon=True,
            )
            try:
                proc.start()
            except BaseException:
                parent_end.close()
                raise
            finally:
                child_end.close()
            with self._send_lock:
                self._forked.append((proc, parent_end))

        self.listen(listener)
        self.starter = threading.Thread(
            target=_start_ranks, args=(self, world, start_rank), name="tpviz-start", daemon=True
        )
        self.pump = threading.Thread(target=_pump, args=(self,), name="tpviz-pump", daemon=True)
        self.starter.start()
        self.pump.start()

    def listen(self, listener: Listener) -> None:
        """Hand what the pump reads to `listener` from now on (warm ranks' next job)."""
        self.listener = weakref.ref(listener)

    def send_all(self, message: Any) -> bool:
        """Send to every rank; False once closed. OSError if a rank's pipe broke."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)  # see runtime/heartbeat
        with self._send_lock:
            if self._closed:
                return False
            for conn in self.conns:
                conn.send_bytes(data)
            return True

    def request_close(self, grace: float = 0.0, timeout: float = 30.0) -> None:
        """Ask the pump to end everything, and wait for it (unless called from the pump)."""
        self.grace = grace
        self.stop.set()
        pump = self.pump
        if pump is None or not pump.is_alive():
            self.close()
        elif pump is not threading.current_thread():
            pump.join(grace + TERMINATE_GRACE_SECONDS + timeout)

    def adopt_forked(self) -> None:
        """Serve the ranks forked since the last call (on the pump's thread, or once it ended)."""
        with self._send_lock:
            for proc, conn in self._forked:
                self.procs.append(proc)
                self.conns.append(conn)
            self._forked.clear()

    def _end_starter(self) -> None:
        """Let the starter finish. One still waiting on the server after
        TERMINATE_GRACE_SECONDS (a fork takes milliseconds) waits on a stopped or stuck server,
        which is ended so that the wait returns."""
        starter = self.starter
        if starter is None or starter is threading.current_thread():
            return
        starter.join(TERMINATE_GRACE_SECONDS)
        if starter.is_alive():
            stop_server()
            starter.join()
        self.adopt_forked()  # so that they are ended with the rest

    def close(self) -> None:
        """End every rank (a grace, then TERM, then KILL), then release pipes and temp dir."""
        self._end_starter()
        deadline = time.monotonic() + self.grace
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + TERMINATE_GRACE_SECONDS
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()  # also ends a stopped (SIGSTOP) rank, which TERM cannot
                p.join()
        for p in self.procs:
            p.close()
        self.procs.clear()
        with self._send_lock:
            self._closed = True
            for c in self.conns:
                c.close()
            self.conns.clear()
        if self._lock_fd is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            os.close(self._lock_fd)
            self._lock_fd = None


def _start_ranks(ranks: Ranks, world: int, start_rank: Callable[[int], None]) -> None:
    """Fork the ranks one after another, until all run or the job is ending; a failure is
    left in `ranks.start_error` for the pump to report."""
    for rank in range(world):
        if ranks.stop.is_set():  # cancelled meanwhile
            return
        try:
            start_rank(rank)
        except Exception as e:
            ranks.start_error = RuntimeError(
                f"rank {rank} could not be started by tpviz's rank server (the forkserver): "
                f"{type(e).__name__}: {e}"
            )
            return


def _pump(ranks: Ranks) -> None:
    """Multiplex the ranks' pipes and sentinels until asked to stop, then close them all (the
    pump is their one owner)."""
    try:
        while not ranks.stop.is_set() and _pump_once(ranks):
            if ranks.start_error is not None and not ranks.stop.is_set():
                raise ranks.start_error
    except Exception as e:
        listener = ranks.listener()
        if listener is not None:
            listener._pump_failed(e)
        raise
    finally:
        ranks.close()


def _pump_once(ranks: Ranks) -> bool:
    """Hand what is ready to the listener; False once the listener is gone (collected)."""
    ranks.adopt_forked()
    conns = ranks.conns
    ready = wait(conns + [p.sentinel for p in ranks.procs], timeout=0.1)
    # Taken after the wait: a message ready now was sent before a later switch of listener
    # (`listen` happens before the next job's reload is sent), and one message is read per
    # pipe of a live rank, so each goes to the job it belongs to.
    listener = ranks.listener()
    if listener is None:
        return False
    # Which ranks have exited is decided once, here, and only their ends are judged: a rank
    # sends before it exits, so all it sent is in its pipe now and is read first. (A rank
    # that reports its error and exits at once fails the job with that error, not "died".)
    exited = {rank: p.exitcode for rank, p in enumerate(ranks.procs) if p.exitcode is not None}
    for rank, conn in enumerate(conns):
        if conn in ready or rank in exited:
            listener._heard(rank)  # a readable pipe is a live (or ended) rank
            for message in _received(conn, drain=rank in exited):
                listener._handle(rank, message)
    listener._check(exited)
    return True


def _received(conn: Connection, drain: bool) -> Iterator[Any]:
    """The next message on a readable pipe, or (`drain`) every message in it now; nothing
    once the rank's end is closed (its exit code says how it ended)."""
    try:
        if not drain:
            yield pickle.loads(conn.recv_bytes())  # plain pickles: runtime/channel
        while drain and conn.poll():
            yield pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return
