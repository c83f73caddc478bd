"""`tpviz ...`: make checkpoints, show plans, load, compare strategies, and the demo.

Exit codes: 0 ok, 2 invalid input (one line on stderr), 1 other failure, 128 + N when ended
by signal N (SIGINT, SIGTERM, SIGHUP: the job is cancelled and cleaned up first). With `--json`
the result goes to stdout as JSON, also on failure (then with `errors`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from .cli_parser import STRATEGIES, UsageError, build_parser
from .format import first_line

if TYPE_CHECKING:
    from .plan import ResolvedPlan
    from .results import LoadResult
    from .suggest.prove import Simulation

__all__ = ["STRATEGIES", "build_parser", "main"]

INVALID_INPUT = 2
FAILURE = 1


class Interrupted(KeyboardInterrupt):
    """A signal asked the CLI to stop: raised in the main thread so that `with` blocks close
    the job (ranks ended, temp dir removed) on the way out."""

    def __init__(self, signum: int):
        self.signum = signal.Signals(signum)
        super().__init__(self.signum.name)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _on_stop_signal(signum: int, frame: object) -> None:
    for s in STOP_SIGNALS:  # a second signal must not break the cleanup the first started
        signal.signal(s, signal.SIG_IGN)
    raise Interrupted(signum)


@contextlib.contextmanager
def _stop_signals_interrupt() -> Iterator[None]:
    """Turn SIGINT, SIGTERM and SIGHUP into `Interrupted` while a command runs (main thread
    only: elsewhere Python cannot install handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _on_stop_signal) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:  # refused as any other input is: one line, and JSON if asked
        if "--json" in argv:
            print(json.dumps({"errors": _error_list(e)}))
        print(f"{e.prog}: error: {e}", file=sys.stderr)
        return INVALID_INPUT
    from .rankserver import rank_imports, start_server
    from .tempdirs import keep_torch_cache_out_of_tmpdir

    keep_torch_cache_out_of_tmpdir()
    # transformers' log lines (notes on a config, deprecations) are not the CLI's output, which
    # is its result, or one line per refusal; TRANSFORMERS_VERBOSITY, if set, still rules
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        if args.command in ("load", "compare", "demo"):
            # its imports (torch; transformers for its models) overlap this process's own work
            source, model = getattr(args, "source", None), getattr(args, "model", None)
            start_server(rank_imports(source, model))
        with _stop_signals_interrupt():
            return COMMANDS[args.command](args)
    except BrokenPipeError:  # stdout's reader left (`| head`): nobody reads the rest
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        print(f"tpviz {args.command}: interrupted ({signum.name}); stopped", file=sys.stderr)
        return 128 + signum
    except Exception as e:  # noqa: BLE001 - the CLI's one place that turns errors into exit codes
        code = INVALID_INPUT if _is_invalid_input(e) else FAILURE
        if getattr(args, "json", False):
            print(json.dumps({"errors": _error_list(e)}))
        print(f"tpviz {args.command}: {first_line(e)}", file=sys.stderr)
        return code


def _error_list(e: Exception) -> list[dict[str, str]]:
    """The JSON `errors`: a plan's full list of issues, else the one exception."""
    from dataclasses import asdict

    from .plan import PlanError

    if isinstance(e, PlanError) and e.errors:
        return [asdict(i) for i in e.errors]
    return [{"code": type(e).__name__, "message": str(e)}]


def _is_invalid_input(e: Exception) -> bool:
    from .launcher import LoadError, MemoryForecastError

    if isinstance(e, MemoryForecastError):
        return True
    if isinstance(e, LoadError):
        return False
    return isinstance(e, (ValueError, FileNotFoundError, FileExistsError))


def _emit(args: argparse.Namespace, data: dict[str, Any], text: str) -> None:
    print(json.dumps(data, indent=2) if args.json else text)


# --- commands ---------------------------------------------------------------------------------


