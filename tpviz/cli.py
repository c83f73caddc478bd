"""`tpviz ...`: make checkpoints, show plans, load, compare strategies, and the demo.

Exit codes: 0 ok, 2 invalid input (one line on stderr), 1 other failure, 128 + N when ended
by signal N (SIGINT, SIGTERM, SIGHUP: the job is cancelled and cleaned up first). With `--json`
the result goes to stdout as JSON, also on failure (then with `errors`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

INVALID_INPUT = 2
FAILURE = 1


class InvalidInput(Exception):
    pass


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


def _shared(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=int, default=2, help="number of ranks (default 2)")
    p.add_argument("--plan", help="plan file: {pattern: style} or transformers' tp_plan form")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="target dtype (default: the checkpoint's)",
    )
    p.add_argument("--model", default="auto", help="auto, builtin, hf or PKG.MOD:FN (default auto)")
    p.add_argument("--json", action="store_true", help="machine-readable result on stdout")


def _load_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--verify",
        action="store_true",
        help="compare logits on a fixed prompt with a single-process reference",
    )
    p.add_argument(
        "--init",
        choices=["checkpoint", "random"],
        default="checkpoint",
        help="random: initialise from --seed instead of loading",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", metavar="DIR", help="write torch.profiler traces for TensorBoard")
    p.add_argument(
        "--profile-forward",
        action="store_true",
        help="with --profile, also profile one forward of the fixed prompt",
    )
    p.add_argument("--events", metavar="DIR", help="write each rank's events as rank{r}.jsonl")
    p.add_argument("--report", metavar="FILE.html", help="write a self-contained HTML report")
    p.add_argument("--timeout", type=float, help="fail if loading takes longer (seconds)")
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="fail if a rank stays silent (frozen) this long (default 30)",
    )
    p.add_argument(
        "--force", action="store_true", help="load even if the memory forecast says it will not fit"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpviz", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-checkpoint", help="write a deterministic Llama-family checkpoint")
    p.add_argument("directory")
    p.add_argument("--preset", choices=["tiny", "small", "medium"], default="tiny")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--tie-embeddings", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shard-size", type=int, help="bytes per .safetensors file")
    for dim in ("layers", "hidden", "intermediate", "heads", "kv-heads", "vocab"):
        p.add_argument(f"--{dim}", type=int, help=f"override the preset's {dim}")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("plan", help="resolve a TP plan and show what every rank holds")
    p.add_argument("source", help="checkpoint dir, or a dir holding only config.json")
    _shared(p)
    p.add_argument("--full", action="store_true", help="one row per tensor (no folding)")

    p = sub.add_parser("load", help="load a checkpoint on local ranks")
    p.add_argument("source")
    _shared(p)
    p.add_argument(
        "--strategy", choices=["sliced", "rank0_broadcast", "replicated"], default="sliced"
    )
    _load_flags(p)

    p = sub.add_parser("compare", help="load with every strategy in turn and compare")
    p.add_argument("source")
    _shared(p)
    _load_flags(p)

    p = sub.add_parser("demo", help="make the demo checkpoint, show its plan, load it")
    p.add_argument("--preset", choices=["tiny", "small", "medium"], default="small")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--json", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with _stop_signals_interrupt():
            return COMMANDS[args.command](args)
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        print(f"tpviz {args.command}: interrupted ({signum.name}); stopped", file=sys.stderr)
        return 128 + signum
    except Exception as e:  # noqa: BLE001 - the CLI's one place that turns errors into exit codes
        code = INVALID_INPUT if _is_invalid_input(e) else FAILURE
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        if getattr(args, "json", False):
            print(json.dumps({"errors": [{"code": type(e).__name__, "message": str(e)}]}))
        print(f"tpviz {args.command}: {message}", file=sys.stderr)
        return code


def _is_invalid_input(e: Exception) -> bool:
    from .launcher import LoadError, MemoryForecastError

    if isinstance(e, MemoryForecastError):
        return True
    if isinstance(e, LoadError):
        return False
    return isinstance(e, (ValueError, FileNotFoundError, FileExistsError, InvalidInput))


def _emit(args: argparse.Namespace, data: dict[str, Any], text: str) -> None:
    print(json.dumps(data, indent=2) if args.json else text)


# --- commands ---------------------------------------------------------------------------------


def cmd_make_checkpoint(args: argparse.Namespace) -> int:
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
        f"wrote {out} ({size / 1e6:.1f} MB): {', '.join(files)}",
    )
    return 0


def _resolve(args: argparse.Namespace):
    from .plan import resolve_plan

    return resolve_plan(args.source, args.world_size, args.plan, dtype=args.dtype, model=args.model)


def cmd_plan(args: argparse.Namespace) -> int:
    from .report import plan_table

    plan = _resolve(args)
    _emit(args, plan.to_dict(), plan_table(plan, full=args.full))
    return INVALID_INPUT if plan.errors else 0


def _launch_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        device=args.device,
        init=args.init,
        seed=args.seed,
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
    from .report import load_table

    plan = _resolve(args)
    plan.raise_for_errors()
    with launch(
        args.source, args.world_size, plan, strategy=args.strategy, **_launch_kwargs(args)
    ) as job:
        result = _follow(job, show=not args.json)
    if args.report:
        _write_report(args.report, plan, [result], [job.events])
    _emit(args, result, load_table(result))
    return 0 if _succeeded(result) else FAILURE


def _succeeded(result: dict[str, Any]) -> bool:
    verify_ok = (result.get("verify") or {}).get("ok") is not False
    init_ok = (result.get("init_check") or {}).get("ok", True)
    return result["plan_matches_shards"] and verify_ok and init_ok


def cmd_compare(args: argparse.Namespace) -> int:
    from .launcher import compare
    from .report import compare_table, load_table

    plan = _resolve(args)
    plan.raise_for_errors()
    events: list = []

    def follow(job) -> dict[str, Any]:
        result = _follow(job, show=not args.json)
        events.append(job.events)
        return result

    results = compare(args.source, args.world_size, plan, follow=follow, **_launch_kwargs(args))
    if args.report:
        _write_report(args.report, plan, results, events)
    text = "\n\n".join([*(load_table(r) for r in results), compare_table(results)])
    _emit(args, {"strategies": results}, text)
    return 0 if all(_succeeded(r) for r in results) else FAILURE


def cmd_demo(args: argparse.Namespace) -> int:
    from .launcher import launch
    from .models.demo import cache_dir, demo_checkpoint
    from .plan import resolve_plan
    from .report import load_table, plan_table

    if not (cache_dir() / f"demo-{args.preset}" / "config.json").exists():
        print(f"making the {args.preset} demo checkpoint in {cache_dir()} ...", file=sys.stderr)
    source = demo_checkpoint(args.preset)
    plan = resolve_plan(source, args.world_size)
    plan.raise_for_errors()
    if not args.json:
        print(f"plan for {source}:\n{plan_table(plan)}\n")
    with launch(source, args.world_size, plan, verify=True) as job:
        result = _follow(job, show=not args.json)
    _emit(args, result, load_table(result))
    return 0 if _succeeded(result) else FAILURE


COMMANDS = {
    "make-checkpoint": cmd_make_checkpoint,
    "plan": cmd_plan,
    "load": cmd_load,
    "compare": cmd_compare,
    "demo": cmd_demo,
}


# --- progress ---------------------------------------------------------------------------------


def _follow(job, show: bool) -> dict[str, Any]:
    """Wait for the job, drawing one progress bar per rank on a terminal (plain lines at
    phase changes elsewhere)."""
    if not show:
        return job.wait()
    if not sys.stderr.isatty():
        return _follow_plain(job)
    from tqdm import tqdm

    from .report import human_bytes

    bars = [
        tqdm(
            total=1,
            position=r,
            desc=f"rank {r}",
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            leave=True,
            file=sys.stderr,
            dynamic_ncols=True,
        )
        for r in job.progress
    ]
    try:
        while True:
            try:
                return job.wait(timeout=0.1)
            except TimeoutError:
                pass
            finally:
                for rank, bar in enumerate(bars):
                    p = job.progress[rank]
                    bar.total = max(p.bytes_total, 1)
                    bar.n = p.bytes_done
                    where = p.module or p.phase
                    bar.set_postfix_str(
                        f"{p.units_done}/{p.units_total or '?'} modules "
                        f"{human_bytes(p.bytes_done)} {where}",
                        refresh=False,
                    )
                    bar.refresh()
    finally:
        for bar in bars:
            bar.close()


def _follow_plain(job) -> dict[str, Any]:
    seen: dict[int, str] = {}
    while True:
        try:
            return job.wait(timeout=0.25)
        except TimeoutError:
            pass
        finally:
            for rank, p in job.progress.items():
                if seen.get(rank) != p.phase:
                    seen[rank] = p.phase
                    print(
                        f"rank {rank}: {p.phase} ({p.units_done}/{p.units_total or '?'} "
                        f"modules) at {time.strftime('%H:%M:%S')}",
                        file=sys.stderr,
                    )


def _write_report(path: str, plan, results: list[dict[str, Any]], events: list) -> None:
    from .report import write_html_report

    write_html_report(path, plan, results, events)
    print(f"report written to {path}", file=sys.stderr)
