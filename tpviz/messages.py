"""The messages on a rank's pipe to its launcher, as plain picklable records.

Up (rank -> launcher): `Beat` (alive), `EventBatch` (the rank's events, `done` and `error`
among them), `Reply` (to a command). Down (launcher -> rank): `Command`. Standard library only:
the heartbeat sends `Beat` while the rank is still importing torch.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class CommandName(StrEnum):
    FORWARD = "forward"
    SHARD_REPORT = "shard_report"
    CALL = "call"
    CHECK_GROUP = "check_group"  # a barrier: does the process group still work?
    SHUTDOWN = "shutdown"
    RELOAD = "reload"  # args: the next load's WorkerSpec; answered by that load's events


# What a job sends while it verifies: the forward, and the barrier after a failed command.
VERIFY_COMMANDS = frozenset({CommandName.FORWARD, CommandName.CHECK_GROUP})


@dataclass(frozen=True, slots=True)
class Beat:
    """The rank is alive (sent from process start to exit)."""

    sent: float  # the rank's time.time() as it sent it: the first marks its process up


@dataclass(frozen=True, slots=True)
class EventBatch:
    events: list[Any]  # tpviz.events.Event, in the order the rank made them


@dataclass(frozen=True, slots=True)
class Reply:
    command_id: int
    ok: bool
    payload: Any  # the command's value, or (not ok) the error, one line
    traceback: str = ""  # where the error arose in the rank (not ok)


@dataclass(frozen=True, slots=True)
class Command:
    """A command and its arguments, pickled apart from it (`sent`): a rank that cannot
    unpickle them (a function or class defined in the caller's `__main__`, which the rank
    does not have) fails that command, and stays loaded, instead of failing to read it."""

    name: CommandName
    command_id: int
    pickled_args: bytes

    @classmethod
    def sent(cls, name: CommandName, command_id: int, args: tuple[Any, ...] = ()) -> Command:
        """Raises what pickle raises for arguments it cannot send."""
        return cls(name, command_id, pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL))

    def args(self) -> tuple[Any, ...]:
        return pickle.loads(self.pickled_args)


Message = Beat | EventBatch | Reply | Command