def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    from .format import human_bytes
    from .models.demo import DEFAULT_MAX_SHARD_SIZE, make_checkpoint

    out = make_checkpoint(
        args.directory,
        args.preset,
        dtype=args.dtype,
        tie_embeddings=args.tie_embeddings,
        seed=args.seed,
        max_shard_size=args.max_shard_size or DEFAULT_MAX_SHARD_SIZE,
        layers=args.layers,
        hidden=args.hidden,
        intermediate=args.intermediate,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
    )
    files = sorted(p.name for p in out.iterdir())
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    _emit(
        args,
        {"directory": str(out), "files": files, "bytes": size},
        f"wrote {out} ({human_bytes(size)}): {', '.join(files)}",
    )
    return 0


def _resolve(args: argparse.Namespace):
    from .plan import resolve_plan

    return resolve_plan(
        args.source,
        args.world_size,
        args.plan,
        dtype=args.dtype,
        model=args.model,
        kv_replication=not args.no_kv_replication,
        experts=args.experts,
    )


def cmd_plan(args: argparse.Namespace) -> int:
    from .plan import PlanError
    from .report import plan_table

    if args.suggest:
        from .suggest_cli import cmd_suggest

        return cmd_suggest(args)
    if args.check:
        raise ValueError("--check proves a suggested plan: use it with --suggest")
    plan = _resolve(args)
    simulation = None
    if args.simulate and not plan.errors:
        from .suggest import simulate_plan

        simulation = simulate_plan(plan)
    if args.json:  # built only when asked: a plan over a thousand ranks is a million blocks
        print(json.dumps(_plan_json(plan, simulation), indent=2))
    else:
        print(plan_table(plan, full=args.full))
    if plan.errors:
        # stdout keeps every error (table or JSON); stderr gets the contract's one line
        print(f"tpviz plan: {first_line(PlanError(plan.errors))}", file=sys.stderr)
        return INVALID_INPUT
    if simulation is None:
        return 0
    print(simulation.line(), file=sys.stderr)
    return 0 if simulation.ok else FAILURE


def _plan_json(plan: ResolvedPlan, simulation: Simulation | None) -> dict[str, Any]:
    """The plan JSON, with the simulation's report as the load JSON has its verify, and its
    failure among the errors."""
    data = plan.to_dict()
    if simulation is not None:
        data["simulation"] = asdict(simulation)
        if not simulation.ok:
            failed = {"code": "SimulationFailed", "name": None, "message": simulation.line()}
            data["errors"].append(failed)
    return data


def _launch_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    if args.seed is not None and args.init != "random":
        raise ValueError("--seed seeds --init random; add that, or drop --seed")
    return dict(
        device=args.device,
        init=args.init,
        seed=args.seed or 0,
        verify=args.verify,
        timeout=args.timeout,
        heartbeat_timeout=args.heartbeat_timeout,
        events_dir=args.events,
        profile_dir=args.profile,
        profile_forward=args.profile_forward,
        force=args.force,
    )


def cmd_load(args: argparse.Namespace) -> int:
    from .launcher import launch
    from .progress import follow
    from .report import load_table

    plan = _resolve(args)
    plan.raise_for_errors()
    report = _check_report(args)
    with launch(
        args.source, args.world_size, plan, strategy=args.strategy, **_launch_kwargs(args)
    ) as job:
        result = follow(job, show=not args.json)
    errors = list(result.output_errors or [])
    if report:
        errors += _write_report(report, plan, [result], [job.events])
    return _finish(args, result.to_dict(), load_table(result), errors + _failures(result))


