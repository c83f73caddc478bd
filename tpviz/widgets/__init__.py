"""Notebook widgets: `PlanView`, `LoadMonitor` and `Dashboard` (ipywidgets and plotly
`FigureWidget`), and the pure figure builders they share with the HTML report (`figures`).

Nothing is imported here, so the report can use `figures` without loading ipywidgets.
"""
