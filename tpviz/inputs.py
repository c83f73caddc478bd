"""Files a user hands tpviz (config.json, plans, indexes, shards): checked before they are read.

Only regular files are opened: a FIFO or a device named as config.json or as a shard would
block a read forever. A path that cannot be used (missing, a symlink loop, unreadable) and a
JSON file that cannot be parsed (not UTF-8, not JSON, nested too deeply, a key given twice)
become one-line errors naming the file, never a Python error from deep inside a parser.
Paths and world sizes given in Python are checked for their kind here too.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from numbers import Integral
from pathlib import Path
from typing import Any

# config.json, plan and index files are kilobytes to a few megabytes
MAX_JSON_BYTES = 64 * 1024 * 1024


class InputFileError(ValueError):
    """A file tpviz was given cannot be used; the message names it."""

    def __init__(self, message: str, file: str | None = None):
        super().__init__(message)
        self.file = file


def stat_path(
    path: str | os.PathLike, what: str, error: type[InputFileError] = InputFileError
) -> os.stat_result:
    """`os.stat(path)` (following symlinks), with a failure said in words."""
    try:
        return os.stat(path)
    except OSError as e:
        if e.errno == errno.ENOENT:
            reason = "no such file or directory"
        elif e.errno == errno.ELOOP:
            reason = "a symlink loop (a link that points back to itself)"
        else:
            reason = e.strerror or type(e).__name__
        raise error(f"{path}: cannot use it as the {what}: {reason}", str(path)) from None


def check_path_argument(name: str, value: Any, what: str) -> None:
    """A path given in Python must be a str or os.PathLike: `os.stat(5)` would read file
    descriptor 5, and None or bytes would fail deep inside pathlib."""
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise ValueError(f"{name} must be {what}, not {value!r}")


def check_world_size(world_size: Any) -> int:
    """A world size given in Python: a positive integer (a numpy one too), as an int."""
    if isinstance(world_size, bool) or not isinstance(world_size, Integral) or world_size < 1:
        raise ValueError(f"world size must be a positive integer, got {world_size!r}")
    return int(world_size)


def regular_file(
    path: str | os.PathLike, what: str, error: type[InputFileError] = InputFileError
) -> os.stat_result:
    """The stat of `path` if it is a regular file (after symlinks); an error otherwise."""
    st = stat_path(path, what, error)
    if not stat.S_ISREG(st.st_mode):
        raise error(
            f"{path}: the {what} must be a regular file, but this is {_kind(st.st_mode)}",
            str(path),
        )
    return st


def _kind(mode: int) -> str:
    kinds = {
        stat.S_ISDIR: "a directory",
        stat.S_ISFIFO: "a FIFO (named pipe)",
        stat.S_ISSOCK: "a socket",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
    }
    return next((name for test, name in kinds.items() if test(mode)), "not a regular file")


def read_json(
    path: str | os.PathLike,
    what: str,
    error: type[InputFileError] = InputFileError,
    unique_keys: bool = False,
) -> Any:
    """The JSON value in the regular file `path` (the `what`, for messages)."""
    size = regular_file(path, what, error).st_size
    if size > MAX_JSON_BYTES:
        raise error(
            f"{path}: {size} bytes is too large for a {what} (limit {MAX_JSON_BYTES})", str(path)
        )
    return parse_json(Path(path).read_bytes(), str(path), what, error, unique_keys)


def parse_json(
    data: bytes,
    where: str,
    what: str,
    error: type[InputFileError] = InputFileError,
    unique_keys: bool = False,
) -> Any:
    """Parse UTF-8 JSON read from `where`. `unique_keys` refuses a key given twice in one
    object (for data where either value could be the one meant: a tensor's bytes, a plan, a
    model's size)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{where}: the {what} is not UTF-8 text (byte {e.start})", where) from None
    try:
        return json.loads(text, object_pairs_hook=_unique_object if unique_keys else None)
    except json.JSONDecodeError as e:
        raise error(f"{where}: the {what} is not valid JSON ({e})", where) from None
    except RecursionError:
        raise error(f"{where}: the {what} is JSON nested too deeply to be real", where) from None
    except _DuplicateKey as e:
        raise error(f"{where}: the {what} gives key {e.key!r} twice", where) from None


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        self.key = key


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out
