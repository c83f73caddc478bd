"""One safetensors file's header: tensor names, dtypes, shapes and byte ranges, validated.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping tensor names
to dtype, shape and data offsets, then the raw bytes in row-major order. A header is validated
before any of its tensors is used: each entry on its own here (for messages naming the
tensor), the layout of all of them together by the safetensors package itself.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from .inputs import InputFileError, parse_json, regular_file

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


class CheckpointError(InputFileError):
    """A checkpoint that cannot be used as it is; the message names the file and tensor."""

    def __init__(self, message: str, file: str | None = None, tensor: str | None = None):
        super().__init__(message, file)
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
    """Tensor metadata of one .safetensors file, read from its header only and validated as
    safetensors validates it (offsets in order, not overlapping, covering the data)."""
    path = os.path.abspath(path)
    size = regular_file(path, "safetensors file", CheckpointError).st_size
    header, base = _header_json(path, size)
    tensors = {
        name: _tensor_info(path, name, entry, base, size)
        for name, entry in header.items()
        if name != "__metadata__"
    }
    _check_layout(path, tensors)
    return tensors


def _header_json(path: str, size: int) -> tuple[dict, int]:
    """The header's JSON object and the offset of the data section."""
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
        raw = f.read(length)
    try:
        header = parse_json(raw, path, "safetensors header", CheckpointError, True)
    except CheckpointError:
        _refuse_overlong(path, raw)
        raise
    if not isinstance(header, dict):
        raise CheckpointError(
            f"{path}: corrupt safetensors header: a JSON {type(header).__name__}, not an object "
            "of tensor names",
            path,
        )
    return header, 8 + length


def _refuse_overlong(path: str, raw: bytes) -> None:
    """A header that does not parse because its length field counts past its JSON (into the
    tensors' bytes) is a corrupt length, not text that is not UTF-8 or JSON."""
    text = raw.decode("utf-8", "replace")
    try:
        header, end = json.JSONDecoder().raw_decode(text)
    except (json.JSONDecodeError, RecursionError):  # what parse_json said stands
        return
    if isinstance(header, dict) and text[end:].strip():
        raise CheckpointError(
            f"{path}: corrupt safetensors file: its header length field counts {len(raw)} "
            f"bytes, but the header ends after {len(text[:end].encode())}; re-create or "
            "re-download it",
            path,
        ) from None


def _tensor_info(path: str, name: str, entry: Any, base: int, size: int) -> TensorInfo:
    tag = entry.get("dtype") if isinstance(entry, dict) else None
    if isinstance(tag, str) and tag not in SAFETENSORS_DTYPES:  # a real one (U32, C64, ...)
        raise CheckpointError(
            f"{path}: tensor {name!r} is stored as {tag}, a dtype tpviz does not read (it reads "
            f"{', '.join(SAFETENSORS_DTYPES)})",
            path,
            name,
        )
    try:
        dtype = SAFETENSORS_DTYPES[entry["dtype"]]
        shape = tuple(_count(d) for d in entry["shape"])
        begin, stop = (_count(o) for o in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(
            f"{path}: tensor {name!r} has an unreadable header entry {entry!r} (a known dtype, "
            "a shape and two data offsets, all whole numbers >= 0, are needed)",
            path,
            name,
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
    return info


def _count(value: Any) -> int:
    """A dimension or offset: a whole number >= 0 (JSON's true is not one)."""
    if type(value) is not int or value < 0:
        raise ValueError(value)
    return value


def _check_layout(path: str, tensors: dict[str, TensorInfo]) -> None:
    """Let the safetensors package validate the layout: offsets sorted, each tensor starting
    where the previous one ends, the last ending at the end of the file. It maps the file
    but reads only the header; the mapping is gone when `safe_open` closes."""
    try:
        with safe_open(path, "pt"):
            pass
    except (SafetensorError, OSError) as e:
        reason = str(e).removeprefix("Error while deserializing header: ")
        named = re.search(r"tensor `(.*)`", reason)
        tensor = named.group(1) if named else None
        if tensor in tensors and "invalid offset" in reason:
            reason = _misplaced(tensors[tensor], tensors)
        raise CheckpointError(
            f"{path}: corrupt safetensors file ({reason}); re-create or re-download it",
            path,
            tensor,
        ) from None


def _misplaced(info: TensorInfo, tensors: dict[str, TensorInfo]) -> str:
    """Words for a tensor safetensors found out of place: whose bytes it shares, if any."""
    shared = [
        t.name
        for t in tensors.values()
        if t is not info and t.start < info.end and info.start < t.end
    ]
    where = f"bytes {info.start}-{info.end}"
    if shared:
        return f"tensor {info.name!r} ({where}) shares bytes with {', '.join(map(repr, shared))}"
    return f"tensor {info.name!r} ({where}) leaves a gap before it"
