"""`tpviz compare` as a user reads it: each strategy named while it runs, then the table."""

from __future__ import annotations

import re

import pytest

from tpviz.cli import STRATEGIES, main
from tpviz.events import Done, read_events_dir


@pytest.mark.slow
def test_compare_names_each_strategy_while_it_runs_and_ends_with_the_table(tiny, capsys, tmp_path):
    """... and writes each strategy's events and traces to a directory of its own: one load
    per events dir, which a follower can tell ended (an earlier run's files are removed)."""
    events, traces = tmp_path / "events", tmp_path / "traces"
    (events / "sliced").mkdir(parents=True)
    (events / "sliced" / "rank5.jsonl").write_text("an earlier, larger run's\n")
    (events / "sliced" / "notes.txt").write_text("the user's own\n")
    command = ["compare", str(tiny), "--world-size", "2", "--events", str(events)]
    assert main([*command, "--profile", str(traces)]) == 0
    out, err = capsys.readouterr()
    assert sorted(p.name for p in events.iterdir()) == sorted(STRATEGIES)
    assert sorted(p.name for p in traces.iterdir()) == sorted(STRATEGIES)
    assert sorted(p.name for p in (events / "sliced").iterdir()) == [
        "notes.txt",
        "rank0.jsonl",
        "rank1.jsonl",
    ]
    for strategy in STRATEGIES:
        done = [e for e in read_events_dir(events / strategy) if isinstance(e, Done)]
        assert sorted(e.rank for e in done) == [0, 1]  # one load's each
        assert sorted(p.name.split(".")[0] for p in (traces / strategy).iterdir()) == [
            "rank0",
            "rank1",
        ]
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
