"""Assembled tensors: a source's box in the model tensor, read block by block from a real
safetensors file, rebuilds exactly what torch.stack / torch.cat / torch.split /
torch.transpose make."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

from tpviz.checkpoint import BlockReader, Checkpoint
from tpviz.keymap import Layout, cat, in_saved_order, pieces, split, stack, transpose
from tpviz.plan import local_shape, shard_blocks
from tpviz.strategies.reads import Read


def _assemble(rnd: random.Random, g: torch.Generator):
    """Random per-expert gate/up tensors stacked then concatenated (as MoE checkpoints are),
    two 2-D tensors concatenated along their columns, and split again (parts that cut
    through a source and span two); tensors saved transposed, alone (Qwen3-VL-MoE's experts)
    or then stacked, concatenated or split."""
    experts, rows, rows2, cols = (rnd.randint(1, 5) for _ in range(4))
    t = {}
    for e in range(experts):
        t[f"e.{e}.gate"] = torch.randn(rows, cols, generator=g)
        t[f"e.{e}.up"] = torch.randn(rows2, cols, generator=g)
    t["a"], t["b"] = torch.randn(rows, cols, generator=g), torch.randn(rows, rows2, generator=g)
    gates = [k for k in t if k.endswith("gate")]
    ups = [k for k in t if k.endswith("up")]
    cases = [
        (
            cat([stack([Layout.of(k, t[k].shape) for k in ks], 0) for ks in (gates, ups)], 1),
            torch.cat([torch.stack([t[k] for k in ks]) for ks in (gates, ups)], 1),
        ),
        (
            cat([Layout.of("a", t["a"].shape), Layout.of("b", t["b"].shape)], 1),
            torch.cat([t["a"], t["b"]], 1),
        ),
        (
            stack([Layout.of(k, t[k].shape) for k in gates], 2),
            torch.stack([t[k] for k in gates], 2),
        ),
    ]
    fused = cat([Layout.of("a", t["a"].shape), Layout.of("b", t["b"].shape)], 1)
    width = fused.shape[1]
    cut = sorted(rnd.sample(range(1, width), min(2, width - 1)))
    sizes = [b - a for a, b in zip([0, *cut], [*cut, width])]
    whole = torch.cat([t["a"], t["b"]], 1)
    cases += zip(split(fused, 1, sizes), torch.split(whole, sizes, 1))
    t["x"] = torch.randn(experts, rows, cols, generator=g)
    x = Layout.of("x", t["x"].shape)
    flipped = [transpose(Layout.of(k, t[k].shape), 0, 1) for k in gates]
    cases += [
        (transpose(x, 1, 2), t["x"].transpose(1, 2)),
        (transpose(transpose(x, 0, 2), 0, 1), t["x"].transpose(0, 2).transpose(0, 1)),
        (stack(flipped, 1), torch.stack([t[k].T for k in gates], 1)),
        (transpose(stack(flipped, 0), 0, 2), torch.stack([t[k].T for k in gates]).transpose(0, 2)),
        (transpose(fused, 0, 1), whole.T),
        (
            cat([transpose(Layout.of(k, t[k].shape), 0, 1) for k in "ab"], 0),
            torch.cat([t["a"].T, t["b"].T], 0),
        ),
    ]
    cases += zip(split(transpose(fused, 0, 1), 0, sizes), torch.split(whole.T, sizes, 0))
    return t, cases


@pytest.mark.parametrize("seed", range(6))
def test_pieces_rebuild_stacked_and_concatenated_tensors(tmp_path, seed):
    rnd, g = random.Random(seed), torch.Generator().manual_seed(seed)
    tensors, cases = _assemble(rnd, g)
    save_file(tensors, tmp_path / "model.safetensors")
    ckpt = Checkpoint.open(tmp_path)
    with BlockReader() as reader:
        for layout, expected in cases:
            assert layout.shape == list(expected.shape)
            boxes = [
                replace(ckpt.tensors[s.key], shape=tuple(in_saved_order(s.shape, s.order)))
                for s in layout.sources
            ]
            for dim in [None, *range(len(layout.shape))]:
                world = rnd.randint(1, 4)
                for rank, blocks in enumerate(shard_blocks(layout.shape, dim, world)):
                    shape = local_shape(layout.shape, dim, blocks)
                    dest = torch.full(shape, float("nan"))
                    for p in pieces(layout.sources, blocks, dim, shape):
                        box = dest[tuple(slice(o, o + n) for o, n in zip(p.dst_offset, p.shape))]
                        assert not p.contiguous or box.is_contiguous()
                        read = Read(p.source, p.src_offset, p.dst_offset, p.shape, True, p.order)
                        offset, saved = read.saved_box
                        box.copy_(read.placed(reader.read_block(boxes[p.source], offset, saved)))
                    parts = [
                        expected[tuple(slice(o, o + n) for o, n in zip(b.offset, b.shape))]
                        for b in blocks
                    ]
                    if dim is None:
                        want = expected
                    else:  # a trailing rank may hold nothing
                        want = torch.cat(parts, dim) if parts else expected.new_empty(shape)
                    assert torch.equal(dest, want), (dim, world, rank)


def test_scalars_are_one_run_of_one_element(tmp_path):
    save_file({"beta": torch.tensor(0.5), "eps": torch.tensor(-1e-6)}, tmp_path / "s.safetensors")
    ckpt = Checkpoint.open(tmp_path / "s.safetensors")
    with BlockReader() as reader:
        assert reader.read_full(ckpt.tensors["beta"]).item() == 0.5
        assert reader.read_block(ckpt.tensors["eps"], (), ()).item() == pytest.approx(-1e-6)
