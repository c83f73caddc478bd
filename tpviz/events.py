"""Events: the wire format between ranks and viewers.

Picklable dataclasses; on disk one JSON object a line, `rank{r}.jsonl` in an events dir. Every
event has `v` (format version), `type`, `rank` and `t` (Unix time, seconds).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import MISSING, asdict, dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import IO, Any, ClassVar

from .outputs import OutputPathError

VERSION = 1
LAUNCHER_RANK = -1  # the `rank` of the events the launcher itself makes (its job's states)
JOB_ENDED = "the job ended: "  # how the launcher's end of a rank's file begins
BUSY = "is being written by another running load; give each load its own events dir"


class RankPhase(StrEnum):
    """The `name` of a rank's `phase` events, in the order a rank passes them."""

    STARTING = "starting"  # the rank's imports are done
    SKELETON = "skeleton"  # the process group is up; building the meta skeleton
    READY = "ready"  # skeleton and styles in place: waiting for the others to start loading
    LOADING = "loading"
    CHECKING = "checking"  # real shards against the plan
    LOADED = "loaded"


class JobState(StrEnum):
    """A LoadJob's state; each change is also a `phase` event of rank LAUNCHER_RANK."""

    STARTING = "starting"
    VERIFYING = "verifying"
    LOADED = "loaded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    CLOSING = "closing"
    CLOSED = "closed"

    @property
    def ended(self) -> bool:
        """No more commands can run: the ranks are gone or going."""
        return self in (JobState.FAILED, JobState.CANCELLED, JobState.CLOSING, JobState.CLOSED)

    @property
    def finished(self) -> bool:
        """The load itself is over, one way or another."""
        return self is JobState.LOADED or self.ended


@dataclass
class Event:
    type: ClassVar[str] = "event"
    rank: int
    t: float
    v: int = field(default=VERSION, kw_only=True)

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": self.v,
            "type": self.type,
            **{k: v for k, v in asdict(self).items() if k != "v"},
        }


@dataclass
class Phase(Event):
    type: ClassVar[str] = "phase"
    name: str


@dataclass
class UnitStart(Event):
    type: ClassVar[str] = "unit_start"
    module: str
    bytes: int  # bytes this rank will hold for the unit
    index: int  # 0-based position among the units
    total: int  # number of units


@dataclass
class UnitDone(Event):
    type: ClassVar[str] = "unit_done"
    module: str
    bytes: int
    seconds: float
    index: int
    total: int


@dataclass
class Memory(Event):
    type: ClassVar[str] = "memory"
    rss: int
    rss_anon: int | None
    tensor_bytes: int
    cuda_allocated: int | None = None
    cuda_reserved: int | None = None


@dataclass
class Error(Event):
    type: ClassVar[str] = "error"
    message: str
    module: str | None = None
    file: str | None = None
    traceback: str = ""


@dataclass
class Done(Event):
    type: ClassVar[str] = "done"
    result: dict[str, Any]  # the rank's entry of the load JSON


EVENT_TYPES: dict[str, type[Event]] = {
    cls.type: cls for cls in (Phase, UnitStart, UnitDone, Memory, Error, Done)
}


def from_dict(data: Any) -> Event:
    """The event a JSON object describes; ValueError, saying why, for anything else (a file
    written by something other than tpviz must not break its followers)."""
    if not isinstance(data, dict):
        raise ValueError(f"an event is a JSON object, not {type(data).__name__}")
    cls = EVENT_TYPES.get(data.get("type", ""))
    if cls is None:
        raise ValueError(f"unknown event type {data.get('type')!r}")
    if data.get("v") != VERSION:
        raise ValueError(f"event format version {data.get('v')!r}; this tpviz reads {VERSION}")
    for f in fields(cls):
        required = f.default is MISSING and f.default_factory is MISSING
        if f.name in data or required:
            _check_field(cls.type, f.name, str(f.type), data.get(f.name, MISSING))
    return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


# a field's annotation -> the JSON values it takes (bool is not a number here)
_KINDS = {"int": (int,), "float": (int, float), "str": (str,), "dict[str, Any]": (dict,)}


def _check_field(kind: str, name: str, annotation: str, value: Any) -> None:
    """One field of a `kind` event: present, of its annotated kind, and a count, size or time
    not below zero (a rank number not below LAUNCHER_RANK)."""
    optional = annotation.endswith(" | None")
    allowed = _KINDS[annotation.removesuffix(" | None")]
    if value is None and optional:
        return
    if value is MISSING or isinstance(value, bool) or not isinstance(value, allowed):
        shown = "missing" if value is MISSING else json.dumps(value)[:40]
        raise ValueError(f"{kind} event: {name} is {shown}, not {annotation}")
    low = LAUNCHER_RANK if name == "rank" else 0
    if isinstance(value, (int, float)) and not low <= value < math.inf:
        raise ValueError(f"{kind} event: {name} is {value}, below {low} or not finite")


