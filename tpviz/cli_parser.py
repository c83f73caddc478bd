"""The `tpviz` command line: subcommands, their arguments and help."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import NoReturn

from .choices import MAX_SECONDS, PRESETS, STRATEGIES, TARGET_DTYPES

DESCRIPTION = "`tpviz ...`: make checkpoints, show plans, load, compare strategies, and the demo."
SOURCE_HELP = "checkpoint dir (Hugging Face layout), or a dir holding only config.json"
JSON_HELP = "print the result as JSON on stdout (also on failure, then with errors)"


def _world_size(text: str) -> int:
    """--world-size: checked as it is parsed, before demo makes a checkpoint or ranks start."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}")
    return int(text)


def _seconds(text: str) -> float:
    """--timeout, --heartbeat-timeout: said with the flag's name, not the Python argument's."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(
            f"must be a positive, finite number of seconds, at most {MAX_SECONDS} (30 days), "
            f"not {text!r}"
        )
    return value


def _given(text: str) -> str:
    """A path or name flag: an empty one would be taken for "not given" (no events written)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _shared(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=_world_size, default=2, help="number of ranks (default 2)")
    p.add_argument(
        "--plan", type=_given, help="plan file: {pattern: style} or transformers' tp_plan form"
    )
    p.add_argument(
        "--dtype",
        choices=TARGET_DTYPES,
        help="target dtype (default: the checkpoint's)",
    )
    p.add_argument(
        "--model",
        type=_given,
        default="auto",
        help="auto, builtin, hf, hf-remote-code or PKG.MOD:FN (default auto)",
    )
    p.add_argument(
        "--no-kv-replication",
        action="store_true",
        help="refuse world sizes past the key-value heads instead of replicating each "
        "key-value head over the ranks that use it",
    )
    p.add_argument(
        "--experts",
        choices=["tp", "ep"],
        default="tp",
        help="mixture-of-experts layout: tp cuts every expert as the plan says, ep gives each "
        "rank whole experts (default tp)",
    )
    p.add_argument("--json", action="store_true", help=JSON_HELP)


def _load_flags(p: argparse.ArgumentParser, each: str = "") -> None:
    """The flags of a load; `each` is where a comparison writes each strategy's outputs."""
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu: gloo ranks; cuda: one GPU per rank, nccl (default cpu)",
    )
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
    p.add_argument("--seed", type=int, help="seed of --init random (default 0)")
    p.add_argument(
        "--profile",
        type=_given,
        metavar="DIR",
        help=f"write torch.profiler traces for TensorBoard{each}",
    )
    p.add_argument(
        "--profile-forward",
        action="store_true",
        help="with --profile, also profile one forward of the fixed prompt",
    )
    p.add_argument(
        "--events",
        type=_given,
        metavar="DIR",
        help=f"write each rank's events as rank{{r}}.jsonl{each}",
    )
    p.add_argument(
        "--report", type=_given, metavar="FILE.html", help="write a self-contained HTML report"
    )
    p.add_argument("--timeout", type=_seconds, help="fail if loading takes longer (seconds)")
    p.add_argument(
        "--heartbeat-timeout",
        type=_seconds,
        default=30.0,
        metavar="SECONDS",
        help="fail if a rank stays silent (frozen) this long (default 30)",
    )
    p.add_argument(
        "--force", action="store_true", help="load even if the memory forecast says it will not fit"
    )


class _Parser(argparse.ArgumentParser):
    """argparse with the one-line errors of every other refusal: the reason and where the
    usage is, not the usage itself first (ten lines before the line that matters)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)", self.prog)

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        """A flag the subcommand does not have points at that subcommand's help (argparse
        hands such flags up to the top-level parser, whose help lists no flags)."""
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            command = getattr(parsed, "command", None)
            prog = f"{self.prog} {command}" if command else self.prog
            raise UsageError(f"unrecognized arguments: {' '.join(extra)} (see {prog} --help)", prog)
        return parsed


class UsageError(ValueError):
    """Arguments the parser refuses; `prog` is the (sub)command whose usage they break."""

    def __init__(self, message: str, prog: str):
        super().__init__(message)
        self.prog = prog


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(prog="tpviz", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"tpviz {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _make_checkpoint_parser(sub)
    p = sub.add_parser("plan", help="resolve a TP plan and show what every rank holds")
    p.add_argument("source", help=SOURCE_HELP)
    _shared(p)
    p.add_argument("--full", action="store_true", help="one row per tensor (no folding)")
    p.add_argument(
        "--suggest",
        action="store_true",
        help="propose a plan from the model's structure, each part proven on simulated ranks; "
        "prints it as a plan file",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="with --suggest: load it on --world-size real ranks and compare logits with a "
        "single-process model (exit 0 only if they match)",
    )
    p.add_argument(
        "--simulate",
        action="store_true",
        help="run the plan on simulated ranks (a 2-layer float32 instance, in this process) and "
        "compare logits with the whole model, before any rank starts (exit 0 only if they match)",
    )

    p = sub.add_parser("load", help="load a checkpoint on local ranks")
    p.add_argument("source", help=SOURCE_HELP)
    _shared(p)
    p.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="sliced",
        help="sliced: each rank reads its own slices; rank0_broadcast: rank 0 reads and sends; "
        "replicated: every rank loads the whole model, keeps its shards (default sliced)",
    )
    _load_flags(p)

    p = sub.add_parser("compare", help="load with every strategy in turn and compare")
    p.add_argument("source", help=SOURCE_HELP)
    _shared(p)
    _load_flags(p, each=", in DIR/<strategy>/ for each strategy")

    p = sub.add_parser("demo", help="make the demo checkpoint, show its plan, load it")
    p.add_argument(
        "--preset",
        choices=PRESETS,
        default="small",
        help="demo checkpoint size, made once in a cache dir (default small)",
    )
    p.add_argument("--world-size", type=_world_size, default=2, help="number of ranks (default 2)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    return parser


def _make_checkpoint_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-checkpoint", help="write a deterministic Llama-family checkpoint")
    p.add_argument("directory", help="where to write it (a new or empty directory)")
    p.add_argument(
        "--preset",
        choices=PRESETS,
        default="tiny",
        help="model size in float32: tiny (2.4 MiB), small (143 MiB), medium (610 MiB) "
        "(default tiny)",
    )
    p.add_argument(
        "--dtype",
        choices=TARGET_DTYPES,
        default="float32",
        help="dtype of the stored tensors (default float32)",
    )
    p.add_argument(
        "--tie-embeddings",
        action="store_true",
        help="share one tensor between the embedding and lm_head (no lm_head.weight stored)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument("--max-shard-size", type=int, help="bytes per .safetensors file")
    for dim in ("layers", "hidden", "intermediate", "heads", "kv-heads", "vocab"):
        p.add_argument(f"--{dim}", type=int, help=f"override the preset's {dim}")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
