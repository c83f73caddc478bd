"""C library calls that Python's os and mmap modules do not offer in the form tpviz needs,
made through ctypes on the symbols already loaded into the process:

- `preadv` over an iovec array built with numpy. `os.preadv` takes one Python buffer object
  per iovec, and a column block of a large matrix has a run per row: making and passing a
  thousand buffers cost more than the kernel's read of them.
- `pread` into an address: a tensor's memory without first making a Python buffer of it
  (about 3 us a read, most of a small tensor's read).
- `madvise` on any address range (`mmap.madvise` only takes ranges of an mmap object), to
  fault in a tensor's fresh pages at once.
"""

from __future__ import annotations

import ctypes
import errno
import os

import numpy as np

IOVEC = np.dtype([("base", np.uintp), ("len", np.uintp)])  # struct iovec

# the symbols already loaded into this process, libc's among them (ctypes.util.find_library
# would run ldconfig in a subprocess, tens of milliseconds)
_libc = ctypes.CDLL(None, use_errno=True)
_preadv = _libc.preadv
_preadv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
_preadv.restype = ctypes.c_ssize_t
_pread = _libc.pread
_pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64]
_pread.restype = ctypes.c_ssize_t
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def preadv(fd: int, iovecs: np.ndarray, position: int) -> int:
    """Bytes read by one preadv(2) of `iovecs` (an `IOVEC` array) from `position` of `fd`."""
    while (n := _preadv(fd, iovecs.ctypes.data, len(iovecs), position)) < 0:
        _raise_unless_interrupted()
    return n


def pread(fd: int, address: int, nbytes: int, position: int) -> int:
    """Bytes read by one pread(2) of up to `nbytes` from `position` of `fd` into `address`."""
    while (n := _pread(fd, address, nbytes, position)) < 0:
        _raise_unless_interrupted()
    return n


def _raise_unless_interrupted() -> None:
    """After a failed call: go on (call again) if a signal interrupted it, as the os module
    does; else raise its error."""
    code = ctypes.get_errno()
    if code != errno.EINTR:
        raise OSError(code, os.strerror(code))


def madvise(address: int, length: int, advice: int) -> bool:
    """Whether madvise(2) took `advice` for the page-aligned range at `address`."""
    return _madvise(address, length, advice) == 0
