"""CUDA check and throughput, for a machine with GPUs; self-contained, about 1.5 minutes.

Checks (a PASS or FAIL line each), at world size 1 on cuda, and 2 with nccl where there are
two GPUs:
- every strategy loads the tiny demo (float32) and the small one cast to bfloat16 (the cast
  goes through the pinned staging buffers too), verifies logits against the single-process
  reference, its shards match the plan, the loader's peak tensor bytes equal the
  forecast to the byte (which counts the two staged chunks in flight), and each rank's last
  memory sample has at least its shards' bytes allocated on the GPU;
Throughput, sliced at world size 1, page cache warm, on the medium demo (640 MB float32 in 75
tensors) and on a wide one (3.9 GB in 40 tensors):
- the load's GB/s (shard bytes / the rank's `seconds`, best of 3 on fresh ranks and of 3
  reloads on warm ones) beside, measured in the same run (best of 3) on
  the same number of bytes: a plain pinned host-to-device copy (`copy_(non_blocking)` from
  memory already pinned and touched) and a page-cache read into that pinned memory. Double
  buffering overlaps the two, so the load should approach the slower of them (PASS within
  1.5x of its time).

    python benchmarks/gpu_smoke.py

Exit status 0 when every line is PASS, 1 otherwise, 2 without a CUDA device.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

import tpviz
from tpviz.checkpoint import Checkpoint
from tpviz.events import Memory

failures = 0
# the medium preset with 7B-like widths and 4 layers: 3.9 GB float32 in 40 tensors of up to
# 180 MB, where the per-tensor work around the reads weighs little
WIDE = dict(hidden=4096, intermediate=11008, layers=4, heads=32, kv_heads=8)


def check(ok: bool, what: str) -> None:
    global failures
    failures += not ok
    print(f"{'PASS' if ok else 'FAIL'} {what}", flush=True)


def loads(sources: dict[str, Path], world: int) -> None:
    for preset, dtype in (("tiny", None), ("small", "bfloat16")):
        source = sources[preset]
        for strategy in ("sliced", "rank0_broadcast", "replicated"):
            with tpviz.launch(
                source, world, strategy=strategy, device="cuda", dtype=dtype, verify=True
            ) as job:
                result = job.wait(300)
                devices = {row["device"] for rows in job.shard_report() for row in rows}
                last = {e.rank: e for e in job.events if isinstance(e, Memory)}
            exact = all(r["peak_tensor_bytes"] == r["forecast_peak_bytes"] for r in result["ranks"])
            sampled = all(
                last[r["rank"]].cuda_reserved >= last[r["rank"]].cuda_allocated >= r["param_bytes"]
                for r in result["ranks"]
            )
            check(
                result["verify"]["ok"]
                and result["plan_matches_shards"]
                and exact
                and sampled
                and all(d.startswith("cuda") for d in devices),
                f"world {world} {preset} {result['dtype']} {strategy}: verify max diff "
                f"{result['verify']['max_abs_diff']:.2e}, plan matches shards "
                f"{result['plan_matches_shards']}, peak tensor bytes = forecast {exact}, memory "
                f"samples hold the shards {sampled}, devices "
                f"{sorted(devices)}, load {result['load_seconds']:.2f} s",
            )


def best_of(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def read_files(source: Path, view: memoryview) -> None:
    """Fill `view` with the checkpoint files' bytes, in large reads from the page cache."""
    filled = 0
    for file in Checkpoint.open(source).files:
        with open(file, "rb", buffering=0) as f:
            while filled < len(view):
                n = f.readinto(view[filled : filled + (64 << 20)])
                if not n:
                    break
                filled += n


def load_seconds(source: Path, plan, repeat: int = 3) -> tuple[float, float]:
    """The rank's `seconds`, best of `repeat` loads on fresh ranks and of `repeat` reloads on
    warm ones (whose pinned staging buffers come from torch's host cache), page cache warm."""
    fresh = []
    for _ in range(repeat + 1):  # the first warms the page cache
        with tpviz.launch(source, 1, plan, device="cuda") as job:
            fresh.append(job.wait(300)["ranks"][0]["seconds"])
    warm = []
    job = tpviz.launch(source, 1, plan, device="cuda")
    try:
        job.wait(300)
        for _ in range(repeat):
            job = job.reload()
            warm.append(job.wait(300)["ranks"][0]["seconds"])
    finally:
        job.shutdown()
    return min(fresh[1:]), min(warm)


def throughput(source: Path) -> None:
    plan = tpviz.resolve_plan(source, 1)
    nbytes = plan.per_rank_bytes[0]
    tensors = len(plan.params)
    fresh, warm = load_seconds(source, plan)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pinned.fill_(1)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = best_of(lambda: device.copy_(pinned, non_blocking=True))
    read = best_of(lambda: read_files(source, memoryview(pinned.numpy())))
    slower = max(h2d, read)
    print(
        f"{source.name} sliced on cuda, {nbytes / 1e9:.2f} GB in {tensors} tensors, best of 3: "
        f"load on fresh ranks "
        f"{nbytes / fresh / 1e9:.2f} GB/s ({fresh:.3f} s), on warm ranks "
        f"{nbytes / warm / 1e9:.2f} GB/s ({warm:.3f} s); plain pinned H2D copy "
        f"{nbytes / h2d / 1e9:.2f} GB/s; page-cache read into pinned memory "
        f"{nbytes / read / 1e9:.2f} GB/s"
    )
    check(
        fresh <= 1.5 * slower,
        f"load time on fresh ranks {fresh:.3f} s is {fresh / slower:.2f}x the slower of read "
        f"and H2D ({slower:.3f} s) (target <= 1.5x)",
    )


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device visible: nothing to check", file=sys.stderr)
        return 2
    print(f"{torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}")
    with tempfile.TemporaryDirectory() as tmp:
        presets = ("tiny", "small", "medium")
        sources = {p: tpviz.make_checkpoint(Path(tmp) / p, p) for p in presets}
        for world in sorted({1, min(2, torch.cuda.device_count())}):
            loads(sources, world)
        throughput(sources["medium"])
        throughput(tpviz.make_checkpoint(Path(tmp) / "wide", "medium", **WIDE))
    print(f"{'all PASS' if not failures else f'{failures} FAIL'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