def encode(event: Event) -> str:
    return json.dumps(event.to_dict(), separators=(",", ":"))


def decode(line: str) -> Event:
    return from_dict(json.loads(line))


def events_file(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.jsonl"


RANK_FILE = re.compile(r"rank(\d+)\.jsonl")  # the name of a rank's file, as events_file makes it


def rank_files(directory: str | os.PathLike) -> dict[int, Path]:
    """The `rank{r}.jsonl` files of an events dir by rank, in rank order."""
    found = ((RANK_FILE.fullmatch(p.name), p) for p in Path(directory).glob("rank*.jsonl"))
    return dict(sorted((int(m.group(1)), p) for m, p in found if m))


def check_apart_from_events(
    path: str | os.PathLike, what: str, events_dir: str | os.PathLike | None
) -> None:
    """Refuse an output where an events dir holds a rank's file (`rank{r}.jsonl`, at any depth:
    compare writes a dir per strategy), or a file at the events dir's own path: each would
    overwrite the other. Beside the rank files, in the same dir, is fine."""
    if not events_dir:
        return
    out, events = Path(path).expanduser().absolute(), Path(events_dir).expanduser().absolute()
    if (out == events and what == "report") or (
        events in out.parents and RANK_FILE.fullmatch(out.name)
    ):
        raise OutputPathError(
            f"{what} {out} is where the events dir {events} keeps a rank's events; give the "
            f"{what} another path"
        )


def hold_while_writing(file: IO) -> None:
    """Take the lock a rank holds on its events file while it writes it (until its `done`,
    or its end), so that another load is refused the same dir; OSError (EBUSY) if another
    running load holds it. Where the file system has no locks, nothing is held."""
    if _held_elsewhere(file.fileno()):
        raise OSError(errno.EBUSY, BUSY)


def _held_elsewhere(fd: int) -> bool:
    """Take the file's lock without waiting (it goes with the descriptor); whether another
    open file holds it. False where the file system has no locks (some network ones)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        pass
    return False


def _being_written(path: Path) -> bool:
    try:  # without waiting: a FIFO would wait for a writer (a rank refuses it as its file)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:  # gone meanwhile
        return False
    try:
        return _held_elsewhere(fd)
    finally:
        os.close(fd)


def check_rank_files(directory: str | os.PathLike, beyond: int = 0) -> None:
    """Refuse an events dir whose rank files a load cannot take (OutputPathError, naming
    them): a directory in a rank file's place (no rank can write it, nor a load remove it), or
    rank 0's file or one of rank `beyond` and up that a running load writes (two loads in one
    dir would mix their events in one file; rank 0's is checked whatever `beyond` is, as every
    load has one)."""
    files = rank_files(directory)
    dirs = [p.name for p in files.values() if p.is_dir()]
    if dirs:
        raise OutputPathError(
            f"events dir {directory}: {', '.join(dirs)} is a directory, where a rank writes "
            "its events; remove it or give another events dir"
        )
    busy = [
        p.name for rank, p in files.items() if (rank >= beyond or rank == 0) and _being_written(p)
    ]
    if busy:
        raise OutputPathError(f"events dir {directory}: {', '.join(busy)} {BUSY}")


def remove_rank_files(directory: str | os.PathLike, beyond: int = 0) -> None:
    """Remove an earlier load's files of ranks `beyond` and up before a load writes its own:
    an events dir holds one load, so that a follower never reads the last run's `done` (or a
    rank the new load does not have) as this one's. Other files are left alone; a file that
    cannot be removed is reported by the rank that then cannot write it."""
    for rank, path in rank_files(directory).items():
        if rank >= beyond:
            with contextlib.suppress(OSError):
                path.unlink()


class JsonlTail:
    """Follows the `rank*.jsonl` files of an events dir, returning complete new lines. A file
    begun again by a new load is read again from its start: another inode, a shorter file, or
    (emptied in place, as `load_sharded`'s ranks do, and grown past where it was read) another
    first line, whose first event carries the load's start time. A file that is not a regular
    file, or a whole line that is not a tpviz event, raises a ValueError naming the file (and
    line)."""

    HEAD_BYTES = 64  # of a file's first line: the first event's time is within them

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._read: dict[Path, tuple[int, int, bytes]] = {}  # path -> (inode, offset, head)
        self._partial: dict[Path, bytes] = {}  # a line still being written
        self._lines: dict[Path, int] = {}  # whole lines read

    def read_new(self) -> list[Event]:
        out: list[Event] = []
        for path in rank_files(self.directory).values():
            chunk = self._new_bytes(path)
            if chunk is None:
                continue
            *whole, rest = (self._partial.pop(path, b"") + chunk).split(b"\n")
            if rest:
                self._partial[path] = rest
            first = self._lines.get(path, 0)
            self._lines[path] = first + len(whole)
            lines = [_text(line, path, first + i + 1) for i, line in enumerate(whole)]
            out.extend(_whole_events(lines, path, first))
        out.sort(key=lambda e: e.t)
        return out

    def _new_bytes(self, path: Path) -> bytes | None:
        """What `path` holds past what was read (None: removed since it was listed)."""
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block the open
                raise ValueError(f"{path}: an events file must be a regular file")
            f = open(path, "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:  # removed by a new load since it was listed
            return None
        with f:
            info = os.fstat(f.fileno())
            known, offset, head = self._read.get(path, (info.st_ino, 0, b""))
            if known != info.st_ino or offset > info.st_size or f.read(len(head)) != head:
                offset = 0  # a new file, or one begun again
                self._partial.pop(path, None)
                self._lines.pop(path, None)
                head = b""
            f.seek(offset)
            chunk = f.read()
            end = f.tell()
            if len(head) < self.HEAD_BYTES:  # once whole, it stays what it was
                f.seek(0)
                head = f.read(self.HEAD_BYTES)
            self._read[path] = (info.st_ino, end, head)
        return chunk


def _text(line: bytes, path: Path, number: int) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} line {number}: not UTF-8 text (byte {e.start})") from None


def _whole_events(lines: list[str], path: Path | None = None, first: int = 0) -> Iterator[Event]:
    """The events of whole lines (of `path`, from line `first` + 1); a line that is not JSON
    was cut off by a rank that was killed as it wrote it, and ended by the launcher
    (`end_rank_files`): it is skipped. JSON that is not an event raises, naming the line."""
    for number, line in enumerate(lines, start=first + 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except ValueError:
            continue
        except RecursionError:
            raise ValueError(f"{path} line {number}: JSON nested too deeply") from None
        try:
            yield from_dict(data)
        except ValueError as e:
            raise ValueError(f"{path} line {number}: {e}") from None


def read_events_dir(directory: str | os.PathLike) -> list[Event]:
    """Every event in an events dir, ordered by time."""
    return JsonlTail(directory).read_new()


def end_rank_files(
    directory: str | os.PathLike,
    modules: list[str | None],
    why: str,
    t: float,
    cause: int | None = None,
) -> None:
    """End each rank's file of a load that stopped before the rank wrote its `done` (a cancel,
    a peer's death, a timeout: the launcher ended it, and an ended rank writes nothing of it)
    with an `error` saying `why`, at the module it was in (`modules`, by rank), so that a
    follower of the dir sees the job end rather than files that stop growing. A rank's own
    `error` ends its file only when it is the job's (`cause`, the rank that failed it); one
    written after a peer died (its collective broken) gets the job's end after it, so that a
    follower names the cause, not the consequence. A line the rank was cut off in is ended
    first (readers skip it); a file that cannot be written or read is left as it is. The dir
    is made if no rank had made it yet."""
    with contextlib.suppress(OSError):
        os.makedirs(directory, exist_ok=True)
    for rank, module in enumerate(modules):
        path = events_file(directory, rank)
        with contextlib.suppress(OSError, ValueError), open(path, "a+b") as f:
            f.seek(0)
            lines = f.read().decode("utf-8", "replace").split("\n")
            if _has_ended(lines, own_error_ends=rank == cause):
                continue
            ended = Error(rank, t, message=f"{JOB_ENDED}{why}", module=module)
            f.write((("\n" if lines[-1] else "") + encode(ended) + "\n").encode())


def _has_ended(lines: list[str], own_error_ends: bool) -> bool:
    """Whether a rank's file holds its `done`, the launcher's end, or (`own_error_ends`) an
    `error` of its own (a memory sample may follow any of them)."""
    for e in _whole_events(lines):
        if isinstance(e, Done):
            return True
        if isinstance(e, Error) and (own_error_ends or e.message.startswith(JOB_ENDED)):
            return True
    return False
