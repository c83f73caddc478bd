"""Checkpoint metadata from headers alone, and block reads equal to slices of the full tensor."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tpviz import checkpoint
from tpviz.checkpoint import BlockReader, Checkpoint, CheckpointError, contiguous_runs, read_header


def _rchar() -> int:
    """Bytes this process has read through read-like syscalls (Linux /proc/self/io)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def test_metadata_reads_headers_only(checkpoints):
    from tpviz.models.demo import make_checkpoint

    source = make_checkpoint(
        checkpoints / "header-only", "tiny", intermediate=2048, max_shard_size=2_000_000
    )
    data_bytes = sum(f.stat().st_size for f in source.glob("*.safetensors"))
    assert data_bytes > 7_000_000
    before = _rchar()
    ckpt = Checkpoint.open(source)
    read = _rchar() - before
    header_bytes = sum(
        8 + struct.unpack("<Q", f.read_bytes()[:8])[0] for f in source.glob("*.safetensors")
    )
    assert len(ckpt.files) > 2
    # headers, the index and a page of slack per file: nothing near the tensor data
    assert read < header_bytes + 64 * 1024 * len(ckpt.files)
    assert read < data_bytes / 50


def test_metadata_lists_file_shape_dtype_and_byte_range(tiny):
    ckpt = Checkpoint.open(tiny)
    index = json.loads((tiny / "model.safetensors.index.json").read_text())
    assert set(ckpt.tensors) == set(index["weight_map"])
    info = ckpt.tensors["model.layers.0.mlp.down_proj.weight"]
    assert info.file.endswith(index["weight_map"][info.name])
    assert info.shape == (128, 352) and info.dtype == "float32"
    assert info.nbytes == 128 * 352 * 4
    with open(info.file, "rb") as f:
        f.seek(info.start)
        raw = torch.frombuffer(bytearray(f.read(info.nbytes)), dtype=torch.float32)
    with safe_open(info.file, "pt") as f:
        assert torch.equal(raw.view(128, 352), f.get_tensor(info.name))


def test_open_a_single_file_an_index_or_a_directory(tiny, tmp_path):
    by_dir = Checkpoint.open(tiny)
    by_index = Checkpoint.open(tiny / "model.safetensors.index.json")
    one_file = Checkpoint.open(sorted(tiny.glob("*.safetensors"))[0])
    assert by_dir.tensors == by_index.tensors
    assert set(one_file.tensors) < set(by_dir.tensors)


def test_config_only_directory_has_no_weights(config_only):
    ckpt = Checkpoint.open(config_only)
    assert not ckpt.has_weights and ckpt.tensors == {}


def test_empty_directory_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        Checkpoint.open(tmp_path)


@pytest.mark.parametrize(
    "offset, shape",
    [
        ((1, 0, 0), (3, 5, 6)),
        ((0, 1, 0), (4, 3, 6)),
        ((1, 2, 3), (2, 2, 2)),
        ((0, 0, 0), (4, 5, 6)),
        ((0, 0, 5), (4, 5, 1)),
        ((3, 4, 0), (1, 1, 6)),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_block_read_equals_the_slice_of_the_full_tensor(tmp_path, offset, shape, dtype):
    full = (torch.arange(4 * 5 * 6) - 7).reshape(4, 5, 6).to(dtype)
    path = tmp_path / "t.safetensors"
    save_file({"x": full, "pad": torch.ones(3)}, path)
    info = read_header(path)["x"]
    with BlockReader() as reader:
        block = reader.read_block(info, offset, shape)
    expected = full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
    assert block.dtype == dtype and torch.equal(block, expected)


def test_block_read_of_columns_matches_safetensors_get_slice(tiny):
    info = Checkpoint.open(tiny).tensors["model.layers.1.self_attn.o_proj.weight"]
    with BlockReader() as reader:
        block = reader.read_block(info, (0, 64), (128, 64))
    with safe_open(info.file, "pt") as f:
        assert torch.equal(block, f.get_slice(info.name)[:, 64:128])


def test_contiguous_runs_merge_whole_trailing_dims():
    def runs(*block):
        run, starts = contiguous_runs(*block)
        return run, starts.tolist()

    assert runs((4, 6), (1, 0), (2, 6)) == (12, [6])  # whole rows: one run
    assert runs((4, 6), (0, 2), (3, 2)) == (2, [2, 8, 14])  # a column block
    assert runs((2, 3, 4), (1, 0, 0), (1, 3, 4)) == (12, [12])
    assert runs((2, 3, 4), (0, 1, 2), (2, 2, 1)) == (1, [6, 10, 18, 22])  # rows vary fastest
    assert runs((4, 6), (0, 0), (0, 6)) == (0, [])


def test_truncated_file_names_file_and_tensor(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(10), "b": torch.ones(1000)}, path)
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(CheckpointError) as err:
        read_header(path)
    assert "truncated" in str(err.value) and str(path) in str(err.value)
    assert err.value.tensor == "b" and err.value.file == str(path)


def test_a_file_cut_short_after_its_header_was_read_fails_naming_file_and_tensor(tmp_path):
    path = tmp_path / "model.safetensors"
    wide = torch.randn(4, 8192)  # rows 32 KiB apart: each run read on its own
    save_file({"a": torch.randn(64, 64), "b": torch.randn(64, 64), "wide": wide}, path)
    infos = read_header(path)
    data = path.read_bytes()
    path.write_bytes(data[: infos["b"].start + 100])  # "a" whole; "b" and "wide" cut
    with BlockReader() as reader:
        assert torch.equal(
            reader.read_full(infos["a"]),
            torch.frombuffer(
                bytearray(data[infos["a"].start : infos["a"].end]), dtype=torch.float32
            ).view(64, 64),
        )
        for name, block in [
            ("b", ((0, 0), (64, 64))),  # one run
            ("b", ((0, 0), (64, 8))),  # runs sharing calls
            ("wide", ((0, 0), (4, 2))),  # runs apart
        ]:
            with pytest.raises(CheckpointError, match="truncated while reading") as err:
                reader.read_block(infos[name], *block)
            assert err.value.file == str(path) and err.value.tensor == name


def test_corrupt_header_names_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 20) + b"{not json at all...}" + b"\0" * 64)
    with pytest.raises(CheckpointError, match="corrupt"):
        read_header(path)
    path.write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        read_header(path)


