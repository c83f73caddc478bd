"""Verification of a sharded load: logits of the fixed prompt against a single-process model
built from the same checkpoint (or the same seed). The job asks for it after loading; the
reference model is built in the caller's process, one whole copy, and dropped at once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..checkpoint import Checkpoint
from ..choices import SIXTEEN_BIT_DTYPES
from ..errors import CommandFailed, LoadError, failed_in, failing_module
from ..models import get_adapter, logits_tolerance, prompt_ids, read_config
from ..models.config import error_text
from ..plan import ResolvedPlan
from ..plan.experts import expert_count
from .options import LoadOptions
from .reference import FullModel

SLICED_RANDOM_NOTE = "sliced random init cannot match a single-process draw"
ROUTING_NOTE = (
    "a mixture-of-experts router may pick other experts after one 16-bit rounding step: "
    "load in float32 (--dtype float32) to check the plan itself"
)


def fixed_prompt(plan: ResolvedPlan) -> torch.Tensor:
    """The fixed token ids, taken modulo the model's vocabulary."""
    config = read_config(plan.source)
    return prompt_ids(get_adapter(config, plan.model, plan.source), config)


def reference_logits(plan: ResolvedPlan, options: LoadOptions, ids: torch.Tensor) -> torch.Tensor:
    """Logits of `ids` from the whole model in this process, loaded or drawn as the job was.
    A forward that fails here fails unsharded: LoadError, naming the module."""
    config = read_config(plan.source)
    adapter = get_adapter(config, plan.model, plan.source)
    reference = FullModel(plan, adapter, config, options.seed)
    if options.init == "random":
        reference.draw()
    else:
        reference.load_checkpoint(Checkpoint.open(plan.source))
    try:
        with torch.no_grad():
            return adapter.logits(reference.model, ids)
    except Exception as e:  # noqa: BLE001 - whatever the model's code raises, said in one line
        module = failing_module(e, reference.model)
        where = f" ({failed_in(module).strip()})" if module is not None else ""
        raise LoadError(
            f"the model's forward fails in a single process too{where}: {error_text(e)}; "
            "its config or code is at fault, not the plan"
        ) from None


def verify_forward(
    plan: ResolvedPlan,
    options: LoadOptions,
    ids: torch.Tensor,
    sharded_forward: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, Any]:
    """The `verify` object of the load JSON: the sharded model's logits of `ids`
    (`sharded_forward`) against the reference's. A sharded forward that fails is checked
    unsharded: if it fails there too, that is the error, not the ranks' (which would blame the
    plan's cuts). A job that ended meanwhile (cancelled, a rank dead) is not checked."""
    try:
        sharded = sharded_forward(ids)
    except CommandFailed:
        reference_logits(plan, options, ids)  # raises if the model fails unsharded too
        raise
    return _compare_logits(plan, options, ids, sharded)


def _compare_logits(
    plan: ResolvedPlan, options: LoadOptions, ids: torch.Tensor, sharded: torch.Tensor
) -> dict[str, Any]:
    """The `verify` object of the load JSON for the sharded model's logits of `ids`."""
    expected = reference_logits(plan, options, ids)
    if not expected.isfinite().all():  # no plan is to blame: nothing to compare with
        raise ValueError(
            "the model's logits are not finite (NaN or inf) in a single process too: its "
            "weights or config.json compute them, whatever the plan"
        )
    diff = (sharded.float() - expected.float()).abs().max().item()
    limit = logits_tolerance(plan.dtype, expected.float().abs().max().item())
    report: dict[str, Any] = {
        "max_abs_diff": diff,
        "tolerance": limit,
        "ok": diff <= limit,
        "prompt": ids.tolist(),
    }
    if options.init == "random" and options.strategy == "sliced":
        report["note"] = SLICED_RANDOM_NOTE
        report["ok"] = None
    elif (
        not report["ok"]
        and plan.dtype in SIXTEEN_BIT_DTYPES
        and expert_count(read_config(plan.source))
    ):
        report["note"] = ROUTING_NOTE
    return report
