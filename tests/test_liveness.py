"""Frozen ranks end the job; closing a job never races its pump."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time

import pytest

import tpviz
from tpviz.events import Memory, Phase, RankPhase, UnitDone, UnitStart
from tpviz.job import HEARTBEAT_TIMEOUT
from tpviz.liveness import timeout_message
from tpviz.plan import resolve_plan
from tpviz.processes import Ranks, _pump_once
from tpviz.tracking import ProgressTracker, RankProgress

from .test_failures import children

BOUND = 60  # seconds: a generous liveness bound; the heartbeat timeout below is 3 s
HEARTBEAT = 3.0


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)  # SIGKILL also ends a stopped process


def sleep_on_rank(model, seconds: float) -> float:
    """`call` target: user code that takes longer than the heartbeat timeout, but is alive."""
    time.sleep(seconds)
    return seconds


@pytest.mark.slow
def test_rank_stopped_mid_load_fails_the_job_naming_it(small):
    # the stop must land before rank 1 ends its load; on a loaded machine the pump may read
    # rank 1's phase only after its whole load was sent, and that job then loads: it proves
    # nothing, so another is started (the outcome decides, not a sleep)
    for _attempt in range(3):
        error = _stop_rank1_mid_load(small)
        if error is not None:
            break
    else:
        pytest.fail("rank 1 ended its load before its stop landed, 3 times")
    message = str(error)
    assert message.startswith("rank 1 stopped responding (no heartbeat for "), message
    assert "during " in message and error.rank == 1
    assert children() == []


def _stop_rank1_mid_load(source) -> tpviz.LoadError | None:
    """Stop rank 1 (SIGSTOP) as it is ready to load: the job's error, or None where rank 1
    had loaded before the stop landed. Its phases are sent at once (its units are batched, and
    its first unit came too late for the stop 3 times running on a loaded machine)."""
    stopped = threading.Event()
    pids: list[int] = []

    def stop_rank1(event):
        ready = isinstance(event, Phase) and event.name in (RankPhase.READY, RankPhase.LOADING)
        if ready and event.rank == 1 and not stopped.is_set():
            pids.append(job._procs[1].pid)
            os.kill(pids[0], signal.SIGSTOP)
            stopped.set()

    try:
        with tpviz.launch(source, 2, heartbeat_timeout=HEARTBEAT) as job:
            job.subscribe(stop_rank1)
            assert stopped.wait(BOUND)
            start = time.monotonic()
            try:
                job.wait(BOUND)
            except tpviz.LoadError as e:
                assert time.monotonic() - start < BOUND
                return e
            return None
    finally:
        for pid in pids:
            _kill(pid)


def hold_the_gil(seconds: float) -> None:
    """Run Python code for `seconds` without letting another thread run: as a notebook cell
    in one long C call (a regex, an extension) would."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(10 * seconds)  # other threads wait this long for the GIL
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
    finally:
        sys.setswitchinterval(interval)


@pytest.mark.slow
def test_loaded_job_outlives_slow_calls_but_not_a_stopped_rank(tiny):
    with tpviz.launch(tiny, 2, heartbeat_timeout=HEARTBEAT) as job:
        job.wait(120)
        time.sleep(2 * HEARTBEAT)  # idle loaded ranks are alive: they keep sending heartbeats
        # user code may run longer than the heartbeat timeout: only silence fails the job
        assert job.call(sleep_on_rank, 2 * HEARTBEAT) == [2 * HEARTBEAT] * 2
        # so may the caller's own code while holding the GIL (the pump cannot read meanwhile)
        hold_the_gil(2 * HEARTBEAT)
        assert job.forward([[1, 2, 3]]).shape[:2] == (1, 3) and job.state == "loaded"
        pid = job._procs[1].pid
        try:
            os.kill(pid, signal.SIGSTOP)
            start = time.monotonic()
            with pytest.raises(tpviz.LoadError) as err:
                job.forward([[1, 2, 3]])
            assert time.monotonic() - start < BOUND
        finally:
            _kill(pid)
    assert str(err.value).startswith("rank 1 stopped responding"), str(err.value)
    assert "while running forward" in str(err.value) and err.value.rank == 1
    assert children() == []


