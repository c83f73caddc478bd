"""Memory inside one rank: resident set readings, the kernel's peak, and a sampler thread."""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable

import psutil
import torch

from ..events import Memory
from ..strategies import Ledger
from ..syscalls import madvise

MADV_POPULATE_WRITE = 23  # Linux 5.14+
PREFAULT_MIN_BYTES = 1 << 20
_populate = True  # until the kernel refuses MADV_POPULATE_WRITE


def prefault(tensor: torch.Tensor) -> None:
    """Fault in a fresh CPU tensor's pages with one madvise(MADV_POPULATE_WRITE) call rather
    than one page fault per 4 KiB page as a read first writes them (about a third faster for
    large reads here). A no-op for small tensors and where the kernel lacks it."""
    global _populate
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or nbytes < PREFAULT_MIN_BYTES or not _populate:
        return
    start = -(-tensor.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (tensor.data_ptr() + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start and not madvise(start, end - start, MADV_POPULATE_WRITE):
        _populate = False  # not supported here: stop trying


def _status_bytes(field: str) -> int | None:
    """A `kB` field of /proc/self/status in bytes, where the OS has it."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def resident() -> tuple[int, int | None]:
    """(resident set, its anonymous part: not file-backed or shared) of this process, in
    bytes, from one read of /proc/self/statm: a few microseconds, where psutil and
    /proc/self/status together took about 45, once per module of a load. Where the OS has no
    /proc, psutil's resident set alone."""
    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
    except OSError:
        return psutil.Process().memory_info().rss, None
    try:
        fields = os.read(fd, 256).split()
    finally:
        os.close(fd)
    # statm's "shared" counts file-backed and shmem pages (Linux 4.5+), so the rest is anon
    resident, shared = int(fields[1]) * mmap.PAGESIZE, int(fields[2]) * mmap.PAGESIZE
    return resident, resident - shared


def kernel_peak_rss() -> int | None:
    """VmHWM: the peak resident set since the last reset."""
    return _status_bytes("VmHWM")


def reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark of resident memory (Linux `clear_refs` 5)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRss:
    """Peak resident set during a span, minus the resident set when it began.

    Uses the kernel's high-water mark where it can be reset, so short spikes between samples
    count; elsewhere the largest sample seen.
    """

    def __init__(self) -> None:
        self.baseline = resident()[0]
        self._kernel = reset_peak_rss()
        self._sampled = self.baseline

    def observe(self, rss: int) -> None:
        self._sampled = max(self._sampled, rss)

    def growth(self) -> int:
        peak = self._sampled
        if self._kernel:
            peak = max(peak, kernel_peak_rss() or 0)
        return max(0, peak - self.baseline)


class MemorySampler:
    """Samples memory at `rate_hz` in a daemon thread and on demand (`sample()` at unit
    boundaries); `on_tick` runs after each timed sample (the event sink flushes there)."""

    def __init__(
        self,
        rank: int,
        ledger: Ledger,
        emit: Callable[[Memory], None],
        rate_hz: float = 20.0,
        device: torch.device | None = None,
        on_tick: Callable[[], None] | None = None,
    ):
        self.rank = rank
        self.ledger = ledger
        self.emit = emit
        self.interval = 1.0 / rate_hz if rate_hz > 0 else None
        self.cuda = device if device is not None and device.type == "cuda" else None
        self.on_tick = on_tick
        self.peak: PeakRss | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> Memory:
        rss, anon = resident()
        if self.peak is not None:
            self.peak.observe(rss)
        allocated, reserved = _cuda_bytes(self.cuda) if self.cuda else (None, None)
        event = Memory(
            self.rank,
            time.time(),
            rss=rss,
            rss_anon=anon,
            tensor_bytes=self.ledger.current,
            cuda_allocated=allocated,
            cuda_reserved=reserved,
        )
        self.emit(event)
        return event

    def start(self) -> None:
        if self.interval is None:
            return
        self._thread = threading.Thread(
            target=self._run, name=f"tpviz-memory-{self.rank}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()
            if self.on_tick:
                self.on_tick()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def _cuda_bytes(device: torch.device) -> tuple[int, int]:
    """The caching allocator's allocated and reserved bytes on `device`. Read from the nested
    stats: `torch.cuda.memory_allocated` flattens every statistic first, about a millisecond
    a call, which at one sample per module was a third of a medium model's load on an H200."""
    stats = torch.cuda.memory_stats_as_nested_dict(device)  # empty before CUDA's first use

    def current(kind: str) -> int:
        return stats.get(kind, {}).get("all", {}).get("current", 0)

    return current("allocated_bytes"), current("reserved_bytes")
