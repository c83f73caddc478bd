"""Frozen ranks end the job; closing a job never races its pump."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest

import tpviz
from tpviz.events import Memory, UnitStart

from .test_failures import children

BOUND = 60  # seconds: a generous liveness bound; the heartbeat timeout below is 3 s
HEARTBEAT = 3.0


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)  # SIGKILL also ends a stopped process


@pytest.fixture(scope="module")
def small(checkpoints):
    from tpviz.models.demo import make_checkpoint

    return make_checkpoint(checkpoints / "small-liveness", "small")


def sleep_on_rank(model, seconds: float) -> float:
    """`call` target: user code that takes longer than the heartbeat timeout, but is alive."""
    time.sleep(seconds)
    return seconds


@pytest.mark.slow
def test_rank_stopped_mid_load_fails_the_job_naming_it(small):
    stopped = threading.Event()
    pids: list[int] = []

    def stop_rank1(event):
        if isinstance(event, UnitStart) and event.rank == 1 and not stopped.is_set():
            pids.append(job._procs[1].pid)
            os.kill(pids[0], signal.SIGSTOP)
            stopped.set()

    try:
        with tpviz.launch(small, 2, heartbeat_timeout=HEARTBEAT) as job:
            job.subscribe(stop_rank1)
            assert stopped.wait(BOUND)
            start = time.monotonic()
            with pytest.raises(tpviz.LoadError) as err:
                job.wait(BOUND)
            assert time.monotonic() - start < BOUND
        message = str(err.value)
        assert message.startswith("rank 1 stopped responding (no heartbeat for "), message
        assert "during " in message and err.value.rank == 1
        assert children() == []
    finally:
        for pid in pids:
            _kill(pid)


@pytest.mark.slow
def test_loaded_job_outlives_slow_calls_but_not_a_stopped_rank(tiny):
    with tpviz.launch(tiny, 2, heartbeat_timeout=HEARTBEAT) as job:
        job.wait(120)
        time.sleep(2 * HEARTBEAT)  # idle loaded ranks are alive: they keep sending heartbeats
        # user code may run longer than the heartbeat timeout: only silence fails the job
        assert job.call(sleep_on_rank, 2 * HEARTBEAT) == [2 * HEARTBEAT] * 2
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
    failures: list[threading.ExceptHookArgs] = []
    previous = threading.excepthook
    threading.excepthook = failures.append
    try:
        for i in range(12):
            flowing = threading.Event()
            job = tpviz.launch(tiny, 2, memory_hz=1000.0)
            job.subscribe(lambda e, f=flowing: isinstance(e, Memory) and f.set())
            flowing.wait(BOUND)
            if i % 3 == 0:
                job.cancel()
            job.shutdown()
    finally:
        threading.excepthook = previous
    assert [f"{f.thread.name}: {f.exc_type.__name__}: {f.exc_value}" for f in failures] == []
    assert children() == []
