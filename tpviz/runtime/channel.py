"""The rank's end of its pipe to the launcher (standard library only; see heartbeat.py).

Messages are plain pickles (`send_bytes`), never multiprocessing's own pickler, which sends
tensors through shared memory and a `pymp-*` listener that outlives a killed rank.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
from multiprocessing.connection import Connection
from typing import Any, NoReturn

ORPHANED = 3  # exit code of a rank whose launcher is gone


def leave_orphaned() -> NoReturn:
    """End this rank, whose launcher is gone, and whatever it started and left running (a
    program a `job.call` ran): they are in the process group the rank leads (heartbeat.boot),
    killed with it. Nobody is left to hear how it ended."""
    if os.getpgid(0) == os.getpid():  # never the launcher's group, should setpgid have failed
        os.killpg(0, signal.SIGKILL)
    os._exit(ORPHANED)


class Channel:
    """The rank's end of its pipe: sends from any thread, one message at a time."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            with self._lock:
                self.conn.send_bytes(data)
        except OSError:  # the launcher died or closed the pipe: leave without a traceback
            leave_orphaned()

    def recv(self) -> Any:
        """The launcher's next message. Its end closes only once it has ended every rank, so
        a closed pipe means it died: leave as `send` does, ending what the rank started (a
        rank leaving any other way would leave that to a launcher that is gone)."""
        try:
            data = self.conn.recv_bytes()
        except (EOFError, OSError):
            leave_orphaned()
        return pickle.loads(data)
