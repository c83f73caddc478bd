"""The temp dirs tpviz owns, and what keeps others' files out of $TMPDIR.

A job's temp dir (`$TMPDIR/tpviz-<pid>-*`: the rendezvous file, and the ranks' own $TMPDIR)
and multiprocessing's temp dir of this process (`$TMPDIR/pymp-*`: the rank server's socket,
torch's inductor cache) are locked with `flock` for as long as their owner lives, so a later
launcher can prove a dir stale (its lock is free: the owner was killed with SIGKILL) and
remove it. Standard library only: the model layer calls `keep_torch_cache_out_of_tmpdir`
before it imports transformers.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import threading
from multiprocessing import util as mp_util

PREFIX = "tpviz-"
LOCK = "owner.lock"
MP_PREFIX = "pymp-"  # multiprocessing's temp dir: ours to remove when it holds our lock
_temp_dir_locked = False  # tried once per process: the fd that holds it stays open for life
_temp_dir_guard = threading.Lock()


def remove_stale_workdirs() -> None:
    """Remove tpviz temp dirs whose owner is gone: only those whose lock can be taken."""
    root = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(root) if n.startswith((PREFIX, MP_PREFIX))]
    except OSError:
        return
    for name in names:
        path = os.path.join(root, name)
        try:
            fd = os.open(os.path.join(path, LOCK), os.O_RDONLY)
        except OSError:  # not ours, or not (yet) locked: stale only if its maker is gone
            if _maker_is_gone(name):  # empty until its lock file is made: else not ours
                with contextlib.suppress(OSError):
                    os.rmdir(path)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass  # its launcher is alive
        finally:
            os.close(fd)


def _maker_is_gone(name: str) -> bool:
    """Whether the launcher named in a workdir's name (`tpviz-<pid>-*`) no longer runs: it
    was killed between making the dir and locking it (a reused pid only keeps the dir)."""
    pid = name[len(PREFIX) :].partition("-")[0]
    if not name.startswith(PREFIX) or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        pass
    return False


def private_temp_dir() -> str:
    """This process's temp dir: multiprocessing's, which it removes at exit, locked like a
    workdir so that the next launcher removes it if this process was killed."""
    global _temp_dir_locked
    path = mp_util.get_temp_dir()
    with _temp_dir_guard:
        if not _temp_dir_locked:
            _temp_dir_locked = True
            _lock_for_life(os.path.join(path, LOCK))
    return path


def _lock_for_life(lock: str) -> None:
    """Hold `lock` for as long as this process lives (the fd stays open), unless another
    process holds it: a forked rank's temp dir can be the one its launcher made and locked,
    and waiting for that lock would hang the rank for the launcher's whole life."""
    fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)


def keep_torch_cache_out_of_tmpdir() -> None:
    """torch._dynamo (imported by transformers' model classes, and by a first forward through
    DTensor) makes its cache dir in $TMPDIR as it is imported, and nothing removes it: this
    process's goes into its private temp dir instead, removed at exit (the forkserver's goes
    there too, see start_server), unless the caller chose a cache dir."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(private_temp_dir(), "torchinductor")
