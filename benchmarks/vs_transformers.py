"""tpviz's sliced load against transformers' `from_pretrained(tp_plan="auto")`.

Both run under torchrun on CPU with gloo, on the same checkpoint and world size, alternating
runs (this machine is shared and noisy), and are measured the same way inside each rank
(benchmarks/peer_rank.py): load seconds from the start of loading (after imports and process
group setup) to a barrier when all ranks are done, having read every byte of every local
tensor, and peak RSS growth above the resident set at that start (the kernel's high-water
mark, reset there). tpviz's `load_sharded` call is split into imports, plan, skeleton,
allocation (fresh memory for the shards, faulted in), reads, wrapping (DTensor parameters)
and checks (shards against the plan) by timers around the functions doing each. A third run
in each round, `floor`, only takes fresh memory for the bytes tpviz's plan gives each rank and
copies them in from the checkpoint: the least any loader that owns its shards' memory must do
on this machine (its memory made as tpviz makes a shard's: torch's allocator, pages populated);
a fourth, `floor-huge`, does the same in a mapping of its own marked for transparent huge
pages. Every run has THP_MEM_ALLOC_ENABLE=1 (torch's allocator marks its large allocations for
huge pages, as in tpviz's spawned ranks); run with THP_MEM_ALLOC_ENABLE=0 for 4 KiB pages.
Needs `pip install -e '.[bench]'`.

    python benchmarks/vs_transformers.py [SOURCE] [--world-size 2] [--rounds 3]

Without SOURCE it uses the `medium` demo checkpoint (made once in the cache dir).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from common import fresh_memory_note, gib, median, parse_args

HERE = Path(__file__).resolve().parent
LOADERS = ("transformers", "tpviz", "floor", "floor-huge")
PARTS = ("imports", "plan", "skeleton", "allocation", "reads", "wrapping", "checks")
THP = os.environ.get("THP_MEM_ALLOC_ENABLE", "1")


def run(which: str, source: Path, world_size: int, out: Path) -> list[dict]:
    # torchrun keeps its logs under TMPDIR and never removes them: give it the run's temp dir
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONWARNINGS": "ignore",
        "TMPDIR": str(out.parent),
        # torch's huge-page switch, as the README asks torchrun users to set it (it is read as
        # torch loads, so only the launch can set it); the same for every loader
        "THP_MEM_ALLOC_ENABLE": THP,
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world_size),
        str(HERE / "peer_rank.py"),
        which,
        str(source),
        str(out),
    ]
    for _attempt in (1, 2):
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode == 0:
            return json.loads(out.read_text())
        # about one run in a hundred here ends with a rank aborted by the C++ runtime as it
        # exits ("terminate called without an active exception"): say so, and run it again
        lines = [line for line in done.stderr.splitlines() if not line.startswith("W")]
        print(f"  {which} run failed (exit {done.returncode}): " + " | ".join(lines[-3:]))
    raise SystemExit(f"{which} failed twice")


def ratio(a: list[float], b: list[float]) -> str:
    """Round-by-round ratios (runs of one round are seconds apart, so they share the
    machine's state): their median and range."""
    each = [x / y for x, y in zip(a, b)]
    return f"{median(each):.2f}x ({min(each):.2f}-{max(each):.2f})"


def main() -> None:
    args, source = parse_args(__doc__.splitlines()[0])
    if importlib.util.find_spec("accelerate") is None:  # transformers' TP loading needs it
        sys.exit("vs_transformers.py needs the bench extra: pip install -e '.[bench]'")
    size = sum(f.stat().st_size for f in source.glob("*.safetensors"))
    print(
        f"{source} ({size / 1e6:.0f} MB), world size {args.world_size}, {os.cpu_count()} "
        f"CPU cores, {args.rounds} alternating rounds, THP_MEM_ALLOC_ENABLE={THP} in every run; "
        + fresh_memory_note()
    )
    runs: dict[str, list[list[dict]]] = {w: [] for w in LOADERS}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            order = LOADERS if i % 2 == 0 else LOADERS[::-1]
            for which in order:
                out = Path(tmp) / f"{which}-{i}.json"
                runs[which].append(run(which, source, args.world_size, out))
                print(
                    f"  round {i + 1} {which:12s} "
                    + "  ".join(
                        f"rank {r['rank']}: {r['seconds']:.3f} s, +{gib(r['peak_rss_growth'])} "
                        f"(owned {gib(r['owned_growth'])}, mapped {gib(r['mapped_growth'])})"
                        for r in runs[which][-1]
                    ),
                    flush=True,
                )
        logits = {
            w: torch.load(Path(tmp) / f"{w}-0.json.logits.pt") for w in ("transformers", "tpviz")
        }
    diff = (logits["tpviz"] - logits["transformers"]).abs().max().item()
    print("\nmedians per rank (ratios: median of the rounds' own ratios, and their range):")
    for rank in range(args.world_size):
        t = {w: [r[rank]["seconds"] for r in runs[w]] for w in runs}
        m = {w: median(r[rank]["peak_rss_growth"] for r in runs[w]) for w in runs}
        print(
            f"  rank {rank}: load tpviz {median(t['tpviz']):.3f} s, transformers "
            f"{median(t['transformers']):.3f} s, floor {median(t['floor']):.3f} s, huge-page floor "
            f"{median(t['floor-huge']):.3f} s;  "
            f"tpviz / transformers {ratio(t['tpviz'], t['transformers'])} (target <= 0.6x), "
            f"floor / transformers {ratio(t['floor'], t['transformers'])}, "
            f"tpviz / floor {ratio(t['tpviz'], t['floor'])}, "
            f"tpviz / huge-page floor {ratio(t['tpviz'], t['floor-huge'])}"
        )
        print(
            f"          peak RSS growth tpviz {gib(m['tpviz'])}, transformers "
            f"{gib(m['transformers'])}, floor {gib(m['floor'])};  tpviz / transformers "
            f"{m['tpviz'] / m['transformers']:.2f}x (target <= 1.0x)"
        )
        parts = {p: median(r[rank]["split"][p] for r in runs["tpviz"]) for p in ("call", *PARTS)}
        rest = median(
            r[rank]["split"]["call"] - sum(r[rank]["split"][p] for p in PARTS)
            for r in runs["tpviz"]
        )
        print(
            f"          tpviz's load_sharded call {parts['call']:.3f} s: "
            + ", ".join(f"{p} {parts[p]:.3f}" for p in PARTS)
            + f", the rest (events, memory samples, barriers) {rest:.3f}"
        )
    print(
        f"same logits on the fixed prompt: max |tpviz - transformers| = {diff:.2e} "
        f"({'yes' if diff <= 1e-4 else 'NO'})"
    )


if __name__ == "__main__":
    main()
