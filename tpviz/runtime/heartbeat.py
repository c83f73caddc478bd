"""The first code a rank runs: liveness from process start to exit.

Only the standard library is imported here, so that the heartbeat flows while torch is still
being imported (where the forkserver has not preloaded it); the rank's spec arrives pickled
and is unpickled once the heartbeat runs. Every message to the launcher goes through one
`Channel`: if the launcher is gone, the rank ends at once and quietly (there is no one left to
report to).
"""

from __future__ import annotations

import gc
import os
import pickle
import select
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from ..messages import Beat
from .channel import Channel, leave_orphaned

# the launcher's end of the pipe closed (the launcher died): no data is consumed by polling
HANGUP = select.POLLHUP | getattr(select, "POLLRDHUP", 0)


def _daemon(name: str, target: Callable[[], None]) -> None:
    threading.Thread(target=target, name=name, daemon=True).start()


def boot(
    rank: int, payload: bytes, conn: Connection, environ: dict, beat: float, workdir: str
) -> None:
    """Process target: take the launcher's environment, start the watch on the launcher and
    the heartbeat, then run the rank."""
    # What the forkserver preloaded (torch: ~300k objects) lives as long as the rank: keep the
    # collector off it, so that a collection (as between warm loads) costs milliseconds, not
    # a second, and does not dirty the pages this fork shares with the server.
    gc.freeze()
    os.environ.clear()
    os.environ.update(environ)
    # The rank leads a process group of its own, so that what it starts and leaves running
    # (a program a `job.call` ran) can be ended with the job, even after the rank itself has
    # exited (processes.py) or when the launcher is gone (`leave_orphaned`). A terminal's
    # Ctrl-C reaches the launcher alone, which decides what ends; SIGINT sent to the rank is
    # ignored for the same reason.
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Whatever the rank puts in $TMPDIR (multiprocessing's pymp-* dirs for sending tensors,
    # torch's compile cache) goes in the launcher's private dir, removed with the job even
    # when the rank is killed.
    os.environ["TMPDIR"] = tempfile.tempdir = workdir
    channel = Channel(conn)

    def watch_parent() -> None:
        # The rank's parent is the forkserver, which outlives the launcher while ranks hold
        # its pipe; the launcher's own end of this pipe closes the moment it dies.
        poller = select.poll()
        poller.register(conn.fileno(), HANGUP)
        while not poller.poll():
            pass
        leave_orphaned()  # the launcher is gone (e.g. a restarted kernel): leave nothing

    def heartbeat() -> None:  # silence means frozen: the launcher ends the job
        while True:
            channel.send(Beat(time.time()))
            time.sleep(beat)

    _daemon("tpviz-parent-watch", watch_parent)
    _daemon("tpviz-heartbeat", heartbeat)
    spec = pickle.loads(payload)
    from .worker import run_rank  # imports torch: seconds, while the heartbeat already runs

    run_rank(rank, spec, channel)