@pytest.mark.slow
def test_closing_jobs_while_events_flow_never_breaks_the_pump(tiny):
    """Jobs closed at many moments: while ranks start, end, and stream events (a high
    memory rate), by `shutdown` and by `cancel`; no thread may raise, nothing may remain.
    Four ranks and a tiny GIL switch interval make thread interleavings frequent: the old
    races (pipes and processes closed by one thread while the pump used them) showed in
    about one close in fifteen here."""
    plan = resolve_plan(tiny, 4)
    failures: list[str] = []
    previous = threading.excepthook, sys.getswitchinterval()
    threading.excepthook = lambda a: failures.append(f"{a.thread.name}: {a.exc_value!r}")
    sys.setswitchinterval(1e-6)
    try:
        for i in range(80):
            job = tpviz.launch(tiny, 4, plan, memory_hz=1000.0)
            if i % 20 == 19:  # now and then, wait until events flow
                flowing = threading.Event()
                job.subscribe(lambda e, f=flowing: isinstance(e, Memory) and f.set())
                assert flowing.wait(BOUND)
            else:
                time.sleep(i % 7 * 0.05)
            try:
                if i % 5 == 0:
                    job.cancel()
                job.shutdown()
            except Exception as e:  # noqa: BLE001 - collect, to report every failure
                failures.append(f"close: {e!r}")
    finally:
        threading.excepthook, interval = previous
        sys.setswitchinterval(interval)
    assert failures == []
    assert children() == []


def waits_alone_on_rank_0(model):
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.barrier()  # a collective rank 1 never enters


@pytest.mark.slow
def test_a_rank_left_in_a_collective_its_peers_never_entered_ends_the_job(tiny):
    """A deadlock the heartbeat cannot see (its thread beats on): rank 0 still runs the call
    heartbeat_timeout after rank 1 finished it, and the job ends, naming it."""
    with tpviz.launch(tiny, 2, heartbeat_timeout=HEARTBEAT) as job:
        job.wait(BOUND)
        start = time.monotonic()
        with pytest.raises(tpviz.LoadError, match="rank 0 was still running call 3 s after"):
            job.call(waits_alone_on_rank_0)
        assert time.monotonic() - start < BOUND and job.state == "failed"


@pytest.mark.slow
def test_a_collective_that_timed_out_in_a_call_ends_the_job(tiny):
    """The reload's timeout becomes the ranks' collective timeout (it kept the launch's), so
    rank 0's lone barrier times out before the straggler rule (heartbeat_timeout) would end
    it; the barrier after the failed call finds the process group broken and ends the job,
    where it stayed loaded and every later command failed on a closed connection."""
    collective_timeout = 10.0
    with tpviz.launch(tiny, 2) as first:
        first.wait(BOUND)
        with first.reload(timeout=collective_timeout) as job:
            job.wait(BOUND)
            start = time.monotonic()
            with pytest.raises(tpviz.LoadError, match="no longer works after it") as failed:
                job.call(waits_alone_on_rank_0)
            assert time.monotonic() - start < HEARTBEAT_TIMEOUT
            assert "rank 0: call failed" in str(failed.value) and job.state == "failed"
            with pytest.raises(tpviz.LoadError, match="a failed job cannot reload"):
                job.reload()
    assert children() == []


def _report_then_exit(conn) -> None:
    """A rank's last moments when it fails: it sends, then exits at once."""
    conn.send_bytes(pickle.dumps("progress"))
    conn.recv_bytes()  # the pump has read the first message
    conn.send_bytes(pickle.dumps("error"))


class RecordingListener:
    """What the pump hands a job, in order; on the first message the rank is let go and has
    exited before the pump's tick ends (the race a loaded machine makes)."""

    def __init__(self, proc, conn):
        self.proc, self.conn = proc, conn
        self.handled: list[str] = []
        self.judged: list[str] | None = None  # what had been handled when the exit was judged

    def _heard(self, rank: int) -> None:
        pass

    def _handle(self, rank: int, message: str) -> None:
        self.handled.append(message)
        if message == "progress":
            self.conn.send_bytes(b"go")
            self.proc.join()

    def _check(self, exited: dict[int, int]) -> None:
        if exited and self.judged is None:
            self.judged = list(self.handled)

    def _pump_failed(self, error: Exception) -> None:
        raise error

    def _ranks_ended(self) -> None:
        pass


def test_a_rank_that_exits_right_after_reporting_is_judged_after_its_report():
    """A failing rank sends its error and exits at once: the job must fail with that error,
    never with "rank died" (seen in CI when the exit was judged before the error was read)."""
    ctx = mp.get_context("fork")  # the child only writes to its pipe
    parent_end, child_end = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_report_then_exit, args=(child_end,), daemon=True)
    proc.start()
    child_end.close()
    ranks = Ranks()
    ranks.procs.append(proc)
    ranks.conns.append(parent_end)
    listener = RecordingListener(proc, parent_end)
    ranks.listen(listener)
    try:
        deadline = time.monotonic() + BOUND
        while listener.judged is None and time.monotonic() < deadline:
            _pump_once(ranks)
        assert listener.judged == ["progress", "error"]
    finally:
        ranks.close()


