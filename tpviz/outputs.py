"""Output paths (events and profile dirs, report files): checked before any rank starts, written
so that a failed write names its path and leaves no half-written file behind.

tpviz never writes into a checkpoint: an output path inside the checkpoint's directory, or one
that resolves (through links) to one of its files, is refused. Whether a disk has room cannot
be known beforehand; a write that fails during the run is reported with its path, beside the
load result rather than instead of it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from .inputs import check_path_argument


class OutputPathError(ValueError):
    """An output path tpviz cannot or must not write; the message names the path."""


class OutputWriteError(OSError):
    """Writing an output failed (a full disk, a file too large); the message names the path."""

    def __init__(self, path: str | os.PathLike, reason: str):
        super().__init__(f"could not write {path}: {reason}")
        self.path, self.reason = str(path), reason


def _checkpoint_paths(source: str | os.PathLike) -> list[Path]:
    """The checkpoint's directory and, resolved through links, every entry in it."""
    directory = Path(os.path.realpath(source))
    if not directory.is_dir():
        directory = directory.parent
    paths = [directory]
    if directory.is_dir():
        paths += [Path(os.path.realpath(p)) for p in directory.iterdir()]
    return paths


def _refuse_checkpoint(out: Path, what: str, source: str | os.PathLike) -> None:
    real = Path(os.path.realpath(out))
    for protected in _checkpoint_paths(source):
        if real == protected or real.is_relative_to(protected):
            raise OutputPathError(
                f"{what} {out} would write into the checkpoint ({protected}); tpviz never writes "
                "there: choose a path outside it"
            )


def _refuse_uncreatable(out: Path, what: str) -> None:
    """`out` does not exist: its nearest existing ancestor must be a writable directory."""
    if out.is_symlink():
        raise OutputPathError(f"{what} {out} is a link to a missing path; pick another")
    ancestor = out.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputPathError(f"{what} {out} cannot be created: {ancestor} is a file")
    if not _writable(ancestor):
        raise OutputPathError(f"{what} {out} cannot be created: {ancestor} is not writable")


def _writable(directory: Path) -> bool:
    """Whether a file can be made in `directory`, found by making (and removing) one:
    permission bits do not tell for root, read-only mounts or /proc."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".tpviz-probe-", dir=directory)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def check_output_dir(path: str | os.PathLike, what: str, source: str | os.PathLike) -> str:
    """The absolute path of an output directory that is writable or can be created; raises
    OutputPathError otherwise. `what` names it in messages ("events dir"); `source` is the
    checkpoint it must stay out of."""
    check_path_argument(what.replace(" ", "_"), path, "a directory's path (str or os.PathLike)")
    out = Path(path).expanduser().absolute()
    _refuse_checkpoint(out, what, source)
    if not out.exists():
        _refuse_uncreatable(out, what)
    elif not out.is_dir():
        raise OutputPathError(f"{what} {out} is a file, not a directory; give a directory")
    elif not _writable(out):
        raise OutputPathError(f"{what} {out} is not writable")
    return str(out)


def check_output_file(path: str | os.PathLike, what: str, source: str | os.PathLike) -> str:
    """The absolute path of an output file that can be written (created or replaced) in an
    existing directory; raises OutputPathError otherwise."""
    check_path_argument(what.replace(" ", "_"), path, "a file's path (str or os.PathLike)")
    out = Path(path).expanduser().absolute()
    _refuse_checkpoint(out, what, source)
    if out.is_dir():
        raise OutputPathError(f"{what} {out} is a directory; give a file name")
    if out.exists() and not out.is_file():
        raise OutputPathError(f"{what} {out} is not a regular file")
    parent = out.parent
    if not parent.is_dir():
        raise OutputPathError(f"{what} {out}: the directory {parent} does not exist")
    # the file is written beside itself and renamed over: the directory must be writable
    if not _writable(parent):
        raise OutputPathError(f"{what} {out}: the directory {parent} is not writable")
    return str(out)


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` whole or not at all: a failed write (a full disk) raises
    OutputWriteError naming the path and leaves any earlier file there untouched."""
    out = Path(path)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OutputWriteError(out, e.strerror or str(e)) from None
    return out


def write_error(what: str, path: str | os.PathLike, file: str | os.PathLike, reason: str) -> dict:
    """One entry of a load result's `output_errors`: `path` is the output as given (the
    events or profile dir, the report), `file` the file whose write failed."""
    return {"what": what, "path": str(path), "message": f"could not write {file}: {reason}"}


def collect_output_errors(ranks: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The ranks' output errors (events files, profiler traces), one entry per output: ranks
    writing to one full disk fail alike."""
    errors: dict[str, dict[str, str]] = {}
    for entry in ranks:
        found = list(entry.get("output_errors") or [])
        profile_error = (entry.get("profile") or {}).get("error")
        if profile_error:
            found.append(profile_error)
        for error in found:
            errors.setdefault(error["path"], error)
    return list(errors.values())
