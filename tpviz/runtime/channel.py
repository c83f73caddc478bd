"""The rank's end of its pipe to the launcher (standard library only; see heartbeat.py).

Messages are plain pickles (`send_bytes`), never multiprocessing's own pickler, which sends
tensors through shared memory and a `pymp-*` listener that outlives a killed rank.
"""

from __future__ import annotations

import os
import pickle
import threading
from multiprocessing.connection import Connection
from typing import Any

ORPHANED = 3  # exit code of a rank whose launcher is gone


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
            os._exit(ORPHANED)

    def recv(self) -> Any:
        return pickle.loads(self.conn.recv_bytes())
