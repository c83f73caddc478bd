"""The notebooks run headless, top to bottom, on the demo checkpoints (nbclient + ipykernel).

They are committed without outputs; here each runs in a fresh kernel with the demo checkpoints
in a private cache dir, and any error fails the test.
"""

from __future__ import annotations

import json

import nbformat
import pytest
from nbclient import NotebookClient

from .conftest import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT = 300  # seconds


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tpviz-cache")


def run(path, cache, tmp_path, monkeypatch) -> nbformat.NotebookNode:
    monkeypatch.setenv("TPVIZ_CACHE", str(cache))  # the kernel inherits it
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError on the first failing cell
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            text = out.get("text", "")
            assert not (out.get("name") == "stderr" and "Traceback" in text), text
    return nb


def test_notebooks_are_committed_without_outputs():
    assert [p.name for p in NOTEBOOKS] == [
        "01_explore_plan.ipynb",
        "02_live_load.ipynb",
        "03_compare_strategies.ipynb",
    ]
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, path.name
        assert "widgets" not in nb.metadata, path.name


def widget_states(nb) -> list[dict]:
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    return [m["state"] for m in state.values()]


@pytest.mark.slow
def test_01_explore_plan(cache, tmp_path, monkeypatch):
    nb = run(NOTEBOOKS[0], cache, tmp_path, monkeypatch)
    text = json.dumps([c.get("outputs", []) for c in nb.cells])
    assert "head_alignment" in text and (cache / "plan.html").stat().st_size > 1_000_000


@pytest.mark.slow
def test_02_live_load_ends_with_the_summary_table(cache, tmp_path, monkeypatch):
    nb = run(NOTEBOOKS[1], cache, tmp_path, monkeypatch)
    markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    for needle in ("tensorboard --logdir", "%load_ext tensorboard", "%tensorboard --logdir"):
        assert needle in markdown
    last = nb.cells[-1]
    assert last.cell_type == "code" and "summary_view" in last.source
    (shown,) = last.outputs
    model_id = shown["data"]["application/vnd.jupyter.widget-view+json"]["model_id"]
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    assert "tpviz-summary" in state[model_id]["state"]["value"]
    bars = [s for s in widget_states(nb) if s.get("_model_name") == "FloatProgressModel"]
    assert len(bars) == 2 and all(b["value"] == b["max"] > 0 for b in bars)


@pytest.mark.slow
def test_03_compare_strategies(cache, tmp_path, monkeypatch):
    nb = run(NOTEBOOKS[2], cache, tmp_path, monkeypatch)
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    for strategy in ("sliced", "rank0_broadcast", "replicated"):
        assert strategy in text
    assert (cache / "compare.html").exists()
