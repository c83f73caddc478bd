"""safetensors checkpoints: metadata from the headers alone, and reads of rectangular blocks.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping tensor names
to dtype, shape and data offsets, then the raw bytes in row-major order. Metadata comes from
the headers only. Block reads use `os.preadv` straight into memory the caller owns: no mmap,
so no checkpoint pages stay resident in the reading process. Files are opened read-only.
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024

# safetensors dtype tag -> torch dtype
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> `"float32"`."""
    return str(dtype).removeprefix("torch.")


@functools.cache
def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is; the message names the file and tensor."""

    def __init__(self, message: str, file: str | None = None, tensor: str | None = None):
        super().__init__(message)
        self.file = file
        self.tensor = tensor


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str  # absolute path
    shape: tuple[int, ...]
    dtype: str  # torch name without prefix
    start: int  # absolute byte offset of the first element in `file`
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)


def read_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Tensor metadata of one .safetensors file, read from its header only."""
    path = os.path.abspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)", path)
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(
                f"{path}: corrupt or truncated safetensors file (header claims {length} bytes, "
                f"file has {size}); re-create or re-download it",
                path,
            )
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})", path) from None
    base = 8 + length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, stop = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"{path}: tensor {name!r} has an unreadable header entry {entry!r}", path, name
            ) from None
        info = TensorInfo(name, path, shape, dtype_name(dtype), base + begin, base + stop)
        expected = math.prod(shape) * dtype.itemsize
        if info.nbytes != expected:
            raise CheckpointError(
                f"{path}: tensor {name!r} spans {info.nbytes} bytes but shape {list(shape)} "
                f"{info.dtype} needs {expected}; the file is corrupt",
                path,
                name,
            )
        if info.end > size:
            raise CheckpointError(
                f"{path}: truncated safetensors file: tensor {name!r} needs bytes up to "
                f"{info.end}, the file has {size}; re-create or re-download it",
                path,
                name,
            )
        tensors[name] = info
    return tensors


@dataclass
class Checkpoint:
    """Metadata of a checkpoint: one file, a sharded index, or a directory holding either.

    `tensors` is empty for a directory that holds only `config.json` (planning without weights).
    """

    path: str
    tensors: dict[str, TensorInfo]

    @property
    def files(self) -> list[str]:
        return sorted({t.file for t in self.tensors.values()})

    @property
    def has_weights(self) -> bool:
        return bool(self.tensors)

    @classmethod
    def open(cls, path: str | os.PathLike) -> Checkpoint:
        path = Path(path).resolve()
        if path.is_dir():
            if (path / INDEX_NAME).exists():
                return cls._from_index(path / INDEX_NAME)
            files = sorted(path.glob("*.safetensors"))
            if not files and not (path / "config.json").exists():
                raise CheckpointError(
                    f"{path}: no *.safetensors, {INDEX_NAME} or config.json here; point at a "
                    "checkpoint directory",
                    str(path),
                )
            return cls(str(path), _merge(read_header(f) for f in files))
        if not path.exists():
            raise CheckpointError(f"{path}: no such file or directory", str(path))
        if path.name.endswith(".index.json"):
            return cls._from_index(path)
        return cls(str(path.parent), read_header(path))

    @classmethod
    def _from_index(cls, index: Path) -> Checkpoint:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})", str(index)) from None
        tensors: dict[str, TensorInfo] = {}
        for file in sorted(set(weight_map.values())):
            target = index.parent / file
            if not target.exists():
                raise CheckpointError(
                    f"{index}: lists {file}, which is missing from {index.parent}", str(target)
                )
            tensors.update(read_header(target))
        for name, file in weight_map.items():
            info = tensors.get(name)
            if info is None or Path(info.file).name != Path(file).name:
                raise CheckpointError(
                    f"{index}: says {name!r} is in {file}, but that file's header does not list it",
                    str(index.parent / file),
                    name,
                )
        return cls(str(index.parent), tensors)


def _merge(headers) -> dict[str, TensorInfo]:
    merged: dict[str, TensorInfo] = {}
    for header in headers:
        for name, info in header.items():
            if name in merged:
                raise CheckpointError(
                    f"tensor {name!r} appears in both {merged[name].file} and {info.file}",
                    info.file,
                    name,
                )
            merged[name] = info
    return merged


