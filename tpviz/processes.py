"""The ranks' processes, pipes and private temp dir, with one owner for closing them.

One pump thread per job multiplexes the ranks' pipes and process sentinels and hands what it
reads to the job, so a rank that fails or dies ends the whole job within a fraction of a second.
It is also the one that closes pipes and processes (`close`); other threads ask it to
(`request_close`) and wait for it. Closing a pipe from another thread while the pump is inside
`recv()` breaks the pump.

Forking a rank waits on the server (multiprocessing gives that wait no deadline), so ranks are
started by a thread of their own while the pump keeps checking the job: a server that is
stopped or stuck cannot keep a timeout, a cancel or a signal from ending the job. Ending a
job whose ranks are still being started ends the server too (rankserver.py); the next launch
starts a fresh one.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol

import psutil

from .rankserver import missing_defaults, start_server, stop_server
from .runtime.heartbeat import boot
from .tempdirs import LOCK, PREFIX, remove_stale_workdirs

TERMINATE_GRACE_SECONDS = 3.0


class Listener(Protocol):
    """What the pump tells its job (held weakly, so that an abandoned job is collected and its
    ranks ended): a rank was heard, what it sent, a tick to check the ranks' health (with the
    exit codes of the ranks that had exited before what they sent was read), and the pump's
    own failure (a bug there must not leave callers waiting for replies forever); and, once
    closing has ended every rank, that they are gone."""

    def _heard(self, rank: int) -> None: ...
    def _handle(self, rank: int, message: Any) -> None: ...
    def _check(self, exited: dict[int, int]) -> None: ...
    def _pump_failed(self, error: Exception) -> None: ...
    def _ranks_ended(self) -> None: ...


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
        self._imported: set[str] = set()  # the modules the ranks import for a model, so far
        self.grace = 0.0  # seconds the ranks get to exit by themselves once asked to stop
        self.command_ids = itertools.count()  # unique over the ranks' life, across warm loads
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
        self._imported = set(preload)
        payload = pickle.dumps(spec)
        environ = {**os.environ, **missing_defaults()}  # now, not when the server started

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

    def first_to_import(self, imports: set[str]) -> bool:
        """Whether a load that imports `imports` brings modules new to these ranks: they stay
        (its resident set, not the previous load's, is what later loads come back to)."""
        new = not imports <= self._imported
        self._imported |= imports
        return new

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
        """End every rank (a grace, in which what they still send is drained, then TERM, then
        KILL), then release pipes and temp dir."""
        self._end_starter()
        self._drain_until_exited(self.grace)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)  # a stopped rank acts on TERM only once resumed
        deadline = time.monotonic() + TERMINATE_GRACE_SECONDS
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()  # also ends a stopped (SIGSTOP) rank, which TERM cannot
                p.join(TERMINATE_GRACE_SECONDS)
            if p.is_alive():  # its exit is told by the server that forked it: stopped, stuck
                stop_server()  # its end closes the pipe that tells it; the next launch starts one
                p.join()
        for p in self.procs:
            _end_what_it_left(p.pid)
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
        listener = self.listener() if self.listener is not None else None
        if listener is not None:
            listener._ranks_ended()

    def _drain_until_exited(self, seconds: float) -> None:
        """Wait up to `seconds` for the ranks to exit, reading and dropping what they still
        send: a rank blocked sending a large reply (a forward's logits) into a full pipe
        that nobody reads any more cannot exit."""
        deadline = time.monotonic() + seconds
        conns = list(self.conns)
        live = [p for p in self.procs if p.is_alive()]
        while live and (left := deadline - time.monotonic()) > 0:
            for conn in wait([*conns, *(p.sentinel for p in live)], timeout=left):
                if conn in conns and not _dropped(conn):
                    conns.remove(conn)  # its end is closed: nothing more will come
            live = [p for p in live if p.is_alive()]


def _end_what_it_left(pid: int) -> None:
    """Kill what an ended rank started and left running (a program a `job.call` ran): it is
    in the process group the rank led (heartbeat.boot). The group's id is the rank's pid,
    which is not handed out again while any member lives; once none does, another process
    could lead a group of that id only after the system has gone through every other pid,
    and this runs as the ranks are seen ended (a job ends all its ranks when one is gone)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _dropped(conn: Connection) -> bool:
    """Read and drop what a readable pipe holds now; False once the other end is closed.
    Raw bytes, not messages: a rank stopped halfway through sending one would leave
    `recv_bytes` waiting for the rest forever."""
    try:
        return bool(os.read(conn.fileno(), 1 << 16))
    except OSError:
        return False


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
    ready = wait(ranks.conns + [p.sentinel for p in ranks.procs], timeout=0.1)
    # Taken after the wait: what is ready now was sent before any later switch of listener
    # (`listen` precedes the next reload), and a live rank's pipe yields one message per tick.
    listener = ranks.listener()
    if listener is None:
        return False
    dead = _unreported_deaths(ranks.procs)
    if dead:  # its peers' errors (a collective it broke) may be in this tick: hear it first
        wait([p.sentinel for p in dead], timeout=TERMINATE_GRACE_SECONDS)
    # Which ranks have exited is decided once, here, and only their ends are judged: a rank
    # sends before it exits, so all it sent is in its pipe now and is read first. (A rank
    # that reports its error and exits at once fails the job with that error, not "died".)
    exited = {rank: p.exitcode for rank, p in enumerate(ranks.procs) if p.exitcode is not None}
    # A rank killed by a signal is judged before what the others say: their errors (a peer's
    # connection closed in a collective) follow from its death, and may be in this tick too.
    killed = {rank: code for rank, code in exited.items() if code < 0}
    for rank in killed:
        _hand_over(ranks.conns[rank], rank, listener, drain=True)
    if killed:
        listener._check(killed)
    for rank, conn in enumerate(ranks.conns):
        if rank not in killed and (conn in ready or rank in exited):
            _hand_over(conn, rank, listener, drain=rank in exited)
    listener._check(exited)
    return True


def _unreported_deaths(procs: list) -> list:
    """Ranks that have ended (the kernel shows them gone, or a zombie) before the server that
    forked them reported it: a rank killed by a signal breaks its peers' collectives at once,
    and their errors can reach the pump before its server's word does."""
    dead = []
    for p in procs:
        if p.exitcode is not None:
            continue
        try:
            if psutil.Process(p.pid).status() != psutil.STATUS_ZOMBIE:
                continue
        except psutil.NoSuchProcess:
            pass
        except psutil.AccessDenied:  # not ours to read: the server's word alone tells
            continue
        dead.append(p)
    return dead


def _hand_over(conn: Connection, rank: int, listener: Listener, drain: bool) -> None:
    """What a readable (or ended) rank's pipe holds, to the listener."""
    listener._heard(rank)  # a readable pipe is a live (or ended) rank
    for message in _received(conn, drain):
        listener._handle(rank, message)


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