def test_index_that_points_at_a_missing_file(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(CheckpointError, match="missing"):
        Checkpoint.open(tmp_path)


def test_reading_never_opens_for_writing(tiny):
    before = {f: f.stat().st_mtime_ns for f in tiny.iterdir()}
    ckpt = Checkpoint.open(tiny)
    with BlockReader() as reader:
        for info in ckpt.tensors.values():
            reader.read_full(info)
    assert {f: f.stat().st_mtime_ns for f in tiny.iterdir()} == before


def _counting_preadv(monkeypatch, limit: int | None = None) -> list[int]:
    """Count the reader's read calls (preadv of iovec arrays, and pread of lone runs); with
    `limit`, each call reads at most that many bytes, as a filesystem may (short reads)."""
    calls: list[int] = []
    real_preadv, real_pread = checkpoint.preadv, checkpoint.pread

    def preadv(fd, iovecs, position):
        if limit is not None:  # the iovecs cut to the first `limit` bytes
            starts = np.cumsum(iovecs["len"]) - iovecs["len"]
            iovecs = iovecs[starts < limit].copy()
            iovecs["len"] = np.minimum(iovecs["len"], limit - starts[: len(iovecs)])
        calls.append(position)
        return real_preadv(fd, iovecs, position)

    def pread(fd, address, nbytes, position):
        calls.append(position)
        return real_pread(fd, address, min(nbytes, limit or nbytes), position)

    monkeypatch.setattr(checkpoint, "preadv", preadv)
    monkeypatch.setattr(checkpoint, "pread", pread)
    return calls


def test_column_block_reads_in_few_calls(tmp_path, monkeypatch):
    full = torch.randn(300, 256)
    path = tmp_path / "t.safetensors"
    save_file({"w": full}, path)
    info = read_header(path)["w"]
    calls = _counting_preadv(monkeypatch)
    with BlockReader() as reader:
        block = reader.read_block(info, (0, 128), (300, 128))  # 300 rows, 512-byte gaps
        far = reader.read_block(info, (0, 0), (3, 1))  # 1020-byte gaps: still one call
    assert torch.equal(block, full[:, 128:]) and torch.equal(far, full[:3, :1])
    assert len(calls) == 1 + 1
    big = torch.randn(4, 8192)  # 32 KiB rows: gaps too wide to read through
    save_file({"w": big}, path)
    info = read_header(path)["w"]
    calls.clear()
    with BlockReader() as reader:
        assert torch.equal(reader.read_block(info, (0, 0), (4, 2)), big[:, :2])
    assert len(calls) == 4


@pytest.mark.parametrize("limit", [1, 100, 4096])
def test_short_reads_are_resumed(tmp_path, monkeypatch, limit):
    full = torch.randn(40, 64)
    wide = torch.randn(3, 8192)  # rows 32 KiB apart: each run read on its own
    path = tmp_path / "t.safetensors"
    save_file({"w": full, "wide": wide}, path)
    info, wide_info = read_header(path)["w"], read_header(path)["wide"]
    _counting_preadv(monkeypatch, limit)
    with BlockReader() as reader:
        assert torch.equal(reader.read_block(wide_info, (0, 5), (3, 1500)), wide[:, 5:1505])
        assert torch.equal(reader.read_block(info, (3, 10), (30, 20)), full[3:33, 10:30])
        assert torch.equal(reader.read_full(info), full)
