"""Pure plotly builders for the widgets and the HTML report, one module per concern:

- `palette`        rank and style colours, the unit of a bytes axis, titles with a note
- `plan`           bytes per rank by style, the plan table, the most telling tensor
- `blocks`         one tensor's block diagram, drawn to scale
- `experts`        a MoE layer: experts x ranks, router and shared experts beside
- `memory_series`  memory samples per rank as events arrive, and each load's forecasts
- `memory`         memory over time: lines, forecast lines, measures, layout
- `results`        a finished load: summary rows and table, loads compared, headline, peaks
                   vs forecasts

No ipywidgets here: everything returns a `plotly.graph_objects.Figure` or plain data, so all
that is drawn is testable headless and exportable to static HTML. `figures.X` names every
builder, whichever module holds it.
"""

from .blocks import block_diagram_figure, block_rect
from .experts import expert_bytes, experts_grid_figure, experts_modules
from .memory import (
    ABSOLUTE_MEASURES,
    MEASURES,
    default_measure,
    memory_figure,
    memory_layout,
    memory_unit,
    rank_traces,
)
from .memory_series import MAX_POINTS, MemoryRun, MemorySeries, memory_run, thin
from .palette import (
    RANK_COLORS,
    STYLE_COLORS,
    UNITS,
    in_unit,
    rank_color,
    style_color,
    titled,
    unit_for,
)
from .plan import bytes_by_style_figure, plan_table_figure, representative_tensor
from .results import (
    comparison_html,
    headline,
    peaks_figure,
    summary_figure,
    summary_rows,
    table_html,
    verify_text,
)

__all__ = [
    "ABSOLUTE_MEASURES",
    "MAX_POINTS",
    "MEASURES",
    "RANK_COLORS",
    "STYLE_COLORS",
    "UNITS",
    "MemoryRun",
    "MemorySeries",
    "block_diagram_figure",
    "block_rect",
    "bytes_by_style_figure",
    "comparison_html",
    "default_measure",
    "expert_bytes",
    "experts_grid_figure",
    "experts_modules",
    "headline",
    "in_unit",
    "memory_figure",
    "memory_layout",
    "memory_run",
    "memory_unit",
    "peaks_figure",
    "plan_table_figure",
    "rank_color",
    "rank_traces",
    "representative_tensor",
    "style_color",
    "summary_figure",
    "summary_rows",
    "table_html",
    "thin",
    "titled",
    "unit_for",
    "verify_text",
]
