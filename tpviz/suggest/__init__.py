"""Suggested TP plans for models that ship none (see propose.py): candidates from the
model's dataflow, kept only where simulated ranks reproduce the unsharded logits; and any
plan proven the same way before a load (prove.py)."""

from .propose import Decision, Suggestion, suggest_plan
from .prove import Simulation, simulate_plan

__all__ = ["Decision", "Simulation", "Suggestion", "simulate_plan", "suggest_plan"]
