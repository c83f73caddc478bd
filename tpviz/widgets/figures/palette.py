"""What every figure shares: the colour of each rank and style, the binary unit of a bytes
axis, and titles with a note under them."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from plotly.colors import qualitative

from ...styles import DEFAULT_STYLE, STYLES

RANK_COLORS = qualitative.Plotly
# Set2 ends in grey: that stays the colour of `replicate`, the default style
STYLE_COLORS = dict(
    zip([s for s in STYLES if s != DEFAULT_STYLE], [*qualitative.Set2[:-1], *qualitative.Pastel1])
) | {DEFAULT_STYLE: qualitative.Set2[-1]}

UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}  # the axes use the tables' binary units


def unit_for(nbytes: float) -> str:
    """The unit a bytes axis reads best in, for values up to about `nbytes`."""
    if nbytes >= 4 * UNITS["GiB"]:
        return "GiB"
    return "MiB" if nbytes >= UNITS["MiB"] / 2 else "KiB"


def in_unit(values: Sequence[float] | np.ndarray, unit: str) -> np.ndarray:
    """Bytes as values of a `unit` axis."""
    # numpy arrays: plotly validates and sends them without a Python loop per point
    return np.asarray(values, dtype=float) / UNITS[unit]


def rank_color(index: int) -> str:
    return RANK_COLORS[index % len(RANK_COLORS)]


def style_color(style: str) -> str:
    """The style's colour: the same in the bar chart, the plan table's badges and legends."""
    return STYLE_COLORS.get(style, STYLE_COLORS[DEFAULT_STYLE])


def titled(title: str, note: str) -> dict[str, str]:
    """A title with a smaller line under it (a `<br><sup>` line, which FigureWidget redraws
    reliably, unlike plotly's `subtitle` after a relayout)."""
    return {"text": f"{title}<br><sup>{note}</sup>" if note else title}
