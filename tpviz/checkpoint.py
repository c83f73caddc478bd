"""safetensors checkpoints: metadata from the headers alone, and reads of rectangular blocks.

Metadata comes from the headers only (validated in safetensors_header.py); an index may name
only files inside its own directory. Block reads use `preadv` straight into memory the
caller owns: no mmap, so no checkpoint pages stay resident in the reading process. Files are
opened read-only.
"""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .inputs import read_json, stat_path
from .safetensors_header import CheckpointError, TensorInfo, dtype_name, read_header, torch_dtype
from .syscalls import IOVEC, pread, preadv

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

__all__ = [
    "BlockReader",
    "Checkpoint",
    "CheckpointError",
    "TensorInfo",
    "contiguous_runs",
    "dtype_name",
    "read_header",
    "torch_dtype",
]


@dataclass
class Checkpoint:
    """Metadata of a checkpoint: one file, a sharded index, or a directory holding either.

    `tensors` is empty for a directory that holds only `config.json` (planning without weights).
    `unused` says which weight-like files were found there and why they are not read: then, or
    beside a `model.safetensors` (the file transformers reads first).
    """

    path: str
    tensors: dict[str, TensorInfo]
    unused: dict[str, str] = field(default_factory=dict)

    @property
    def files(self) -> list[str]:
        return sorted({t.file for t in self.tensors.values()})

    @property
    def has_weights(self) -> bool:
        return bool(self.tensors)

    @classmethod
    def open(cls, path: str | os.PathLike) -> Checkpoint:
        is_dir = stat.S_ISDIR(stat_path(path, "checkpoint", CheckpointError).st_mode)
        path = Path(path).resolve()
        if is_dir:
            if os.path.lexists(path / SINGLE_NAME):
                ckpt = cls._single_file(path)
            elif os.path.lexists(path / INDEX_NAME):
                ckpt = cls._from_index(path / INDEX_NAME)
            else:
                files = sorted(path.glob("*.safetensors"))
                if not files and not os.path.lexists(path / "config.json"):
                    raise CheckpointError(
                        f"{path}: no *.safetensors, {INDEX_NAME} or config.json here; point at "
                        "a checkpoint directory",
                        str(path),
                    )
                ckpt = cls(str(path), _merge(read_header(f) for f in files))
            if not ckpt.has_weights:
                ckpt.unused = unused_weights(path)
            return ckpt
        if path.name.endswith(".index.json"):
            return cls._from_index(path)
        if not path.name.endswith(".safetensors"):
            raise CheckpointError(
                f"{path}: not a checkpoint file (*.safetensors, or an index *.index.json); "
                "give the checkpoint directory",
                str(path),
            )
        return cls(str(path.parent), read_header(path))

    @classmethod
    def _single_file(cls, directory: Path) -> Checkpoint:
        """A directory holding `model.safetensors`: that file alone, as transformers reads it
        before an index or other files (a sharded copy beside it may hold other weights)."""
        others = [
            f.name
            for f in sorted(directory.iterdir())
            if f.name != SINGLE_NAME and f.name.endswith((".safetensors", INDEX_NAME))
        ]
        why = f"not read: {SINGLE_NAME} is, the file transformers reads first"
        return cls(str(directory), read_header(directory / SINGLE_NAME), dict.fromkeys(others, why))

    @classmethod
    def _from_index(cls, index: Path) -> Checkpoint:
        weight_map = _weight_map(index)
        headers = {}
        for file in sorted(set(weight_map.values())):
            target = index.parent / file
            if not os.path.lexists(target):
                raise CheckpointError(
                    f"{index}: lists {file}, which is missing from {index.parent}", str(target)
                )
            headers[file] = read_header(target)
        tensors = _merge(headers.values())  # a tensor in two shards: an error naming both
        for name, file in weight_map.items():
            if name not in headers[file]:
                raise CheckpointError(
                    f"{index}: says {name!r} is in {file}, but that file's header does not list it",
                    str(index.parent / file),
                    name,
                )
        return cls(str(index.parent), tensors)


