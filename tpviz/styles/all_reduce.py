"""`all_reduce`: a module whose output is a partial sum (e.g. shared experts whose tensors are
cut by their own keys); the output is summed across ranks."""

from __future__ import annotations

from .base import PARTIAL, REPLICATE, Forward, Style


class AllReduce(Style):
    name = "all_reduce"
    summary = (
        "the module computes on its plain local tensors (placed by their own keys); its "
        "partial output is all-reduced"
    )
    places_params = False
    forward = Forward(REPLICATE, PARTIAL, REPLICATE, collective="all-reduce of the output")
