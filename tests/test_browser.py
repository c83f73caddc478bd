"""The widgets in a real browser: JupyterLab on 127.0.0.1, headless Chromium via Playwright.

`02_live_load.ipynb` runs top to bottom in the browser; the test then reads what the page
shows: one memory line per rank in the plot, every progress bar at its end, the summary table,
and no console errors from tpviz or the widgets. `01_explore_plan.ipynb` checks the PlanView
and its live world-size control the same way; a Dashboard is driven by clicks (validation as
you type, two loads overlaid); an HTML report is opened with the network refused. Screenshots
go to `test-artifacts/` and, with `TPVIZ_SCREENSHOTS=docs/images`, the README's two also there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import nbformat
import psutil
import pytest

from .conftest import REPO

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = REPO / "test-artifacts"
TOKEN = "tpviz-browser-test"
RUN_TIMEOUT_S = 240
# what offline JupyterLab itself may log; only tpviz, widget and plotly errors count
OURS = re.compile(r"tpviz|widget|plotly|anywidget|FigureWidget", re.IGNORECASE)

if not CHROMIUM.exists():
    if os.environ.get("TPVIZ_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{CHROMIUM} is missing and TPVIZ_REQUIRE_BROWSER=1", pytrace=False)
    pytest.skip(f"{CHROMIUM} is missing (install Debian's chromium)", allow_module_level=True)

from playwright.sync_api import Locator, Page, sync_playwright  # noqa: E402

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab serving a temp root that holds copies of the notebooks; nothing fetched."""
    base = tmp_path_factory.mktemp("lab")
    root = base / "root"
    root.mkdir()
    for name in ("01_explore_plan.ipynb", "02_live_load.ipynb"):
        shutil.copy(REPO / "notebooks" / name, root / name)
    dashboard = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell('import tpviz\n\ndash = tpviz.Dashboard(preset="tiny")\ndash')
        ],
        metadata={
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}
        },
    )
    nbformat.write(dashboard, root / "dashboard.ipynb")
    config = base / "config"
    config.mkdir()
    offline = {  # no news feed, no update check, no extension listings: nothing to fetch
        "news_url": None,
        "check_for_updates_class": "jupyterlab.NeverCheckForUpdate",
        "extension_manager": "readonly",
    }
    (config / "jupyter_lab_config.json").write_text(json.dumps({"LabApp": offline}))
    # and no "Would you like to get notified about official Jupyter news?" prompt
    settings = base / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    notification = {"fetchNews": "false", "checkForUpdates": False}
    (settings / "notification.jupyterlab-settings").write_text(json.dumps(notification))
    port = free_port()
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(config),  # no user config, settings or workspaces
        "JUPYTER_RUNTIME_DIR": str(base / "runtime"),
        "JUPYTERLAB_SETTINGS_DIR": str(base / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(base / "workspaces"),
        "TPVIZ_CACHE": str(base / "cache"),  # the notebooks' demo checkpoints
    }
    log = open(base / "lab.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,  # the venv's python: its kernel imports tpviz
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ip=127.0.0.1",
            f"--port={port}",
            f"--IdentityProvider.token={TOKEN}",
            f"--ServerApp.root_dir={root}",
            "--allow-root",  # CI containers run as root
        ],
        cwd=root,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            with urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=2):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail("JupyterLab did not start:\n" + (base / "lab.log").read_text())
            time.sleep(0.5)
    server = psutil.Process(proc.pid)
    try:
        yield url
    finally:
        descendants = server.children(recursive=True)
        try:  # a clean stop: the server shuts its kernels down first
            request = urllib.request.Request(f"{url}/api/shutdown?token={TOKEN}", method="POST")
            urllib.request.urlopen(request, timeout=10).close()
            proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        _, alive = psutil.wait_procs(descendants, timeout=20)
        for p in alive:
            p.kill()
        assert not alive, f"left running after JupyterLab stopped: {alive}"


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=str(CHROMIUM),
            args=[
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--no-first-run",
            ],
        )
        try:
            yield browser
        finally:
            browser.close()


class Console:
    """Console errors and uncaught page errors, for judging afterwards."""

    def __init__(self, page: Page):
        self.errors: list[str] = []
        page.on(
            "console",
            lambda m: self.errors.append(f"{m.text} @ {m.location}") if m.type == "error" else None,
        )
        page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}\n{e.stack}"))

    def ours(self) -> list[str]:
        return [e for e in self.errors if OURS.search(e)]