class OrderListener:
    """What one pump tick hands a job, in order: messages, and the deaths it judges."""

    def __init__(self):
        self.seen: list[object] = []

    def _heard(self, rank: int) -> None:
        pass

    def _handle(self, rank: int, message: str) -> None:
        self.seen.append((rank, message))

    def _check(self, exited: dict[int, int]) -> None:
        self.seen.append(dict(exited))

    def _pump_failed(self, error: Exception) -> None:
        raise error

    def _ranks_ended(self) -> None:
        pass


def _say_and_wait(conn, message: str) -> None:
    conn.send_bytes(pickle.dumps(message))
    conn.recv_bytes()  # until the test lets it go


def test_a_rank_killed_by_a_signal_is_judged_before_its_peers_errors():
    """Rank 1 is killed; rank 0's collective then fails ("connection closed by peer") and it
    reports that. When both reach the pump in one tick, the job must fail with rank 1's death,
    the cause, not with rank 0's error (seen in CI under load)."""
    ctx = mp.get_context("fork")  # the children only use their pipes
    ranks, listener = Ranks(), OrderListener()
    for message in ("peer closed the connection", "never read"):
        parent_end, child_end = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=_say_and_wait, args=(child_end, message), daemon=True)
        proc.start()
        child_end.close()
        ranks.procs.append(proc)
        ranks.conns.append(parent_end)
    ranks.listen(listener)
    try:
        assert ranks.conns[0].poll(BOUND) and ranks.conns[1].poll(BOUND)
        ranks.procs[1].kill()
        ranks.procs[1].join(BOUND)
        _pump_once(ranks)
        killed = {1: -signal.SIGKILL}
        assert listener.seen[:2] == [(1, "never read"), killed]  # its pipe drained, then judged
        assert (0, "peer closed the connection") in listener.seen[2:]
    finally:
        ranks.conns[0].send_bytes(b"go")
        ranks.close()


def _send_a_large_reply(conn, sent_marker: str) -> None:
    conn.send_bytes(b"\0" * (8 << 20))  # far more than a socket buffer: blocks until read
    with open(sent_marker, "w"):
        pass


def test_a_rank_sending_a_large_reply_at_close_can_still_exit_in_its_grace(tmp_path):
    """A job stopped while a rank sends a large reply (a forward's logits under --verify):
    the rank exits by itself once it has sent, so the closing pump must keep reading its pipe
    during the grace; otherwise it blocks until the grace ends and is terminated (11 s to
    stop a CLI on Ctrl-C)."""
    marker = tmp_path / "sent"
    ctx = mp.get_context("fork")  # the child only writes to its pipe and a file
    parent_end, child_end = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_send_a_large_reply, args=(child_end, str(marker)), daemon=True)
    proc.start()
    child_end.close()
    ranks = Ranks()
    ranks.procs.append(proc)
    ranks.conns.append(parent_end)
    ranks.grace = BOUND
    ranks.close()  # the pump's own close, with the grace a shutdown gives
    assert marker.exists()  # it finished sending and exited, rather than being terminated


def _wait_for_term(ready, ended_marker: str) -> None:
    def on_term(signum, frame):
        with open(ended_marker, "w"):
            pass
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    ready.set()
    while True:
        time.sleep(1)


def test_a_stopped_rank_is_resumed_to_act_on_its_terminate(tmp_path):
    """A rank frozen by SIGSTOP cannot act on SIGTERM: it is resumed with it, so it ends at
    once instead of after the kill's grace (3 s more on every frozen-rank error)."""
    marker = tmp_path / "ended"
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    proc = ctx.Process(target=_wait_for_term, args=(ready, str(marker)), daemon=True)
    proc.start()
    assert ready.wait(BOUND)
    os.kill(proc.pid, signal.SIGSTOP)
    ranks = Ranks()
    ranks.procs.append(proc)
    ranks.close()
    assert marker.exists()  # its TERM handler ran: not killed after the grace


def test_a_timeout_names_each_rank_that_had_not_loaded_and_where_it_was():
    tracker = ProgressTracker()
    for event in [
        Phase(0, 1.0, RankPhase.LOADED),  # done: not named
        Phase(1, 1.0, RankPhase.LOADING),
        UnitStart(1, 1.1, "model.embed_tokens", 100, 0, 3),
        UnitDone(1, 1.2, "model.embed_tokens", 100, 0.1, 0, 3),
        UnitStart(1, 1.3, "model.layers.0", 100, 1, 3),
        Phase(2, 1.0, RankPhase.SKELETON),
    ]:
        tracker.track(event)
    tracker.ranks[3] = RankProgress()  # never heard
    assert timeout_message(5, tracker.ranks) == (
        "the load did not finish within its timeout (5 s): rank 1 was loading model.layers.0 "
        "(unit 2 of 3), rank 2 was in skeleton, rank 3 had not started"
    )
