"""The style classes and their registry: each style's cut, forward and cost in one place."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from tpviz import styles
from tpviz.plan import resolve_plan
from tpviz.runtime.parallelize import is_distributed
from tpviz.styles import Cut, Style

REPLICATE, SHARD_LAST = Replicate(), Shard(-1)


def test_the_registry_names_every_style_once():
    for name, style in styles.STYLES.items():
        assert style.name == name and isinstance(style, Style)
    assert set(styles.ALIASES.values()) <= set(styles.STYLES)
    assert not styles.UNSUPPORTED & (set(styles.STYLES) | set(styles.ALIASES))
    assert styles.DEFAULT_STYLE in styles.STYLES
    with pytest.raises(styles.UnsupportedStyle, match="cannot execute"):
        styles.canonical("ep_router")


# the README's style table: weight of nn.Linear (out, in), bias, forward (input, output)
@pytest.mark.parametrize(
    "name, weight, bias, forward, collective",
    [
        ("colwise", 0, 0, (REPLICATE, SHARD_LAST), "none"),
        ("rowwise", 1, None, (SHARD_LAST, REPLICATE), "all-reduce of the output"),
        ("colwise_gather_output", 0, 0, (REPLICATE, REPLICATE), "all-gather of the output"),
        ("rowwise_split_input", 1, None, (REPLICATE, REPLICATE), "all-reduce of the output"),
        ("embedding_rowwise", 0, None, (REPLICATE, REPLICATE), "all-reduce of the output"),
        ("packed_colwise", 0, 0, None, "none"),
        ("replicated_with_grad_allreduce", None, None, None, "none"),
        ("replicate", None, None, None, "none"),
    ],
)
def test_each_style_owns_its_cut_and_its_forward(name, weight, bias, forward, collective):
    style = styles.canonical(name)
    assert style.cut("weight", 2).dim == weight and style.cut("bias", 1).dim == bias
    if forward is None:
        assert style.forward is None
    else:
        arrives, _, hands_on = style.forward.placements
        assert (arrives, hands_on) == forward
    assert style.forward_collective == collective


def test_a_cut_says_what_each_rank_holds():
    # torch.chunk semantics: 10 rows over 4 ranks are 3, 3, 3, 1
    held = Cut(0).rank_shards([10, 2], 4, itemsize=4)
    assert [h.shape for h in held] == [[3, 2], [3, 2], [3, 2], [1, 2]]
    assert [h.bytes for h in held] == [24, 24, 24, 8]
    # packed: one block of each of the two parts per rank
    packed = styles.canonical("packed_colwise").cut("weight", 2)
    assert packed == Cut(0, parts=2) and not packed.splits_evenly([7, 4])
    assert [len(h.blocks) for h in packed.rank_shards([8, 4], 2, itemsize=2)] == [2, 2]
    assert all(h.shape == [10, 2] for h in Cut(None).rank_shards([10, 2], 3, itemsize=4))


class HalfColwise(Style):
    """A style added outside tpviz: the class and one registry entry are all it takes."""

    name = "half_colwise"
    summary = "colwise's cut, computed on plain local tensors"
    modules = (styles.LINEAR,)
    weight_dim = 0
    bias_sharded = True


def test_a_new_style_is_one_class_and_one_registry_line(monkeypatch):
    monkeypatch.setitem(styles.STYLES, HalfColwise.name, HalfColwise())
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4))
    plan = resolve_plan(model, 2, {"0": "half_colwise", "1": "colwise"})
    assert not plan.errors
    first, second = plan.tensor("0.weight"), plan.tensor("1.weight")
    assert (first.style, first.placement, first.ranks[1].shape) == (
        "half_colwise",
        "shard(0)",
        [3, 4],
    )
    assert plan.module_styles == {"0": "half_colwise", "1": "colwise"}
    # the runtime asks the style: no forward placements, so plain local tensors
    assert not is_distributed(plan, first) and is_distributed(plan, second)
