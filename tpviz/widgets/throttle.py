"""A rate cap for redraws: however often asked, run at most `rate` times a second, and once
more after the last request so that the final state is always drawn."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

Schedule = Callable[[float, Callable[[], None]], Any]


def timer_thread(delay: float, fn: Callable[[], None]) -> threading.Timer:
    timer = threading.Timer(delay, fn)
    timer.daemon = True
    timer.start()
    return timer


class Throttle:
    """`request()` runs `action` now if the last run is at least 1/rate ago, else schedules one
    run for when it is due; requests meanwhile fold into that run. `clock` and `schedule`
    are injectable so a test can check the cap without sleeping."""

    def __init__(
        self,
        action: Callable[[], None],
        rate: float = 10.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        schedule: Schedule = timer_thread,
    ):
        self._action = action
        self._interval = 1.0 / rate
        self._clock = clock
        self._schedule = schedule
        self._last = -math.inf
        self._pending = False
        self._lock = threading.Lock()
        # one run at a time, whichever thread asks; reentrant, as an action may cause requests
        self._running = threading.RLock()

    def request(self) -> None:
        with self._lock:
            if self._pending:
                return
            now = self._clock()
            delay = self._last + self._interval - now
            if delay > 0:
                self._pending = True
            else:
                self._last = now
        if delay > 0:
            self._schedule(delay, self._fire)
        else:
            self._run()

    def _fire(self) -> None:
        with self._lock:
            self._pending = False
            self._last = self._clock()
        self._run()

    def _run(self) -> None:
        with self._running:
            self._action()
