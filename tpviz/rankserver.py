"""The rank server: the forkserver ranks are forked from.

Ranks start from multiprocessing's forkserver with torch and tpviz's rank code preloaded
(`start_server`): each rank is a fork of a process that has imported them and done nothing
else, so it pays no import. This is as safe as `spawn` for what fork usually breaks: the
server is a fresh interpreter (started by exec, not forked from this process, so none of its
threads, locks, OpenMP pools or CUDA context), preloading only imports modules (no torch op
runs there, so no intra-op or OpenMP thread pool exists to be forked, and CUDA is never
initialised), and its only thread is the one that forks. Each rank still imports the caller's
`__main__` as spawn does (hence the `__main__` guard), gets the caller's current environment
(with `RANK_ENVIRON`'s defaults, which the server also starts with), and watches its pipe to
this process rather than its parent (the server), see heartbeat.py.
The server's socket lives in multiprocessing's temp dir (`$TMPDIR/pymp-*`), which tpviz locks
like its own (tempdirs.py).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import signal
import tempfile
import threading
from collections.abc import Iterator, Sequence
from multiprocessing import forkserver
from pathlib import Path

from .choices import model_family
from .inputs import read_json
from .tempdirs import private_temp_dir

# what the forkserver imports before it forks ranks: torch, torch.distributed and the rank code.
# Not torch._dynamo: about a second more on every cold start's critical path, and a load never
# imports it (parallelize builds DTensors directly); a rank's first forward does.
PRELOAD = ["tpviz.runtime.worker"]
SOCKET_PATH_BYTES = 107  # a UNIX socket path's room on Linux (108 with its NUL)
# Defaults for the server's and the ranks' environment, where the caller has not set them.
# THP_MEM_ALLOC_ENABLE=1 makes torch's CPU allocator (which reads it once) mark allocations of
# 2 MiB and more MADV_HUGEPAGE, so a shard's fresh memory faults in 2 MiB at a time rather
# than 4 KiB: loads 1.3-4x faster on the machines tpviz is built on (README, "Huge pages").
# A caller's own value wins (0 turns it off).
RANK_ENVIRON = {"THP_MEM_ALLOC_ENABLE": "1"}
_server_lock = threading.Lock()
_server_started = False


def rank_imports(source: str | os.PathLike | None, model: str | None) -> list[str]:
    """What a rank of the model at `source` imports to build its skeleton, for the server to
    preload: transformers, and the model type's modeling module (a name that does not exist
    is skipped there), for a transformers model; nothing for tpviz's own Llama, and not a user
    factory's module (its import could start threads or CUDA). Read from config.json without
    importing torch; [] when it cannot tell (the load reports what is wrong with the source)."""
    if source is None:
        return []
    path = Path(source)
    try:
        config = read_json((path if path.is_dir() else path.parent) / "config.json", "config")
    except (OSError, ValueError):
        return []
    family = model_family(config, model) if isinstance(config, dict) else None
    if family not in ("hf", "hf-remote-code"):
        return []
    model_type = str(config.get("model_type") or "").replace("-", "_")
    if family == "hf-remote-code" or not model_type.isidentifier():
        return ["transformers"]  # remote code's own modules come from the checkpoint
    return ["transformers", f"transformers.models.{model_type}.modeling_{model_type}"]


def load_imports(source: str | os.PathLike | None, model: str | None) -> set[str]:
    """What a rank imports to load the model at `source`: `rank_imports`, and a factory's
    module (`pkg.mod` of `pkg.mod:fn`), which the server does not preload."""
    factory = model.partition(":")[0] if model and ":" in model else None
    return {*rank_imports(source, model), *([factory] if factory else [])}


def start_server(preload: Sequence[str] = ()) -> mp.context.BaseContext:
    """Start the forkserver ranks are forked from (once per process, or again after
    `stop_server`; at once, so that its imports overlap the caller's own work), preloading
    `preload` too (see `rank_imports`), and return its context."""
    global _server_started
    ctx = mp.get_context("forkserver")
    with _server_lock:
        if _server_started:
            return ctx
        ctx.set_forkserver_preload([*PRELOAD, *preload])
        # the server's socket (a path of at most ~107 bytes, so nothing is nested deeper) and
        # its own temp files (torch's inductor cache dir) go in this process's temp dir
        path = private_temp_dir()
        _check_socket_room(path)
        with _environ({**missing_defaults(), "TMPDIR": path}):
            forkserver.ensure_running()  # the server takes this process's environment now
        _server_started = True
        # Ended at exit before that temp dir is removed (atexit runs the latest first, and
        # multiprocessing registered its own removal at import): a server still importing
        # when a command fails early would make its cache dir there again, and outlive us.
        atexit.unregister(stop_server)
        atexit.register(stop_server)
    return ctx


def _check_socket_room(directory: str) -> None:
    """Refuse a temp dir too deep for the server's socket (`listener-` and 8 characters in
    it): a UNIX socket's path holds at most 107 bytes, and $TMPDIR sets where it goes."""
    length = len(os.fsencode(directory)) + len("/listener-") + 8
    if length > SOCKET_PATH_BYTES:
        raise ValueError(
            f"TMPDIR {tempfile.gettempdir()} is too long for the rank server's socket in it "
            f"({length} bytes of path, {SOCKET_PATH_BYTES} at most); set TMPDIR to a "
            "shorter dir, such as /tmp"
        )


def stop_server() -> None:
    """End the forkserver now, even a stopped or stuck one (SIGKILL), so that a rank start
    waiting on it returns; the next `start_server` starts a fresh one. The server's pid and
    `_stop` (which reaps it and removes its socket) are multiprocessing's own, unexported."""
    global _server_started
    with _server_lock:
        server = forkserver._forkserver
        pid = server._forkserver_pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            server._stop()
        _server_started = False


def server_lost(pid: int, exitcode: int) -> bool:
    """Whether a rank reported ended (`exitcode`) runs on: its server was killed, and with it
    the rank's real status (multiprocessing then reports exit code 255)."""
    if exitcode != 255:
        return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def missing_defaults() -> dict[str, str]:
    """`RANK_ENVIRON`'s defaults that this process's environment has no value for."""
    return {name: value for name, value in RANK_ENVIRON.items() if name not in os.environ}


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """This process's environment with `values` set, restored afterwards (what
    `unittest.mock.patch.dict` does, whose import costs the CLI's start about 60 ms)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
