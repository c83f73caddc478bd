"""The shape of tpviz, read from the source with `ast`: in the import graph (function-level
imports included) no cycle anywhere and the pure core imports nothing from the edges; no
module over 400 lines and no function over 60."""

from __future__ import annotations

import ast
from pathlib import Path

import tpviz

PACKAGE = Path(tpviz.__file__).parent

# The edges: processes, widgets, CLI and text/HTML output depend inward, never the reverse.
EDGES = (
    "runtime",
    "launcher",
    "job",
    "processes",
    "rankserver",
    "commands",
    "widgets",
    "cli",
    "cli_parser",
    "report",
    "progress",
    "suggest_cli",
)
# The pure core: plan math, styles, checkpoint metadata, formatting, model skeletons.
CORE = (
    "plan",
    "styles",
    "checkpoint",
    "format",
    "chunks",
    "heads",
    "keymap",
    "inputs",
    "outputs",
    "safetensors_header",
    "token_ids",
    "events",
    "capacity",
    "models",
    "strategies",
    "results",
    "messages",
    "eventlog",
    "tracking",
    "liveness",
    "suggest",
    "tempdirs",
)

# Known exceptions, each an edge that closes a cycle; keep this list empty.
KNOWN_CYCLE_EDGES: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    parts = ["tpviz", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The tpviz modules `name` imports, at any depth of its code. `from pkg import x` counts
    as importing the submodule `pkg.x` when there is one, else `pkg` itself."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, path, known) for name, path in known.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path `[a, b, ..., a]`, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def under(name: str, roots: tuple[str, ...]) -> bool:
    return any(name == f"tpviz.{r}" or name.startswith(f"tpviz.{r}.") for r in roots)


def test_the_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    assert "tpviz.widgets.figures" in graph["tpviz.widgets.plan_view"]  # from . import figures
    assert "tpviz.launcher" in graph["tpviz.cli"]  # inside a function
    assert "tpviz.inputs" in graph["tpviz.models.config"]  # from ..inputs import ...


def test_no_import_cycle():
    graph = import_graph()
    stale = {(a, b) for a, b in KNOWN_CYCLE_EDGES if b not in graph[a]}
    assert not stale, f"known exceptions that no longer exist, drop them: {sorted(stale)}"
    for a, b in KNOWN_CYCLE_EDGES:
        graph[a].discard(b)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_core_imports_nothing_from_the_edges():
    graph = import_graph()
    bad = sorted(
        f"{name} imports {dep}"
        for name, deps in graph.items()
        if under(name, CORE)
        for dep in deps
        if under(dep, EDGES)
    )
    assert not bad, "core module depends on an edge: " + "; ".join(bad)


# Size keeps the code readable (DESIGN.md, principle 6): no module over ~400 lines, no function
# over ~60, counted from the `def` line (decorators aside) to the function's last line.
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def relative(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


def test_no_module_is_over_400_lines():
    sizes = {relative(p): len(p.read_text().splitlines()) for p in modules().values()}
    over = [f"{path}: {n} lines" for path, n in sorted(sizes.items()) if n > MAX_MODULE_LINES]
    message = f"modules over {MAX_MODULE_LINES} lines; split them by concern:\n"
    assert not over, message + "\n".join(over)


def test_no_function_is_over_60_lines():
    over = []
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_FUNCTION_LINES:
                    over.append(f"{relative(path)}:{node.lineno} {node.name}: {size} lines")
    message = f"functions over {MAX_FUNCTION_LINES} lines; split them into named steps:\n"
    assert not over, message + "\n".join(over)
