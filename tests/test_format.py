"""One folding rule for every view: the CLI table, the plotly table and plan warnings fold
tensors that differ only by an index (layer, expert) into the same row."""

from __future__ import annotations

import re

from torch import nn

from tpviz.format import fold_layers, layer_of
from tpviz.plan import resolve_plan
from tpviz.report import plan_table
from tpviz.widgets import figures


class _Experts(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))
        self.norm = nn.LayerNorm(8)


class _Nested(nn.Module):
    """Two indices per name: `layers.L.experts.E.weight`."""

    def __init__(self, layers: int = 3, experts: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Experts(experts) for _ in range(layers))


def test_fold_layers_replaces_every_inner_index():
    assert fold_layers("model.layers.3.mlp.up_proj.weight") == "model.layers.*.mlp.up_proj.weight"
    assert fold_layers("layers.0.experts.12.w1.weight") == "layers.*.experts.*.w1.weight"
    assert fold_layers("blocks.0.1.conv.weight") == "blocks.*.*.conv.weight"
    assert fold_layers("0.weight") == "0.weight"  # nothing before it: not a layer index
    assert fold_layers("lm_head.weight") == "lm_head.weight"
    assert layer_of("model.layers.3.experts.1.weight") == "model.layers.3"


def test_cli_table_and_plotly_table_fold_the_same_rows():
    plan = resolve_plan(_Nested(), 2, plan={"experts.*": "colwise"})
    cli_rows = {
        re.sub(r" x\d+$", "", line.split("  ")[0])
        for line in plan_table(plan).splitlines()[2:]
        if line.startswith("layers.")
    }
    figure_rows = {
        re.sub(r" ×\d+$", "", cell)
        for cell in figures.plan_table_figure(plan).data[0].cells.values[0]
    }
    expected = {
        "layers.*.experts.*.weight",
        "layers.*.experts.*.bias",
        "layers.*.norm.weight",
        "layers.*.norm.bias",
    }
    assert cli_rows == figure_rows == expected
