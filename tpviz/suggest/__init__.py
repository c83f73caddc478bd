"""Suggested TP plans for models that ship none (see propose.py): candidates from the
model's dataflow, kept only where simulated ranks reproduce the unsharded logits."""

from .propose import Decision, Suggestion, suggest_plan

__all__ = ["Decision", "Suggestion", "suggest_plan"]
