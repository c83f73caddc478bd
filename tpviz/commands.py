"""Commands to the loaded ranks (forward, shard_report, call) and their replies."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from .messages import Command, CommandName, Reply
from .processes import Ranks


def check_callable(fn: Any) -> None:
    """What `job.call` can send: a function the ranks import by name (as pickle sends one),
    or its import path `"pkg.mod:fn"`; anything else is said before it is sent."""
    if isinstance(fn, str):
        module, colon, name = fn.partition(":")
        if not (module and colon and name):
            raise ValueError(f"call: {fn!r} is not an import path 'pkg.mod:fn'")
    elif not callable(fn):
        raise TypeError(f"call: fn must be a function or 'pkg.mod:fn', not {fn!r}")
    elif "<" in getattr(fn, "__qualname__", ""):  # <lambda>, or <locals> of another function
        raise ValueError(
            f"call: {fn.__qualname__} cannot reach the ranks, which import a function by its "
            "name: define it at the top level of an importable module, or pass 'pkg.mod:fn'"
        )


def first_failed(replies: dict[int, Reply]) -> int | None:
    """The lowest rank whose reply says its command failed, if any."""
    return next((rank for rank in sorted(replies) if not replies[rank].ok), None)


class CommandChannel:
    """Sends a command to every rank and collects one reply per rank. Replies are handed in
    by the pump thread (`on_reply`); `cond` is the job's, so that a job that ends wakes a
    caller waiting here. Command ids are the ranks' (they count across warm loads), so a late
    reply to a command given up, or one of the previous job's, is never taken for another's."""

    def __init__(self, ranks: Ranks, world_size: int, cond: threading.Condition):
        self._ranks = ranks
        self._world = world_size
        self._cond = cond
        self._replies: dict[int, dict[int, Reply]] = {}  # the commands in flight, by id
        self.running: CommandName | None = None  # the command the ranks are running, if any

    @property
    def in_flight(self) -> bool:
        """A command sent whose replies are still awaited (read under `cond`)."""
        return bool(self._replies)

    def on_reply(self, rank: int, reply: Reply) -> None:
        with self._cond:
            if reply.command_id in self._replies:  # else one nobody awaits any more: dropped
                self._replies[reply.command_id][rank] = reply
                self._cond.notify_all()

    def run(
        self,
        name: CommandName,
        args: tuple[Any, ...],
        admit: Callable[[], None],
        given_up: Callable[[], bool],
        straggler_seconds: float,
    ) -> dict[int, Reply]:
        """Every rank's reply by rank; fewer when `given_up()` turned true first (the job
        ended), or when a rank has not replied `straggler_seconds` after the others all did:
        it waits in a collective they never entered (or works that much longer alone). No
        wall-clock limit otherwise: user code may take long, and a silent rank fails the job
        through its heartbeat. `admit()` raises if the job cannot run a command now; it runs
        under `cond`, with the command's registration, so no reload slips in between."""
        with self._cond:
            admit()
            command_id = next(self._ranks.command_ids)
            self._replies[command_id] = {}
            self.running = name
            if name in (CommandName.FORWARD, CommandName.CALL):
                # what runs may stay (a forward imports torch._dynamo): the next load is the
                # reference for the memory a load leaves behind
                self._ranks.reference_baselines = None
        try:
            self._send(name, command_id, args)
            with self._cond:
                self._wait(command_id, given_up, straggler_seconds)
                return dict(self._replies[command_id])
        finally:
            with self._cond:
                del self._replies[command_id]
                self.running = None

    def _send(self, name: CommandName, command_id: int, args: tuple[Any, ...] = ()) -> None:
        """To every rank; a dead rank breaks its pipe, which the pump reports, failing the job.
        Arguments pickle cannot send are refused before any rank gets the command."""
        try:
            command = Command.sent(name, command_id, args)
        except Exception as e:  # noqa: BLE001 - pickle raises several kinds for what it cannot send
            raise ValueError(
                f"{name}: its arguments cannot be sent to the ranks ({type(e).__name__}: {e}); "
                "pass what pickle can send: numbers, strings, tensors, lists, dicts"
            ) from None
        with contextlib.suppress(OSError):
            self._ranks.send_all(command)

    def _wait(self, command_id: int, given_up: Callable[[], bool], straggler: float) -> None:
        """Until every rank replied, the job ended, or `straggler` seconds passed since the
        last reply came while some are still missing."""
        seen, deadline = 0, None
        while True:
            count = len(self._replies[command_id])
            if count == self._world or given_up():
                return
            if count != seen:  # another reply: the ranks still at it get `straggler` more
                seen, deadline = count, time.monotonic() + straggler
            if deadline is None:
                self._cond.wait()
            elif not self._cond.wait(max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    return

    def reload(self, spec: Any) -> None:
        """Send every (loaded, idle) rank the next load's WorkerSpec; its events answer."""
        self._send(CommandName.RELOAD, next(self._ranks.command_ids), (spec,))

    def shutdown(self) -> None:
        """Ask every rank to leave its command loop."""
        self._send(CommandName.SHUTDOWN, next(self._ranks.command_ids))