def _weight_map(index: Path) -> dict[str, str]:
    """The index's `weight_map`: tensor name -> a file inside the index's directory."""
    data = read_json(index, "safetensors index", CheckpointError, unique_keys=True)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(
            f'{index}: not a safetensors index (needs an object "weight_map" of tensor name '
            "-> file name)",
            str(index),
        )
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file.endswith(".safetensors"):
            raise CheckpointError(
                f"{index}: weight_map entry {name!r} is {file!r}, not a .safetensors file name",
                str(index),
                name,
            )
        # an index names files beside it; one reaching elsewhere (absolute, or through ..)
        # would make tpviz read a file the checkpoint does not hold
        if Path(file).is_absolute() or ".." in Path(file).parts:
            raise CheckpointError(
                f"{index}: weight_map entry {name!r} points outside the checkpoint directory "
                f"({file}); an index may name only files inside {index.parent}",
                str(index),
                name,
            )
    return weight_map


# files that hold weights in formats tpviz does not read
FOREIGN_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".npz", ".onnx")


def unused_weights(directory: Path) -> dict[str, str]:
    """Files in a directory without usable tensors that look like weights: name -> why each
    is not used."""
    found = {}
    for f in sorted(directory.iterdir()):
        if f.name.endswith((*FOREIGN_WEIGHTS, ".bin.index.json")):
            found[f.name] = (
                "not safetensors (tpviz reads only .safetensors files; convert it, e.g. "
                "save_pretrained(..., safe_serialization=True))"
            )
        elif f.name.endswith(".safetensors"):
            indexed = (directory / INDEX_NAME).exists()
            found[f.name] = f"not named in {INDEX_NAME}" if indexed else "holds no tensors"
        elif f.name == INDEX_NAME:
            found[f.name] = "its weight_map lists no tensors"
    return found


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


def _truncated(info: TensorInfo, position: int) -> CheckpointError:
    return CheckpointError(
        f"{info.file}: truncated while reading tensor {info.name!r} at byte {position}; "
        "re-create or re-download the file",
        info.file,
        info.name,
    )


def contiguous_runs(
    global_shape: tuple[int, ...], offset: tuple[int, ...], shape: tuple[int, ...]
) -> tuple[int, np.ndarray]:
    """Split a block of a row-major tensor into runs that are contiguous in the file.

    Returns (elements per run, element index of each run's start), in block order, so the
    runs fill a contiguous buffer of `shape` one after another.
    """
    if any(s == 0 for s in shape):
        return 0, np.empty(0, dtype=np.int64)
    ndim = len(global_shape)
    if ndim == 0:  # a scalar (0-dim) tensor is one run of one element
        return 1, np.zeros(1, dtype=np.int64)
    # dims after `split` are whole; the run covers dim `split` of the block and all dims after
    split = ndim - 1
    while split > 0 and offset[split] == 0 and shape[split] == global_shape[split]:
        split -= 1
    strides = [math.prod(global_shape[d + 1 :]) for d in range(ndim)]
    starts = np.array([offset[split] * strides[split]], dtype=np.int64)
    for d in range(split):  # outer dims first, so the last one varies fastest
        rows = (offset[d] + np.arange(shape[d], dtype=np.int64)) * strides[d]
        starts = (starts[:, None] + rows).ravel()
    return shape[split] * strides[split], starts


