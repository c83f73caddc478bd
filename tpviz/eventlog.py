"""Every event a job received, and the viewers subscribed to them."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from .events import Event


class EventLog:
    """Append-only, thread-safe; subscribers are called on the thread that appends."""

    def __init__(self) -> None:
        self._events: list[Event] = []
        self._subscribers: list[Callable[[Event], None]] = []
        self._lock = threading.Lock()

    def snapshot(self) -> list[Event]:
        with self._lock:
            return list(self._events)

    def subscribe(
        self, callback: Callable[[Event], None], replay: bool = True
    ) -> Callable[[], None]:
        """Call `callback(event)` for every event as it arrives; with `replay`, first for those
        already received. Returns a function that unsubscribes."""
        with self._lock:
            self._subscribers.append(callback)
            past = list(self._events) if replay else []
        for event in past:
            callback(event)

        def unsubscribe() -> None:
            with self._lock, contextlib.suppress(ValueError):
                self._subscribers.remove(callback)

        return unsubscribe

    def append(self, events: list[Event]) -> None:
        with self._lock:
            self._events.extend(events)
            subscribers = list(self._subscribers)
        for event in events:
            for callback in subscribers:
                try:
                    callback(event)
                except Exception:  # a broken viewer must not stop the job
                    pass