def contiguous_runs(
    global_shape: tuple[int, ...], offset: tuple[int, ...], shape: tuple[int, ...]
) -> tuple[int, list[int]]:
    """Split a block of a row-major tensor into runs that are contiguous in the file.

    Returns (elements per run, element index of each run's start), in block order, so the
    runs fill a contiguous buffer of `shape` one after another.
    """
    if any(s == 0 for s in shape):
        return 0, []
    ndim = len(global_shape)
    if ndim == 0:  # a scalar (0-dim) tensor is one run of one element
        return 1, [0]
    # dims after `split` are whole; the run covers dim `split` of the block and all dims after
    split = ndim - 1
    while split > 0 and offset[split] == 0 and shape[split] == global_shape[split]:
        split -= 1
    strides = [math.prod(global_shape[d + 1 :]) for d in range(ndim)]
    starts = [offset[split] * strides[split]]
    for d in range(split):  # outer dims first, so the last one varies fastest
        step, first = strides[d], offset[d] * strides[d]
        starts = [s + first + i * step for s in starts for i in range(shape[d])]
    return shape[split] * strides[split], starts


class BlockReader:
    """Reads blocks of tensors into caller-owned CPU tensors; keeps one read-only fd per file.

    The runs of a block go to the kernel as few `preadv` calls as possible: runs separated in
    the file by at most `MAX_GAP_BYTES` share one call, the gap landing in a small scratch
    buffer that is then dropped (the kernel reads whole pages anyway). A column block of a
    large matrix thus costs a few calls, not one per row.
    """

    MAX_GAP_BYTES = 8192  # above this, one more syscall costs less than copying the gap

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._scratch = memoryview(bytearray(self.MAX_GAP_BYTES))
        self._max_buffers = min(os.sysconf("SC_IOV_MAX"), 1024)

    def read_block(
        self,
        info: TensorInfo,
        offset: tuple[int, ...],
        shape: tuple[int, ...],
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Read `info[offset : offset + shape]` into `out` (contiguous, `info`'s dtype, CPU)."""
        if out is None:
            out = torch.empty(shape, dtype=info.torch_dtype)
        if (
            tuple(out.shape) != tuple(shape)
            or not out.is_contiguous()
            or out.dtype != info.torch_dtype
        ):
            raise ValueError(
                f"read buffer for {info.name} must be a contiguous {shape} {info.dtype}"
            )
        if len(offset) != len(info.shape) or any(
            o < 0 or o + s > d for o, s, d in zip(offset, shape, info.shape)
        ):
            raise ValueError(f"block {offset}+{shape} lies outside {info.name} {list(info.shape)}")
        run, starts = contiguous_runs(info.shape, offset, shape)
        if not starts:
            return out
        itemsize = out.element_size()
        view = memoryview(out.view(-1).view(torch.uint8).numpy())
        self._read_runs(info, view, run * itemsize, [info.start + s * itemsize for s in starts])
        return out

    def read_full(self, info: TensorInfo, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.read_block(info, (0,) * len(info.shape), info.shape, out)

    def _fd(self, file: str) -> int:
        fd = self._fds.get(file)
        if fd is None:
            fd = self._fds[file] = os.open(file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        return fd

    def _read_runs(
        self, info: TensorInfo, view: memoryview, run_bytes: int, positions: list[int]
    ) -> None:
        """Fill `view` with runs of `run_bytes` read from `positions` of `info.file`."""
        fd, count, i = self._fd(info.file), len(positions), 0
        while i < count:
            first = positions[i]
            end = first + run_bytes
            buffers = [view[i * run_bytes : (i + 1) * run_bytes]]
            i += 1
            while i < count and len(buffers) < self._max_buffers - 1:
                gap = positions[i] - end
                if gap > self.MAX_GAP_BYTES:
                    break
                if gap:
                    buffers.append(self._scratch[:gap])
                buffers.append(view[i * run_bytes : (i + 1) * run_bytes])
                end = positions[i] + run_bytes
                i += 1
            self._preadv(fd, buffers, first, end - first, info)

    @staticmethod
    def _preadv(fd: int, buffers: list, position: int, nbytes: int, info: TensorInfo) -> None:
        while True:
            n = os.preadv(fd, buffers, position)
            if n == nbytes:
                return
            if n == 0:
                raise CheckpointError(
                    f"{info.file}: truncated while reading tensor {info.name!r} at byte "
                    f"{position}; re-create or re-download the file",
                    info.file,
                    info.name,
                )
            position, nbytes = position + n, nbytes - n
            while n >= len(buffers[0]):  # a short read: go on after the bytes that came
                n -= len(buffers.pop(0))
            buffers[0] = buffers[0][n:]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> BlockReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
