"""Plan patterns and their precedence: which plan key decides the style of a module or tensor.

A key matches a name that equals it or ends with it at a segment boundary; `*` stands for one
numeric path segment. A parameter key beats a module key (see resolve.py); among the keys that
match one name, explicit layer indices beat wildcards, then the longer pattern wins.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .. import styles
from ..inputs import read_json
from .types import PlanIssue


@dataclass(frozen=True)
class PlanKey:
    """One plan key, compiled: what it matches and how strongly."""

    pattern: str
    style_given: str
    regex: re.Pattern[str]
    specificity: tuple[int, int]  # (explicit indices, length): higher wins

    @classmethod
    def compile(cls, pattern: str, style_given: str) -> PlanKey:
        segments = pattern.split(".")
        body = r"\.".join(r"\d+" if s == "*" else re.escape(s) for s in segments)
        regex = re.compile(rf"(?:^|\.){body}$")
        # explicit layer indices beat wildcards; then the longer pattern wins
        specificity = (sum(seg.isdigit() for seg in segments), len(pattern))
        return cls(pattern, style_given, regex, specificity)


class CompiledPlan:
    """Plan patterns compiled once. `*` matches one numeric path segment; a key matches a name
    that equals it or ends with it at a segment boundary. `used`: the keys that matched."""

    def __init__(self, patterns: Mapping[str, str]):
        self.keys: list[PlanKey] = []
        self.errors: list[PlanIssue] = []
        self.used: set[str] = set()
        for pattern, style_given in patterns.items():
            issue = _style_issue(pattern, style_given)
            if issue is not None:
                self.errors.append(issue)
            if isinstance(style_given, str):
                self.keys.append(PlanKey.compile(pattern, style_given))

    def peek(self, name: str) -> PlanKey | None:
        """The key `best` would give `name`, without marking any key used."""
        found = [k for k in self.keys if k.regex.search(name)]
        return max(found, key=lambda k: k.specificity) if found else None

    def best(self, name: str) -> PlanKey | None:
        found = [k for k in self.keys if k.regex.search(name)]
        for k in found:
            self.used.add(k.pattern)
        return max(found, key=lambda k: k.specificity) if found else None


def _style_issue(pattern: str, style_given: Any) -> PlanIssue | None:
    """What is wrong with the style a key gives. A known style tpviz cannot execute is no issue
    here: it is reported per module, once the walk knows which modules it hits."""
    if not isinstance(style_given, str):
        message = f"plan key {pattern!r}: style must be a string, got {style_given!r}"
        return PlanIssue("invalid_plan", pattern, message)
    try:
        styles.canonical(style_given)
    except styles.UnknownStyle as e:
        return PlanIssue("unknown_style", pattern, f"plan key {pattern!r}: {e}")
    except styles.UnsupportedStyle:
        pass
    return None


TRANSFORMERS_FORM = ("base_model_tp_plan", "tp_plan")  # merged in this order


def load_plan_patterns(plan: Mapping[str, str] | str | os.PathLike | None) -> dict[str, str] | None:
    """A pattern dict from a dict or a JSON file (`{pattern: style}` or transformers' form
    `{"tp_plan": {...}, "base_model_tp_plan": {...}}`)."""
    if plan is None:
        return None
    where = "the plan"
    if isinstance(plan, (str, os.PathLike)):
        where = f"plan file {plan}"
        plan = read_json(plan, "plan file", unique_keys=True)
    parts = [plan]
    if isinstance(plan, Mapping) and ("tp_plan" in plan or "base_model_tp_plan" in plan):
        _check_transformers_form(plan, where)
        parts = [plan.get(k) if plan.get(k) is not None else {} for k in TRANSFORMERS_FORM]
    merged: dict[str, str] = {}
    for part in parts:
        if not isinstance(part, Mapping) or not all(isinstance(k, str) for k in part):
            raise ValueError(
                f"{where}: a plan must be a JSON object of pattern -> style (or transformers' "
                f'{{"tp_plan": {{...}}, "base_model_tp_plan": {{...}}}}), got '
                f"{type(part).__name__} {_short(part)}"
            )
        clash = next((k for k, v in part.items() if merged.get(k, v) != v), None)
        if clash is not None:  # the same key in tp_plan and base_model_tp_plan
            raise ValueError(
                f"{where}: {clash!r} is {merged[clash]!r} in base_model_tp_plan but "
                f"{part[clash]!r} in tp_plan; give it one style"
            )
        merged.update(part)
    return merged


def _check_transformers_form(plan: Mapping[str, Any], where: str) -> None:
    """Refuse a key beside transformers' two (a misspelt one, or a pattern that belongs
    inside `tp_plan`): it would be ignored. `suggestion` is `tpviz plan --suggest`'s own."""
    stray = [k for k in plan if k not in TRANSFORMERS_FORM and k != "suggestion"]
    if stray:
        raise ValueError(
            f"{where}: {stray[0]!r} is not part of a plan in transformers' form, whose patterns "
            "go in tp_plan and base_model_tp_plan; move it there, or fix its name"
        )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
