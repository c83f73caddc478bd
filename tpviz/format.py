"""The one place text is shaped: bytes, shapes, counts, verdicts, layer folding and errors as
one line, shared by plan warnings, the CLI's tables, the HTML report, the widgets and the
ranks' failures (pure, no imports)."""

from __future__ import annotations

import re
from collections.abc import Sequence

# An index segment between two others: `model.layers.3.mlp` -> `model.layers.*.mlp`. The
# lookahead lets consecutive indices (`blocks.0.1.conv`) fold too.
_INDEX = re.compile(r"\.\d+(?=\.)")


def first_line(error: BaseException) -> str:
    """An error's message as one line: its first (its type's name when it says nothing)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def human_bytes(n: float | None) -> str:
    """`512 B`, `1.5 MiB`; `-` for no value."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def shape_text(shape: Sequence[int]) -> str:
    """`1024×512`; `scalar` for a 0-d tensor."""
    return "×".join(map(str, shape)) if len(shape) else "scalar"


def count(n: int, noun: str) -> str:
    """`1 tensor`, `2 tensors`."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def verdict(ok: bool | None) -> str:
    """A verification's outcome in one word (None: the two sides could not be compared)."""
    return {True: "ok", False: "FAILED", None: "not comparable"}[ok]


def fold_layers(name: str) -> str:
    """The name with every inner index replaced by `*`, so that tensors differing only by
    layer (or expert) index fold into one row: `model.layers.*.mlp.up_proj.weight`."""
    return _INDEX.sub(".*", name)


def layer_of(name: str) -> str | None:
    """The layer a tensor belongs to (`model.layers.3`): its name up to the first index."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if i and part.isdigit():
            return ".".join(parts[: i + 1])
    return None
