"""Memory inside one rank: resident set readings, the kernel's peak, and a sampler thread."""

from __future__ import annotations

import ctypes
import errno
import math
import mmap
import os
import threading
import time
from collections.abc import Callable

import psutil
import torch

from ..events import Memory
from ..strategies import Ledger

MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux 5.14+
PREFAULT_MIN_BYTES = 1 << 20
HUGE_PAGE_SIZE_FILE = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"
_libc = None
_unsupported: set[int] = set()  # advice this kernel refused once: not asked again
_huge_page: int | None = None  # bytes of a transparent huge page; 0 where there are none


def fresh_tensor(shape: list[int] | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A new CPU tensor whose pages are ready for the read that fills it.

    Where the kernel has transparent huge pages, a tensor of at least one huge page gets its
    own private anonymous mapping, its start aligned to a huge page and marked MADV_HUGEPAGE:
    the read then faults it in 2 MiB at a time, each page zeroed just before it is filled (512
    times fewer faults than 4 KiB pages, and faster than populating huge pages ahead, whose
    zeroing leaves the cache cold; about 2x the rate of populated 4 KiB pages here). Huge
    pages lie only inside the tensor (the tail past the last whole one is populated as 4 KiB
    pages; the alignment slack before it is never touched), so its resident set is its bytes
    rounded up to 4 KiB, and unmapping it when it is freed returns them all. Smaller tensors,
    and all without huge pages, are populated with one MADV_POPULATE_WRITE call where the
    kernel has it, rather than a fault per 4 KiB page. Each advice is a hint: dropped where
    the kernel refuses it."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    huge = _huge_page_size()
    if not huge or nbytes < huge or not _load_libc():
        tensor = torch.empty(shape, dtype=dtype)
        if nbytes >= PREFAULT_MIN_BYTES:
            populate(tensor)
        return tensor
    # the tensor's storage holds the mapping; freeing the tensor unmaps it
    region = mmap.mmap(-1, nbytes + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(region, dtype=torch.uint8).data_ptr()
    offset = _round_up(base, huge) - base
    tensor = torch.frombuffer(region, dtype=dtype, count=numel, offset=offset).view(shape)
    start, end = _pages(tensor)
    whole = start + (end - start) // huge * huge
    if not _advise(start, whole, MADV_HUGEPAGE):
        whole = start
    _advise(whole, end, MADV_POPULATE_WRITE)
    return tensor


def populate(tensor: torch.Tensor) -> None:
    """Fault in all of a fresh CPU tensor's pages now (as 4 KiB pages unless it lies in a
    region marked for huge pages)."""
    if _load_libc():
        _advise(*_pages(tensor), MADV_POPULATE_WRITE)


def _pages(tensor: torch.Tensor) -> tuple[int, int]:
    """The whole pages inside a tensor's bytes: [start, end) addresses."""
    end = (tensor.data_ptr() + tensor.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    return _round_up(tensor.data_ptr(), mmap.PAGESIZE), end


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _load_libc() -> bool:
    global _libc
    if _libc is None:
        # the symbols already loaded into this process (libc's among them): find_library
        # would run ldconfig in a subprocess, tens of milliseconds inside the first load
        _libc = ctypes.CDLL(None, use_errno=True)
        if hasattr(_libc, "madvise"):
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        else:
            _libc = False
    return _libc is not False


def _advise(start: int, end: int, advice: int) -> bool:
    """madvise(start, end - start, advice) on whole pages; False if empty or refused."""
    if end <= start or advice in _unsupported:
        return False
    if _libc.madvise(start, end - start, advice) != 0:
        if ctypes.get_errno() == errno.EINVAL:
            _unsupported.add(advice)  # unknown to this kernel (older, or no THP): stop asking
        return False
    return True


def _huge_page_size() -> int:
    """Bytes of a transparent huge page, 0 where the kernel has none (or they are off)."""
    global _huge_page
    if _huge_page is None:
        try:
            with open(HUGE_PAGE_SIZE_FILE, encoding="ascii") as f:
                _huge_page = int(f.read())
            with open(os.path.dirname(HUGE_PAGE_SIZE_FILE) + "/enabled", encoding="ascii") as f:
                if "[never]" in f.read():
                    _huge_page = 0
        except (OSError, ValueError):
            _huge_page = 0
    return _huge_page


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


def rss_anon() -> int | None:
    """Anonymous resident bytes (not file-backed pages)."""
    return _status_bytes("RssAnon")


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
        self._process = psutil.Process()
        self.baseline = self._process.memory_info().rss
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
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> Memory:
        rss = self._process.memory_info().rss
        if self.peak is not None:
            self.peak.observe(rss)
        event = Memory(
            self.rank,
            time.time(),
            rss=rss,
            rss_anon=rss_anon(),
            tensor_bytes=self.ledger.current,
            cuda_allocated=torch.cuda.memory_allocated(self.cuda) if self.cuda else None,
            cuda_reserved=torch.cuda.memory_reserved(self.cuda) if self.cuda else None,
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
