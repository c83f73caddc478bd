"""Where a rank's events go: batched to the launcher over a pipe, and/or a JSONL file.

Batching bounds the message rate whatever the model size: events are grouped and sent at most
every `interval` seconds (phase changes, errors and `done` go at once), so a model with
thousands of modules sends tens of messages a second, not thousands.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ..events import Done, Error, Event, Phase, encode, events_file

URGENT = (Phase, Error, Done)


class EventSink:
    def __init__(
        self,
        rank: int,
        send: Callable[[Any], None] | None = None,
        events_dir: str | os.PathLike | None = None,
        interval: float = 0.05,
    ):
        self.rank = rank
        self.send = send  # delivers ("events", [Event, ...]) to the launcher
        self.interval = interval
        self._file = None
        if events_dir is not None:
            os.makedirs(events_dir, exist_ok=True)
            self._file = open(events_file(events_dir, rank), "a", encoding="utf-8")  # noqa: SIM115
        self._pending: list[Event] = []
        self._lock = threading.Lock()
        self._last_flush = 0.0

    def emit(self, event: Event) -> None:
        with self._lock:
            self._pending.append(event)
            if self._file is not None:
                self._file.write(encode(event) + "\n")
            due = time.monotonic() - self._last_flush >= self.interval
        if due or isinstance(event, URGENT):
            self.flush()

    def flush(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
            self._last_flush = time.monotonic()
            if self._file is not None:
                self._file.flush()
            if batch and self.send is not None:
                self.send(("events", batch))

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None