def kernel_idle(url: str, name: str) -> bool:
    """Whether the notebook's session has a started kernel that is idle (server's view)."""
    with urllib.request.urlopen(f"{url}/api/sessions?token={TOKEN}", timeout=5) as r:
        sessions = json.load(r)
    return any(
        s["path"] == name and (s.get("kernel") or {}).get("execution_state") == "idle"
        for s in sessions
    )


def accept_dialogs(page: Page) -> None:
    """Accept a kernel-selection dialog, should JupyterLab ask."""
    button = page.locator(".jp-Dialog .jp-mod-accept")
    if button.count():
        button.first.click()


def open_notebook(browser, url: str, name: str) -> tuple[Page, Console]:
    page = browser.new_page(viewport={"width": 1400, "height": 2000})  # tall: whole widgets
    console = Console(page)
    # a fresh workspace of its own: only this notebook open
    workspace = Path(name).stem
    page.goto(f"{url}/lab/workspaces/{workspace}/tree/{name}?reset&token={TOKEN}", timeout=120_000)
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=120_000)
    deadline = time.monotonic() + 120
    while not kernel_idle(url, name):
        assert time.monotonic() < deadline, "the notebook's kernel did not start"
        accept_dialogs(page)
        page.wait_for_timeout(500)
    return page, console


def run_all(page: Page) -> None:
    """Run > Run All Cells, then wait until every code cell has its execution count."""
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        # textContent, not innerText: cells scrolled out of view are not rendered
        prompts = page.eval_on_selector_all(
            ".jp-CodeCell .jp-InputPrompt", "ps => ps.map(p => p.textContent)"
        )
        if prompts and all(re.search(r"\[\d+\]", p) for p in prompts):
            return
        assert not errors_in_outputs(page), errors_in_outputs(page)  # fail fast, not at timeout
        assert time.monotonic() < deadline, f"the notebook did not finish: prompts {prompts}"
        accept_dialogs(page)
        page.wait_for_timeout(500)


def errors_in_outputs(page: Page) -> list[str]:
    """Tracebacks and anything else written to stderr, in every cell's outputs."""
    return page.locator("[data-mime-type='application/vnd.jupyter.stderr']").evaluate_all(
        "es => es.map(e => e.textContent)"
    )


