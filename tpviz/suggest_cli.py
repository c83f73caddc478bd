"""`tpviz plan SOURCE --suggest [--check]`: print a suggested plan, and prove it on real ranks.

stdout gets the plan itself (`{pattern: style}`, ready for `--plan FILE`), or with `--json`
the suggestion (`tp_plan` beside its reasoning, itself a valid plan file); stderr gets why
each unit was sharded or left whole. `--check` loads the suggestion at the world size on
real ranks and compares logits with the single-process reference: exit 0 only if they match
and every rank holds what the plan says.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .format import human_bytes
from .suggest import Suggestion, suggest_plan

FAILURE = 1


def cmd_suggest(args: argparse.Namespace) -> int:
    if args.plan:
        raise ValueError("--suggest proposes its own plan: drop --plan (or drop --suggest)")
    if args.simulate:
        raise ValueError("--suggest proves its plan on simulated ranks already: drop --simulate")
    if args.experts != "tp":
        raise ValueError(
            "--suggest chooses the experts' layout itself (whole experts per rank where that "
            "proves): drop --experts"
        )
    suggestion = suggest_plan(
        args.source,
        args.world_size,
        model=args.model,
        dtype=args.dtype,
        kv_replication=not args.no_kv_replication,
    )
    plan = suggestion.resolved
    if plan.errors:
        raise ValueError(f"the suggested plan does not resolve: {plan.errors[0].message}")
    data = suggestion.to_dict()
    if not args.json:
        print(json.dumps(suggestion.plan, indent=2))
        print(suggestion_text(suggestion), file=sys.stderr)
    if not args.check:
        if args.json:
            print(json.dumps(data, indent=2))
        return 0
    check = _check(args, suggestion)
    if args.json:
        print(json.dumps({**data, "check": check}, indent=2))
    else:
        print(_check_line(check), file=sys.stderr)
    return 0 if check["ok"] else FAILURE


def suggestion_text(s: Suggestion) -> str:
    """Why each unit is sharded or left whole, and the share of the decoder it shards."""
    lines = [
        f"suggested plan for {s.resolved.world_size} ranks: shards "
        f"{human_bytes(s.decoder_sharded_bytes)} of the decoder layers' "
        f"{human_bytes(s.decoder_bytes)} ({s.decoder_share:.1%}); simulated ranks match the "
        f"whole model within {s.max_abs_diff:.2g} (tolerance {s.tolerance:.2g})"
    ]
    for d in s.decisions:
        if d.kind == "other":
            lines.append(f"  {d.patterns[0]}: replicated ({d.tried[0]})")
            continue
        if d.kind == "experts":  # the modules' styles; their tensors' keys are derived
            styles = ", ".join(sorted({d.styles[p] for p in d.patterns}))
        else:
            styles = ", ".join(sorted(set(d.styles.values()))) or "replicated"
        lines.append(f"  {' + '.join(d.patterns)}: {styles}")
        lines += [f"      not {why}" for why in d.tried]
    return "\n".join(lines)


def _check(args: argparse.Namespace, suggestion: Suggestion) -> dict[str, Any]:
    """Load the suggestion on real ranks with verification: the load JSON's verdicts."""
    from .launcher import launch
    from .progress import follow

    if not suggestion.resolved.has_weights:
        raise ValueError(
            f"{args.source}: --check loads the checkpoint, and this one has no weights"
        )
    with launch(args.source, args.world_size, suggestion.resolved, verify=True) as job:
        result = follow(job, show=not args.json)
    verify = result.verify or {}
    ok = bool(result.plan_matches_shards) and verify.get("ok") is True
    return {
        "ok": ok,
        "world_size": args.world_size,
        "max_abs_diff": verify.get("max_abs_diff"),
        "tolerance": verify.get("tolerance"),
        "plan_matches_shards": result.plan_matches_shards,
        "error": verify.get("error"),  # the forward failed: no logits to compare
    }


def _check_line(check: dict[str, Any]) -> str:
    verdict = "ok" if check["ok"] else "FAILED"
    logits = (
        f"the forward failed ({check['error']})"
        if check["error"]
        else f"logits max |diff| {check['max_abs_diff']:.3g} (tolerance {check['tolerance']:.0e})"
    )
    return (
        f"check: {check['world_size']} ranks, {logits}, plan_matches_shards "
        f"{str(check['plan_matches_shards']).lower()}: {verdict}"
    )
