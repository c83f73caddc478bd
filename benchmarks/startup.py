"""Startup: what a person waits for before loading begins, measured in one run.

Per round (alternating, because this machine is shared and noisy), each in a fresh process:

- `bare`: `python -c "import torch, torch.distributed, torch.distributed.tensor"`, start to
  exit: the least any TP program pays before it does anything;
- `cli`: the whole `python -m tpviz load SOURCE --world-size 2 --json`, start to exit (its
  forkserver, plan, ranks, load, shutdown: everything);
- `launch 2`, `launch 4`: in a fresh interpreter that has imported tpviz (not torch), from the
  `tpviz.launch(...)` call to all ranks ready (the forkserver's start counts), at world size 2
  and 4;
- `reload`: on those ranks (world size 2), a reload's `startup_seconds` (the reload request to
  all ranks ready).

It prints the medians and the ratios `cli / bare` (target <= 1.6) and the reload's seconds
(target < 0.1 s).

    python benchmarks/startup.py [SOURCE] [--rounds 3]

Without SOURCE it uses the `tiny` demo checkpoint (made once in the cache dir).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from common import compile_tpviz, median

from tpviz.models.demo import demo_checkpoint

BARE = "import torch, torch.distributed, torch.distributed.tensor"

LAUNCH = """
import json, sys, time
import tpviz
if __name__ == "__main__":
    out = {}
    for world in (2, 4):
        start = time.time()
        job = tpviz.launch(sys.argv[1], world)
        result = job.wait(300)
        out[f"launch {world}"] = job.started + result["startup_seconds"] - start
        if world == 4:
            job.shutdown()
            break
        reloads = []
        for strategy in ("sliced", "rank0_broadcast", "sliced"):
            job = job.reload(strategy=strategy)
            reloads.append(job.wait(300)["startup_seconds"])
        out["reload"] = min(reloads)
        job.shutdown()
    print(json.dumps(out))
"""


def wall(argv: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr}")
    return seconds, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", nargs="?", help="checkpoint dir (default: the tiny demo)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    compile_tpviz()  # before anything is measured
    source = args.source or str(demo_checkpoint("tiny"))
    python = sys.executable
    figures: dict[str, list[float]] = {}
    for r in range(args.rounds):
        row = {"bare": wall([python, "-c", BARE])[0]}
        cli, out = wall([python, "-m", "tpviz", "load", source, "--world-size", "2", "--json"])
        row["cli"] = cli
        row["cli: its startup_seconds"] = json.loads(out)["startup_seconds"]
        row.update(json.loads(wall([python, "-c", LAUNCH, source])[1]))
        for key, value in row.items():
            figures.setdefault(key, []).append(value)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:.3f} s" for k, v in row.items()))
    m = {key: median(values) for key, values in figures.items()}
    print(f"\nmedians over {args.rounds} rounds ({source}):")
    for key, value in m.items():
        print(f"  {key:26s} {value:7.3f} s")
    ratios = [c / b for c, b in zip(figures["cli"], figures["bare"])]
    print(
        f"  cli / bare: {median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f}; "
        "target <= 1.6x)"
    )
    print(f"  reload to ready: {m['reload']:.3f} s (target < 0.1 s)")


if __name__ == "__main__":
    main()
