"""Whether this machine can run a CPU load's ranks at all: each rank is a process with torch
imported and a process group joined before it holds a byte of the model, so its count is
bounded by memory and by the process limit, not by the number of cores.

Measured here (torch 2.13 CPU build, built-in Llama, tiny checkpoint, 2 and 8 ranks on 2
cores): before loading, a rank holds 214 MiB of private memory (USS; 299 MiB resident, the
difference being torch's shared libraries, counted in every rank's RSS but held once) and runs
6 threads. Ranks of transformers models hold more, so these figures are a floor: a count they
refuse cannot run.
"""

from __future__ import annotations

import os

import psutil

from .format import human_bytes

RANK_PRIVATE_BYTES = 214 * 1024**2
RANK_TASKS = 6  # threads per rank; RLIMIT_NPROC counts threads


def free_task_slots() -> int | None:
    """Processes and threads this user may still start under RLIMIT_NPROC; None where no such
    limit applies (none set, or root, whom the kernel exempts)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft == resource.RLIM_INFINITY or os.geteuid() == 0:
        return None
    uid = os.getuid()
    used = 0
    for proc in psutil.process_iter(["uids", "num_threads"]):
        uids = proc.info["uids"]
        if uids is not None and uids.real == uid:
            used += proc.info["num_threads"] or 0
    return soft - used


def host_shortfall(
    world_size: int,
    strategy: str,
    peak_bytes: list[int],
    available: int,
    task_slots: int | None,
) -> str | None:
    """Why `world_size` CPU ranks with these forecast peaks cannot run here, or None."""
    others = "the sliced strategy, fewer ranks" if strategy != "sliced" else "fewer ranks"
    advice = f"Use {others}, or force=True (--force) to try anyway"
    if task_slots is not None and world_size * RANK_TASKS > task_slots:
        return (
            f"{world_size} ranks need about {world_size * RANK_TASKS} processes and threads "
            f"({RANK_TASKS} per rank); the process limit (ulimit -u) leaves {task_slots}: at most "
            f"{max(task_slots // RANK_TASKS, 0)} ranks fit. {advice}"
        )
    forecast = sum(peak_bytes)
    need = forecast + world_size * RANK_PRIVATE_BYTES
    if need <= available:
        return None
    fit = (available - forecast) // RANK_PRIVATE_BYTES
    hint = f" At most about {fit} ranks fit." if fit > 0 else ""
    return (
        f"{strategy} needs about {human_bytes(need)} of host RAM for {world_size} ranks "
        f"(forecast peak {human_bytes(max(peak_bytes))} per rank, plus "
        f"{human_bytes(RANK_PRIVATE_BYTES)} per rank for the process itself: torch and the "
        f"process group); {human_bytes(available)} is available.{hint} {advice}"
    )
