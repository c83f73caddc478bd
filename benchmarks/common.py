"""Helpers shared by the benchmarks: arguments, medians and sizes."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from tpviz.models.demo import demo_checkpoint


def median(values) -> float:
    return statistics.median(values)


def gib(n: float) -> str:
    return f"{n / 1024**3:.2f} GiB" if abs(n) >= 1024**3 else f"{n / 1024**2:.0f} MiB"


def parse_args(description: str) -> tuple[argparse.Namespace, Path]:
    """`[SOURCE] [--world-size N] [--rounds N]`; SOURCE defaults to the medium demo."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("source", nargs="?", help="checkpoint dir (default: the medium demo)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    return args, Path(args.source) if args.source else demo_checkpoint("medium")
