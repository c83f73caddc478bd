"""The loading strategies by name: the one list of them. A new strategy is a module with a
`run(executor)` function (see executor.py) and a line here."""

from __future__ import annotations

from . import rank0_broadcast, replicated, sliced
from .executor import Strategy

STRATEGIES: dict[str, Strategy] = {
    "sliced": sliced.run,
    "rank0_broadcast": rank0_broadcast.run,
    "replicated": replicated.run,
}