def _failures(result: LoadResult, label: str = "") -> list[dict]:
    """What makes a finished load a failure (exit 1), one error each: shards that differ from
    the plan, a failed verify, a random init whose replicated tensors disagree."""
    out = []
    if not result.plan_matches_shards:
        names = sorted({n for r in result.ranks for n in r.mismatches})
        out.append(("ShardMismatch", f"the shards differ from the plan: {', '.join(names[:5])}"))
    verify = result.verify or {}
    if verify.get("ok") is False:
        why = verify.get("error") or (
            f"max |logits - reference| = {verify['max_abs_diff']:.3g} is above the tolerance "
            f"{verify['tolerance']:g}" + (f"; {verify['note']}" if verify.get("note") else "")
        )
        out.append(("VerifyFailed", f"verify failed: {why}"))
    if (result.init_check or {}).get("ok", True) is False:
        out.append(("InitCheckFailed", "random init: replicated tensors differ across ranks"))
    return [{"code": code, "message": label + message} for code, message in out]


def cmd_compare(args: argparse.Namespace) -> int:
    from .launcher import compare
    from .progress import follow
    from .report import compare_table, load_table

    plan = _resolve(args)
    plan.raise_for_errors()
    events: list = []

    def follow_labelled(job) -> LoadResult:
        # each strategy's progress names it: "[2/3] rank0_broadcast: loading on 2 ranks ..."
        label = f"[{len(events) + 1}/{len(STRATEGIES)}] {job.options.strategy}"
        result = follow(job, show=not args.json, label=label)
        events.append(job.events)
        return result

    report = _check_report(args)
    results = compare(
        args.source,
        args.world_size,
        plan,
        strategies=STRATEGIES,
        follow=follow_labelled,
        **_launch_kwargs(args),
    )
    errors = [e for r in results for e in r.output_errors or []]
    if report:
        errors += _write_report(report, plan, results, events)
    text = "\n\n".join(
        [*(load_table(r) for r in results), "comparison:\n" + compare_table(results)]
    )
    errors += [e for r in results for e in _failures(r, f"{r.strategy}: ")]
    return _finish(args, {"strategies": [r.to_dict() for r in results]}, text, errors)


def _finish(args: argparse.Namespace, data: dict[str, Any], text: str, errors: list[dict]) -> int:
    """Show the result, then one line per failure or output that could not be written (exit
    1): neither hides the load result."""
    unique = list({e["message"]: {"code": "OutputWriteError", **e} for e in errors}.values())
    if unique:
        data = {**data, "errors": unique}
    _emit(args, data, text)
    for error in unique:
        print(f"tpviz {args.command}: {error['message']}", file=sys.stderr)
    return FAILURE if unique else 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .launcher import launch
    from .models.demo import cache_dir, demo_checkpoint
    from .plan import resolve_plan
    from .progress import follow
    from .report import load_table, plan_table

    if not (cache_dir() / f"demo-{args.preset}" / "config.json").exists():
        print(f"making the {args.preset} demo checkpoint in {cache_dir()} ...", file=sys.stderr)
    source = demo_checkpoint(args.preset)
    plan = resolve_plan(source, args.world_size)
    plan.raise_for_errors()
    if not args.json:
        print(f"plan for {source}:\n{plan_table(plan)}\n")
    with launch(source, args.world_size, plan, verify=True) as job:
        result = follow(job, show=not args.json)
    return _finish(args, result.to_dict(), load_table(result), _failures(result))


COMMANDS = {
    "make-checkpoint": cmd_make_checkpoint,
    "plan": cmd_plan,
    "load": cmd_load,
    "compare": cmd_compare,
    "demo": cmd_demo,
}


def _check_report(args: argparse.Namespace) -> str | None:
    """The --report path, checked before anything is launched."""
    from .events import check_apart_from_events
    from .outputs import check_output_file

    if not args.report:
        return None
    check_apart_from_events(args.report, "report", args.events)
    return check_output_file(args.report, "report", args.source)


def _write_report(path: str, plan, results: list[LoadResult], events: list) -> list[dict]:
    """Write the report; its failure, as an output error (nothing is raised)."""
    from .outputs import OutputWriteError, write_error
    from .report import write_html_report

    try:
        write_html_report(path, plan, results, events)
    except OutputWriteError as e:
        return [write_error("report", path, path, e.reason)]
    print(f"report written to {path}", file=sys.stderr)
    return []
