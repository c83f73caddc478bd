"""What to say when a rank died or fell silent: the error names the rank, how it ended and
what it was doing; and the durations that bound a job, checked."""

from __future__ import annotations

from collections.abc import Mapping

from .choices import MAX_SECONDS
from .events import RankPhase
from .messages import Reply
from .tracking import RankProgress

UNGUARDED_SCRIPT = (
    " before it started; a script that calls tpviz.launch must guard the call with "
    "`if __name__ == '__main__':`"
)


class Silence:
    """How long each rank has sent nothing, counting only the time the launcher listened.

    The pump thread checks every tick (about 0.1 s apart); a caller that holds the GIL in one
    long call (a regex, a C extension) stops it, and what the ranks sent meanwhile waits
    unread in their pipes. A gap between two checks longer than `STALL` is taken out of every
    rank's silence, so that a busy notebook cell does not end a healthy job."""

    STALL = 1.0  # seconds between two checks beyond which the launcher was not listening

    def __init__(self, world_size: int) -> None:
        self._heard: list[float | None] = [None] * world_size
        self._checked: float | None = None

    def heard(self, rank: int, now: float) -> None:
        self._heard[rank] = now

    def longest(self, ranks: int, now: float) -> tuple[int, float]:
        """(rank, seconds) of the most silent of the first `ranks` (those forked), counted
        from when the launcher first checked them; (0, 0.0) while none is forked."""
        gap = now - self._checked if self._checked is not None else 0.0
        self._checked = now
        if gap > self.STALL:  # not listening: that time is no rank's silence
            self._heard = [None if h is None else h + gap for h in self._heard]
        for rank in range(ranks):
            if self._heard[rank] is None:
                self._heard[rank] = now
        seconds, rank = max(((now - self._heard[r], r) for r in range(ranks)), default=(0.0, 0))
        return rank, seconds


def death_message(
    rank: int,
    exitcode: int,
    progress: RankProgress,
    loading: bool,
    warm: bool = False,
    running: str | None = None,
) -> str:
    """A rank's process ended with `exitcode` (negative: the signal) before the job did;
    `warm`: the rank had loaded before (a reload), so it did start; `running`: the command
    it was running, if any."""
    how = f"signal {-exitcode}" if exitcode < 0 else f"exit code {exitcode}"
    if exitcode == -9:  # tpviz kills a rank only once the job has ended: not judged then
        how = "SIGKILL, from outside the job: kill -9, or the kernel as memory ran out"
    where = progress.module
    doing = f" while loading {where}" if where and loading else ""
    if not progress.phase_times:
        doing = " between loads" if warm else UNGUARDED_SCRIPT
    elif not loading:
        doing = f" while running {running}" if running else " after loading"
    return f"rank {rank} died ({how}){doing}"


def silence_message(rank: int, silence: float, progress: RankProgress, running: str | None) -> str:
    """A rank sent nothing, not even a heartbeat, for `silence` seconds."""
    if running:
        doing = f"while running {running}"
    elif progress.phase == RankPhase.LOADED:
        doing = "while waiting for commands"
    else:
        doing = f"during {progress.phase}"
        if progress.phase == RankPhase.LOADING and progress.module:
            doing += f" of {progress.module}"
    return (
        f"rank {rank} stopped responding (no heartbeat for {silence:.0f} s) {doing}; "
        "it was ended with the job"
    )


def timeout_message(timeout: float, ranks: dict[int, RankProgress]) -> str:
    """The load outlived `timeout`: where each rank that had not loaded was."""
    behind = _behind(ranks)
    where = f": {behind}" if behind else ""
    return f"the load did not finish within its timeout ({timeout:g} s){where}"


