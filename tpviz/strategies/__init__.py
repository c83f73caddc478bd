"""Loading strategies: one module each, its steps written once against `Executor`; the
runtime executes them, and `forecast` runs the same steps over a counting executor."""

from .counting import Forecast, Ledger, forecast
from .executor import Executor, Strategy
from .registry import STRATEGIES

__all__ = ["STRATEGIES", "Executor", "Forecast", "Ledger", "Strategy", "forecast"]
