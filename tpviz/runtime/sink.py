"""Where a rank's events go: batched to the launcher over a pipe, and/or a JSONL file.

Batching bounds the message rate whatever the model size: events are grouped and sent at most
every `interval` seconds (phase changes, errors and `done` go at once), so a model with
thousands of modules sends tens of messages a second, not thousands.

The events file is a side output: if it cannot be written (a full disk, a path that became a
file) the sink stops writing it, keeps sending events, and adds the failure, with its path, to
the rank's `done` result (`output_errors`) instead of ending the rank.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable
from typing import Any

from ..events import Done, Error, Event, Phase, encode, events_file, hold_while_writing
from ..messages import EventBatch
from ..outputs import write_error

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
        self.send = send  # delivers an EventBatch to the launcher
        self.interval = interval
        self.events_dir = events_dir
        self.file_error: dict[str, str] | None = None
        self._file = None
        if events_dir is not None:
            self._to_file(lambda: self._open(events_dir))
        self._pending: list[Event] = []
        self._lock = threading.Lock()
        self._last_flush = 0.0

    def _open(self, events_dir: str | os.PathLike) -> None:
        os.makedirs(events_dir, exist_ok=True)
        # not emptied on opening, only once its lock is held: another running load's file is
        # left as it is; not waited on: a FIFO without a reader fails at once (ENXIO)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK
        fd = os.open(events_file(events_dir, self.rank), flags, 0o666)
        file = open(fd, "a", encoding="utf-8")  # noqa: SIM115
        try:
            hold_while_writing(file)
            if stat.S_ISREG(os.fstat(file.fileno()).st_mode):  # as "w" would (not a device)
                file.truncate(0)
        except OSError:
            file.close()
            raise
        self._file = file

    def _to_file(self, write: Callable[[], None]) -> None:
        """Run one file operation; on failure note it and write no more."""
        try:
            write()
        except OSError as e:
            file = events_file(self.events_dir, self.rank)
            self.file_error = write_error("events", self.events_dir, file, e.strerror or str(e))
            self._close_file()

    def _close_file(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except OSError:  # the buffered lines that could not be written fail again here
                pass

    def emit(self, event: Event) -> None:
        urgent = isinstance(event, URGENT)
        with self._lock:
            due = time.monotonic() - self._last_flush >= self.interval
            if self._file is not None:
                line = encode(event) + "\n"
                self._to_file(lambda: self._file.write(line))
            if urgent and self._file is not None:  # so that `done` knows whether it was written
                self._to_file(self._file.flush)
            if isinstance(event, Done):
                self._close_file()  # a load's file ends with its done: its lock goes too
                if self.file_error is not None:
                    event.result.setdefault("output_errors", []).append(self.file_error)
            self._pending.append(event)
        if due or urgent:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
            self._last_flush = time.monotonic()
            if self._file is not None:
                self._to_file(self._file.flush)
            if batch and self.send is not None:
                self.send(EventBatch(batch))

    def close(self) -> None:
        self.flush()
        with self._lock:
            self._close_file()