def files_silence_message(seconds: float, directory: str, ranks: dict[int, RankProgress]) -> str:
    """No events file in `directory` has grown for `seconds`: where each rank not done was."""
    if not ranks:
        return f"nothing written to {directory} in {seconds:.0f} s: has the job started?"
    behind = _behind(ranks)
    where = f" ({behind})" if behind else ""
    return (
        f"no rank has written an event for {seconds:.0f} s{where}: a rank "
        "that was killed writes nothing more, so the job may have ended; still following"
    )


def _behind(ranks: dict[int, RankProgress]) -> str:
    """Where each rank that had not loaded was, in one phrase ("" if none)."""
    behind = [f"rank {r} {_whereabouts(p)}" for r, p in sorted(ranks.items()) if not p.loaded]
    return ", ".join(behind)


def _whereabouts(progress: RankProgress) -> str:
    if progress.phase == RankPhase.LOADING and progress.module:
        units = f"unit {progress.units_done + 1} of {progress.units_total}"
        return f"was loading {progress.module} ({units})"
    if progress.first_heard is None and not progress.phase_times:
        return "had not started"
    return f"was in {progress.phase}"


def server_lost_message() -> str:
    """The rank server ended (killed) while the ranks it forked still ran: their exit
    status can no longer be told (multiprocessing reports exit code 255)."""
    return (
        "tpviz's rank server (the forkserver) ended while its ranks ran, so they could no "
        "longer be watched; the job was ended, and the next launch starts a new server"
    )


def unforked_message(rank: int, seconds: float, heartbeat_timeout: float) -> str:
    """tpviz's rank server (multiprocessing's forkserver) had not forked `rank` `seconds`
    (twice `heartbeat_timeout`) after the launch: it is stopped, stuck or starved, or the
    timeout is shorter than a fork takes here."""
    return (
        f"rank {rank} was not started: tpviz's rank server (the forkserver) had not forked it "
        f"{seconds:.2g} s after the launch (twice heartbeat_timeout, {heartbeat_timeout:g} s; "
        "a larger one allows a slow start more); the server was ended with the job, and the "
        "next launch starts a new one"
    )


def straggler_message(rank: int, command: str, seconds: float) -> str:
    """`rank` had not finished `command` `seconds` after every other rank had."""
    return (
        f"rank {rank} was still running {command} {seconds:.0f} s after the other ranks had "
        "finished it: waiting in a collective they never entered (or working that much longer "
        "alone; a larger heartbeat_timeout allows more); the job was ended"
    )


def unfinished(
    replies: Mapping[int, Reply], world: int, command: str, seconds: float
) -> tuple[int, str] | None:
    """For a command not every rank finished (`replies`, by rank, came within `seconds` of
    each other): the rank to blame and why. A rank that failed it is the cause (its peers wait
    in a collective it never reached); else the lowest rank that did not reply."""
    if len(replies) == world:
        return None
    failed = next((rank for rank in sorted(replies) if not replies[rank].ok), None)
    if failed is not None:
        peers = "the other ranks wait in a collective it never reached; the job was ended"
        return failed, f"{replies[failed].payload} ({peers})"
    late = min(set(range(world)) - set(replies))
    return late, straggler_message(late, command, seconds)


def broken_group_message(error: Exception, check: str) -> str:
    """A command failed (`error`) and left the process group unusable (`check`: what the
    barrier after it said)."""
    return (
        f"{error}; the process group no longer works after it ({check}), so the job was ended: "
        "launch a new one"
    )


def check_seconds(
    name: str, value: float | None, optional: bool = True, zero: bool = False
) -> None:
    """A duration argument: a number of seconds in (0, MAX_SECONDS] (from 0 where `zero`;
    not a bool; NaN and infinity fail too), or None where `optional`."""
    if value is None and optional:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and (value >= 0 if zero else value > 0) and value <= MAX_SECONDS):
        raise ValueError(
            f"{name} must be a {'' if zero else 'positive, '}finite number of seconds, at most "
            f"{MAX_SECONDS} (30 days){', or None' if optional else ''}, not {value!r}"
        )
