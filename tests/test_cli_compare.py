"""`tpviz compare` as a user reads it: each strategy named while it runs, then the table."""

from __future__ import annotations

import re

import pytest

from tpviz.cli import STRATEGIES, main


@pytest.mark.slow
def test_compare_names_each_strategy_while_it_runs_and_ends_with_the_table(tiny, capsys):
    assert main(["compare", str(tiny), "--world-size", "2"]) == 0
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    n = len(STRATEGIES)
    # every progress line names its strategy, in the order they run, a few lines each
    labels = [re.match(r"\[(\d)/(\d)\] (\w+): ", line) for line in lines]
    assert all(labels), lines
    order = [(int(m[1]), int(m[2]), m[3]) for m in labels]
    assert sorted(set(order)) == [(i + 1, n, s) for i, s in enumerate(STRATEGIES)]
    assert order == sorted(order, key=lambda x: x[0])
    assert len(lines) <= 6 * n
    assert all(f"{s}: loaded on 2 ranks" in err for s in STRATEGIES)
    table = out.rstrip().split("\n\ncomparison:\n")[-1].splitlines()
    assert table[0].split()[:2] == ["strategy", "rank"]
    assert [row.split()[0] for row in table[2:]] == [s for s in STRATEGIES for _ in range(2)]