class BlockReader:
    """Reads blocks of tensors into caller-owned CPU tensors; keeps one read-only fd per file.

    The runs of a block go to the kernel as few `preadv` calls as possible: runs separated in
    the file by at most `MAX_GAP_BYTES` share one call, the gap landing in a small scratch
    buffer that is then dropped (the kernel reads whole pages anyway). A column block of a
    large matrix thus costs a few calls, not one per row, and its iovecs are built with numpy
    (tpviz.syscalls), not one Python object per row.
    """

    MAX_GAP_BYTES = 8192  # above this, one more syscall costs less than copying the gap

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._scratch = np.empty(self.MAX_GAP_BYTES, dtype=np.uint8)
        self._runs_per_call = min(os.sysconf("SC_IOV_MAX"), 1024) // 2  # each with its gap

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
            or out.device.type != "cpu"
        ):
            raise ValueError(
                f"read buffer for {info.name} must be a contiguous {shape} {info.dtype} on the CPU"
            )
        if len(offset) != len(info.shape) or any(
            o < 0 or o + s > d for o, s, d in zip(offset, shape, info.shape)
        ):
            raise ValueError(f"block {offset}+{shape} lies outside {info.name} {list(info.shape)}")
        run, starts = contiguous_runs(info.shape, offset, shape)
        if len(starts):
            itemsize = out.element_size()
            positions = info.start + starts * itemsize
            self._read_runs(info, out, run * itemsize, positions)
        return out

    def read_full(self, info: TensorInfo, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.read_block(info, (0,) * len(info.shape), info.shape, out)

    def _fd(self, file: str) -> int:
        fd = self._fds.get(file)
        if fd is None:
            fd = self._fds[file] = os.open(file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        return fd

    def _read_runs(
        self, info: TensorInfo, out: torch.Tensor, run_bytes: int, positions: np.ndarray
    ) -> None:
        """Fill `out` with runs of `run_bytes` read from `positions` of `info.file`, one after
        another (the caller checked it holds them all)."""
        fd, count, address = self._fd(info.file), len(positions), out.data_ptr()
        if count == 1:  # most tensors: one `pread`, none of the numpy below (a few us)
            self._read_run(fd, address, run_bytes, int(positions[0]), info)
            return
        gaps = np.diff(positions) - run_bytes
        starts = positions.tolist()
        apart = (np.flatnonzero(gaps > self.MAX_GAP_BYTES) + 1).tolist()
        if len(apart) == count - 1:  # rows far apart: a `pread` each costs less than an array
            for i, position in enumerate(starts):
                self._read_run(fd, address + i * run_bytes, run_bytes, position, info)
            return
        first = 0
        for stop in [*apart, count]:
            for a in range(first, stop, self._runs_per_call):  # the runs [a, b) share a call
                b = min(stop, a + self._runs_per_call)
                iovecs = np.empty(2 * (b - a) - 1, dtype=IOVEC)
                iovecs["base"][0::2] = address + np.arange(a, b, dtype=np.uintp) * run_bytes
                iovecs["len"][0::2] = run_bytes
                iovecs["base"][1::2] = self._scratch.ctypes.data
                iovecs["len"][1::2] = gaps[a : b - 1]
                nbytes = starts[b - 1] - starts[a] + run_bytes
                self._read_fully(fd, iovecs, starts[a], nbytes, info)
            first = stop

    @staticmethod
    def _read_run(fd: int, address: int, nbytes: int, position: int, info: TensorInfo) -> None:
        while nbytes:
            n = pread(fd, address, nbytes, position)
            if n == 0:
                raise _truncated(info, position)
            address, position, nbytes = address + n, position + n, nbytes - n

    @staticmethod
    def _read_fully(
        fd: int, iovecs: np.ndarray, position: int, nbytes: int, info: TensorInfo
    ) -> None:
        while True:
            n = preadv(fd, iovecs, position)
            if n == nbytes:
                return
            if n == 0:
                raise _truncated(info, position)
            # a short read: go on after the bytes that came
            position, nbytes = position + n, nbytes - n
            ends = np.cumsum(iovecs["len"])
            filled = int(np.searchsorted(ends, n, side="right"))  # iovecs wholly filled
            iovecs = iovecs[filled:].copy()
            into = n - (int(ends[filled - 1]) if filled else 0)
            iovecs["base"][0] += into
            iovecs["len"][0] -= into

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> BlockReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
