"""tpviz: see and run tensor-parallel loading of PyTorch models.

Heavy parts (process launching, widgets) are imported on first use so that `import tpviz`
and `tpviz plan` stay quick.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "resolve_plan": "tpviz.plan",
    "ResolvedPlan": "tpviz.plan",
    "PlanError": "tpviz.plan",
    "suggest_plan": "tpviz.suggest",
    "simulate_plan": "tpviz.suggest",
    "make_checkpoint": "tpviz.models.demo",
    "demo_checkpoint": "tpviz.models.demo",
    "launch": "tpviz.launcher",
    "compare": "tpviz.launcher",
    "LoadJob": "tpviz.launcher",
    "LoadError": "tpviz.launcher",
    "LoadResult": "tpviz.results",
    "RankResult": "tpviz.results",
    "load_sharded": "tpviz.runtime.in_group",
    "PlanView": "tpviz.widgets.plan_view",
    "LoadMonitor": "tpviz.widgets.monitor",
    "Dashboard": "tpviz.widgets.dashboard",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tpviz' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
