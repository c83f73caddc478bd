"""CUDA/nccl smoke check, for a machine with GPUs: every strategy loads the tiny and small
demo checkpoints on one GPU per rank, verifies logits against the single-process reference,
and reports peak CUDA memory beside the forecast.

    python benchmarks/gpu_smoke.py [--world-size N]   (default: min(2, GPUs))

Exits non-zero on the first failure. Takes about a minute.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

import tpviz


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device visible: nothing to check", file=sys.stderr)
        return 2
    world = args.world_size or min(2, torch.cuda.device_count())
    print(
        f"{torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}; world size {world}"
    )
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for preset, dtype in (("tiny", "float32"), ("small", "bfloat16")):
            source = tpviz.make_checkpoint(Path(tmp) / preset, preset, dtype=dtype)
            for strategy in ("sliced", "rank0_broadcast", "replicated"):
                with tpviz.launch(
                    source, world, strategy=strategy, device="cuda", verify=True
                ) as job:
                    result = job.wait(600)
                    devices = {row["device"] for rows in job.shard_report() for row in rows}
                ok = result["verify"]["ok"] and result["plan_matches_shards"]
                failures += not ok
                peaks = ", ".join(
                    f"rank {r['rank']}: cuda peak {r['peak_cuda_allocated_bytes'] / 2**20:.0f} "
                    f"MiB, tensors {r['peak_tensor_bytes'] / 2**20:.0f} MiB (forecast "
                    f"{r['forecast_peak_bytes'] / 2**20:.0f})"
                    for r in result["ranks"]
                )
                print(
                    f"{preset} {dtype} {strategy}: verify {result['verify']['max_abs_diff']:.2e} "
                    f"{'ok' if ok else 'FAILED'}, devices {sorted(devices)}, load "
                    f"{result['load_seconds']:.2f} s; {peaks}",
                    flush=True,
                )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
