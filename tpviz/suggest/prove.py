"""A plan proven on simulated ranks: a small real instance of the model (its config with at
most CHECK_LAYERS layers, float32, random weights) run whole and on the plan's simulated ranks
(simulate.py), their logits compared. The suggester proves each candidate so;
`simulate_plan` proves a plan a person wrote, before any rank starts: styles that do not
compose (a colwise output fed to a module that expects its input whole, a cut that forward
code reshapes by a head count) fail or give other logits here, as they would on real ranks.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..format import first_line
from ..models import build_skeleton, get_adapter, logits_tolerance, prompt_ids, read_config
from ..plan import ResolvedPlan, resolve_plan
from ..plan.experts import fit_expert_kernels
from .simulate import RankForwardError, run_ranks

LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
CHECK_LAYERS = 2  # layers of the checking instance: enough for one layer to feed the next
MAX_INSTANCE_BYTES = 2 << 30


@dataclass(frozen=True)
class Simulation:
    """A plan's simulated ranks against the whole instance: `ok` when every rank's logits
    are within `tolerance`; else `reason` says what failed."""

    ok: bool
    world_size: int
    max_abs_diff: float | None  # None: no logits to compare (a rank's forward failed)
    tolerance: float
    reason: str | None

    def line(self) -> str:
        """One line for a person: what was simulated, and the verdict."""
        head = f"simulated {self.world_size} ranks ({CHECK_LAYERS}-layer float32 instance)"
        if not self.ok:
            return f"{head}: FAILED: {self.reason}"
        return (
            f"{head}: logits within {self.max_abs_diff:.2g} of the whole model's "
            f"(tolerance {self.tolerance:.2g}): ok"
        )


@dataclass
class Proof:
    """Checks a plan's keys: they resolve for the source (`resolve`) without errors, and the
    plan's simulated ranks reproduce the instance's `reference` logits."""

    instance: nn.Module
    run: Callable[[nn.Module], torch.Tensor]
    reference: torch.Tensor
    tolerance: float
    world_size: int
    resolve: Callable[[dict[str, str]], ResolvedPlan]  # for the source itself
    experts: str = "tp"
    kv_replication: bool = True

    @classmethod
    def of(
        cls,
        source: str | os.PathLike,
        world_size: int,
        model: str | None,
        resolve: Callable[[dict[str, str]], ResolvedPlan],
        **layout: Any,
    ) -> Proof:
        """The proof for the model at `source`: its instance, and the instance's logits."""
        instance, run = _instance(read_config(source), model, source)
        try:
            with torch.inference_mode():
                reference = run(instance)
        except Exception as e:  # noqa: BLE001 - the model's own code, on its own config
            raise ValueError(
                f"{source}: the whole model's forward fails on a {CHECK_LAYERS}-layer instance "
                f"built from its config.json ({type(e).__name__}: {first_line(e)}); no plan "
                "can be proven against it: check the config"
            ) from e
        tolerance = logits_tolerance("float32", reference.abs().max().item())  # as built
        return cls(instance, run, reference, tolerance, world_size, resolve, **layout)

    def check(self, patterns: dict[str, str]) -> tuple[str | None, float]:
        """(None, max |diff|) when proven; else (the reason, max |diff| or nan)."""
        for plan in (
            self.resolve(patterns),
            resolve_plan(
                self.instance,
                self.world_size,
                patterns,
                kv_replication=self.kv_replication,
                experts=self.experts,
            ),
        ):
            if plan.errors:
                return f"{plan.errors[0].code}: {plan.errors[0].message}", float("nan")
        try:
            outs = run_ranks(self.instance, plan, self.run)
        except RankForwardError as e:  # the module code failing on a rank's tensors
            return str(e), float("nan")
        diff = max((o - self.reference).abs().max().item() for o in outs)
        if not diff <= self.tolerance:
            return f"the ranks' logits differ from the whole model's by {diff:.3g}", diff
        return None, diff


def simulate_plan(plan: ResolvedPlan) -> Simulation:
    """Run `plan` (resolved from a checkpoint or config.json directory) on simulated ranks
    and compare their logits with the whole model's. Raises ValueError for a plan with errors
    or one resolved against an in-memory module."""
    if plan.source is None:
        raise ValueError(
            "simulate_plan builds a small instance from config.json: resolve the plan from a "
            "checkpoint or config directory"
        )
    plan.raise_for_errors()
    proof = Proof.of(
        plan.source,
        plan.world_size,
        plan.model,
        lambda _: plan,
        experts=plan.experts,
        kv_replication=plan.kv_replication,
    )
    reason, diff = proof.check(plan.patterns)
    return Simulation(
        ok=reason is None,
        world_size=plan.world_size,
        max_abs_diff=None if math.isnan(diff) else diff,
        tolerance=proof.tolerance,
        reason=reason,
    )


def _instance(
    config: dict[str, Any], model: str | None, source: str | os.PathLike
) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """A real float32 instance of the model with at most CHECK_LAYERS layers, random weights
    (constant ones, such as norms, made distinct), and the forward of the fixed prompt."""
    small = _fewer_layers(config)
    adapter = get_adapter(small, model, source)
    size = sum(p.numel() * 4 for p in build_skeleton(adapter, small, torch.float32).parameters())
    if size > MAX_INSTANCE_BYTES:
        raise ValueError(
            f"{source}: a {CHECK_LAYERS}-layer float32 instance of this model takes "
            f"{size / 2**30:.1f} GiB, more than the {MAX_INSTANCE_BYTES >> 30} GiB a plan is "
            "proven with in one process; use a config with smaller dims (same architecture), "
            "then resolve that plan for the full model"
        )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        instance = build_skeleton(adapter, small, torch.float32, device="cpu")
        fit_expert_kernels(instance)
        with torch.no_grad():
            for p in instance.parameters():
                if p.numel() > 1 and bool((p == p.flatten()[0]).all()):
                    p.add_(torch.randn_like(p) * 0.1)
    ids = prompt_ids(adapter, small)
    return instance, lambda m: adapter.logits(m, ids).float()


def _fewer_layers(config: dict[str, Any]) -> dict[str, Any]:
    """The config with at most CHECK_LAYERS layers (per-layer lists cut to match)."""
    out = dict(config)
    for key in LAYER_KEYS:
        layers = out.get(key)
        if isinstance(layers, int) and layers > CHECK_LAYERS:
            out[key] = CHECK_LAYERS
            for k, v in config.items():
                if isinstance(v, list) and len(v) == layers:
                    out[k] = v[:CHECK_LAYERS]
    return out
