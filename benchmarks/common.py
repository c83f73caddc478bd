"""Helpers shared by the benchmarks: demo checkpoints in a cache dir, and medians."""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from tpviz.models.demo import make_checkpoint


def cached_checkpoint(preset: str) -> Path:
    """The `preset` demo checkpoint, made once in $TPVIZ_CACHE (default ~/.cache/tpviz)."""
    cache = Path(os.environ.get("TPVIZ_CACHE", Path.home() / ".cache" / "tpviz"))
    path = cache / f"bench-{preset}"
    if not (path / "config.json").exists():
        tmp = cache / f".bench-{preset}-{os.getpid()}"
        make_checkpoint(tmp, preset)
        tmp.rename(path)
    return path


def median(values) -> float:
    return statistics.median(values)


def gib(n: float) -> str:
    return f"{n / 1024**3:.2f} GiB" if abs(n) >= 1024**3 else f"{n / 1024**2:.0f} MiB"