def save_screenshot(
    page: Page, name: str, element: Locator | None = None, height: int = 0, readme: bool = False
) -> Path:
    """A screenshot of the page, or of `element` (its top `height` px, if given), into
    test-artifacts/; the README's (`readme`) also into DIR with TPVIZ_SCREENSHOTS=DIR."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    if element is None:
        page.screenshot(path=str(path))
    else:
        element.evaluate("e => e.scrollIntoView()")
        page.wait_for_timeout(300)
        box = element.bounding_box()
        clip = {**box, "height": min(box["height"], height or box["height"])}
        page.screenshot(path=str(path), clip=clip)
    extra = os.environ.get("TPVIZ_SCREENSHOTS")
    if extra and readme:
        target = REPO / extra
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target / name)
    return path


def keep_evidence(page: Page, console: Console, name: str) -> None:
    """The page as it ended and everything its console logged, whatever the outcome."""
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}-final.png"), full_page=True)
    (ARTIFACTS / f"{name}-console.json").write_text(json.dumps(console.errors, indent=1))
    page.close()


def plots(scope: Page | Locator) -> list[dict]:
    """What each plotly graph in `scope` holds: per trace its meta and number of points."""
    return scope.locator(".js-plotly-plot").evaluate_all(
        """gds => gds.map(gd => ({
            traces: (gd.data || []).map(t => ({
                meta: t.meta || {}, points: (t.x || []).length, visible: t.visible !== false,
            })),
            lines: gd.querySelectorAll('.scatterlayer .trace path.js-line').length,
        }))"""
    )


def settled_plots(
    scope: Locator, ready: Callable[[list[dict]], bool], timeout_s: float = 30
) -> list[dict]:
    """`plots(scope)` once `ready` says so, or as they are after `timeout_s` (for the test's
    assertion to judge): a FigureWidget's data reaches the page after the HTML widgets set
    before it, much later on a loaded machine."""
    deadline = time.monotonic() + timeout_s
    while not ready(graphs := plots(scope)) and time.monotonic() < deadline:
        scope.page.wait_for_timeout(250)
    return graphs


def traces(graphs: list[dict]) -> list[dict]:
    return [t for g in graphs for t in g["traces"]]


def bars(graphs: list[dict]) -> list[dict]:
    """The traces of the bytes-by-style chart: one per style."""
    return [t for t in traces(graphs) if t["meta"].get("style")]


def test_live_load_notebook_in_the_browser(lab, browser):
    url = lab
    page, console = open_notebook(browser, url, "02_live_load.ipynb")
    try:
        run_all(page)
        page.wait_for_selector("table.tpviz-summary", timeout=60_000)
        page.wait_for_timeout(1000)  # the last redraws are throttled: let them land
        assert errors_in_outputs(page) == []

        # the kernel stayed free: the cell after the monitor ran before loading finished
        outputs = page.locator(".jp-CodeCell").nth(2).locator(".jp-OutputArea").inner_text()
        assert "the job is starting" in outputs, outputs

        # one memory line per rank, drawn, with its dashed forecasts
        (monitor_plot,) = plots(page.locator(".jp-CodeCell").nth(1))
        memory = [t for t in monitor_plot["traces"] if t["meta"].get("kind") == "memory"]
        assert [t["meta"]["rank"] for t in memory] == [0, 1]
        assert all(t["points"] > 1 for t in memory)
        kinds = [t["meta"].get("kind") for t in monitor_plot["traces"]]
        assert kinds.count("forecast_shard") == kinds.count("forecast_peak") == 2
        # every visible trace has a rendered path; a forecast peak equal to the shard is
        # drawn once, as the shard's line labelled both
        visible = [t for t in monitor_plot["traces"] if t["visible"]]
        assert monitor_plot["lines"] >= len(visible) >= 4

        # every progress bar at its end
        widths = page.eval_on_selector_all(
            ".widget-hprogress .progress-bar", "bars => bars.map(b => b.style.width)"
        )
        assert widths == ["100%", "100%"], widths

        # the summary table: in the monitor and again as the last output
        tables = page.locator("table.tpviz-summary")
        assert tables.count() == 2
        assert tables.first.locator("tr").count() == 3  # header + one row per rank
        assert "verification ok" in page.locator(".jp-CodeCell").nth(1).inner_text()

        monitor = page.locator(".jp-CodeCell").nth(1).locator(".jp-OutputArea-output")
        save_screenshot(page, "monitor.png", monitor, readme=True)
        assert console.ours() == [], "\n".join(console.ours())
    finally:
        keep_evidence(page, console, "02_live_load")


def test_plan_view_notebook_in_the_browser(lab, browser):
    url = lab
    page, console = open_notebook(browser, url, "01_explore_plan.ipynb")
    try:
        run_all(page)
        assert errors_in_outputs(page) == []
        view = page.locator(".jp-CodeCell").nth(1).locator(".jp-OutputArea-output")
        view.locator("details").first.wait_for(timeout=60_000)
        assert view.locator("details").count() == 2  # one per layer
        assert view.locator(".tpviz-badge").count() > 10
        graphs = settled_plots(
            view, lambda gs: any(t["meta"].get("kind") == "block" for t in traces(gs))
        )
        blocks = [t for g in graphs for t in g["traces"] if t["meta"].get("kind") == "block"]
        assert {t["meta"]["rank"] for t in blocks} == {0, 1}
        page.wait_for_timeout(500)
        save_screenshot(page, "plan_view.png", view, height=1500, readme=True)

        # the world-size control re-resolves live, in the kernel, from the browser
        box = view.locator(".widget-inline-hbox", has_text="world size").locator("input").first
        box.fill("3")
        box.press("Enter")
        view.get_by_text("head_alignment", exact=False).first.wait_for(timeout=30_000)
        box.fill("4")
        box.press("Enter")
        view.get_by_text("no warnings or errors").wait_for(timeout=30_000)
        graphs = settled_plots(view, lambda gs: {t["points"] for t in bars(gs)} == {4})
        styled = bars(graphs)
        assert styled and all(t["points"] == 4 for t in styled)  # a bar per rank, 4 ranks
        assert console.ours() == [], "\n".join(console.ours())
    finally:
        keep_evidence(page, console, "01_explore_plan")


def test_dashboard_in_the_browser(lab, browser):
    """Clicks, not code: validate as you type, Load, another strategy, Load again."""
    url = lab
    page, console = open_notebook(browser, url, "dashboard.ipynb")
    try:
        run_all(page)
        dash = page.locator(".jp-CodeCell").first.locator(".jp-OutputArea-output")
        editor = dash.locator("textarea")
        editor.wait_for(timeout=60_000)
        plan_json = editor.input_value()
        assert '"lm_head": "colwise_gather_output"' in plan_json
        editor.fill(plan_json[:-2])
        dash.get_by_text("plan JSON: line", exact=False).wait_for(timeout=30_000)
        editor.fill(plan_json.replace('"rowwise"', '"rowwize"', 1))
        dash.get_by_text("unknown_style", exact=False).first.wait_for(timeout=30_000)
        editor.fill(plan_json)
        dash.get_by_text("plan valid", exact=False).wait_for(timeout=30_000)

        load = dash.locator("button.widget-button", has_text="Load")
        load.click()
        dash.locator("table.tpviz-comparison tr").nth(1).wait_for(timeout=120_000)
        strategy = dash.locator(".widget-dropdown", has_text="strategy").locator("select")
        strategy.select_option(label="replicated")
        page.wait_for_function("b => !b.disabled", arg=load.element_handle(), timeout=30_000)
        load.click()
        dash.locator("table.tpviz-comparison tr").nth(2).wait_for(timeout=120_000)
        page.wait_for_timeout(1000)  # the last throttled redraw

        (memory,) = [
            g for g in plots(dash) if any(t["meta"].get("kind") == "memory" for t in g["traces"])
        ]
        lines = [t for t in memory["traces"] if t["meta"].get("kind") == "memory"]
        assert [t["meta"]["run"] for t in lines] == ["sliced", "sliced", "replicated", "replicated"]
        assert all(t["points"] > 1 for t in lines)
        legend = dash.locator(".legendtext").evaluate_all("ts => ts.map(t => t.textContent)")
        assert "sliced rank 0" in legend and "replicated rank 1" in legend
        save_screenshot(page, "dashboard.png", dash, height=1800)
        assert console.ours() == [], "\n".join(console.ours())
    finally:
        keep_evidence(page, console, "dashboard")


def test_html_report_renders_offline(browser, tiny, tmp_path):
    """The report opens from a file with every network request refused."""
    from tpviz.events import Memory, Phase
    from tpviz.plan import resolve_plan
    from tpviz.report import write_html_report

    plan = resolve_plan(tiny, 2)
    ranks = [
        {
            "rank": r,
            "seconds": 0.1,
            "param_bytes": b,
            "planned_bytes": b,
            "peak_rss_bytes": b + 4096,
            "peak_tensor_bytes": b,
            "forecast_peak_bytes": plan.forecast["sliced"]["peak_bytes"][r],
        }
        for r, b in enumerate(plan.per_rank_bytes)
    ]
    result = {
        "strategy": "sliced",
        "world_size": 2,
        "dtype": "float32",
        "device": "cpu",
        "startup_seconds": 3.0,
        "load_seconds": 0.1,
        "plan_matches_shards": True,
        "ranks": ranks,
        "verify": {"max_abs_diff": 1e-7, "tolerance": 1e-4, "ok": True},
    }
    events = [Memory(r, 10.0, rss=10**8, rss_anon=None, tensor_bytes=0) for r in (0, 1)]
    events += [Phase(r, 10.01, name="loading") for r in (0, 1)]
    events += [
        Memory(r, 10.0 + i / 20, rss=10**8 + i * 10**5, rss_anon=None, tensor_bytes=i)
        for r in (0, 1)
        for i in range(1, 10)
    ]
    path = write_html_report(tmp_path / "report.html", plan, [result, result], [events, None])

    page = browser.new_page(viewport={"width": 1200, "height": 900})
    console = Console(page)
    refused = []

    def offline(route):
        if route.request.url.startswith("file:"):
            route.continue_()
        else:
            refused.append(route.request.url)
            route.abort()

    page.route("**/*", offline)
    try:
        page.goto(path.as_uri())
        page.wait_for_selector(".js-plotly-plot .main-svg", timeout=30_000)
        # plan: bytes, block diagram, table; both loads overlaid, peaks; per load 2 figures
        graphs = plots(page)
        assert len(graphs) == 3 + 2 + 2 * 2
        assert all(g["traces"] for g in graphs)
        assert refused == [] and console.errors == []
    finally:
        page.close()
