"""Mixture-of-experts: experts cut by TP (every rank a slice of every expert) against whole
experts per rank (EP), loading the same checkpoint on the same ranks.

Builds a Mixtral-class checkpoint of a few hundred MB with transformers' own class and
`save_pretrained` (per-expert tensors, several files) in a temporary directory, then for each
round loads it with `experts="tp"` and `experts="ep"` in turn (alternating: this machine is
shared and noisy) and prints per layout and rank the medians of: bytes held, peak tensor bytes
(the loader's own accounting; equal to the forecast), peak RSS growth and load seconds, and the
seconds of a forward on 256 tokens; with ratios of ep to tp. Both layouts send one all-reduce of
tokens x hidden per MoE layer in the forward.

    python benchmarks/moe.py [--world-size 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import transformers
from common import compile_tpviz, gib, median

import tpviz

CONFIG = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_local_experts=8,
    num_experts_per_tok=2,
)


def make_checkpoint(directory: str) -> None:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("mixtral", **CONFIG)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory, max_shard_size="100MB")


def run(source: str, plan: tpviz.ResolvedPlan, tokens: torch.Tensor) -> dict:
    with tpviz.launch(source, plan.world_size, plan) as job:
        result = job.wait(600)
        job.forward(tokens)  # warm
        start = time.perf_counter()
        job.forward(tokens)
        forward = time.perf_counter() - start
    assert result["plan_matches_shards"]
    ranks = result["ranks"]
    return {
        "load_seconds": result["load_seconds"],
        "forward_seconds": forward,
        "param_bytes": [r["param_bytes"] for r in ranks],
        "peak_tensor_bytes": [r["peak_tensor_bytes"] for r in ranks],
        "forecast_peak_bytes": [r["forecast_peak_bytes"] for r in ranks],
        "peak_rss_bytes": [r["peak_rss_bytes"] for r in ranks],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    compile_tpviz()  # before anything is measured
    with tempfile.TemporaryDirectory() as source:
        make_checkpoint(source)
        # the model's own plan; under tp tpviz derives the experts' keys from structure
        plans = {
            layout: tpviz.resolve_plan(source, args.world_size, experts=layout)
            for layout in ("tp", "ep")
        }
        total = plans["tp"].total_bytes
        print(f"Mixtral-class checkpoint, {gib(total)} float32, world size {args.world_size}")
        tokens = torch.randint(0, CONFIG["vocab_size"], (1, 256))
        runs: dict[str, list[dict]] = {layout: [] for layout in plans}
        for _ in range(args.rounds):
            for layout, plan in plans.items():
                runs[layout].append(run(source, plan, tokens))
    report(runs, args.world_size)


def report(runs: dict[str, list[dict]], world_size: int) -> None:
    med = {
        layout: {
            key: (
                median(r[key] for r in rs)
                if key.endswith("seconds")
                else [median(r[key][rank] for r in rs) for rank in range(world_size)]
            )
            for key in rs[0]
        }
        for layout, rs in runs.items()
    }
    for layout, m in med.items():
        print(
            f"{layout}: load {m['load_seconds']:.3f} s, forward (256 tokens) "
            f"{m['forward_seconds']:.3f} s"
        )
        for rank in range(world_size):
            print(
                f"  rank {rank}: holds {gib(m['param_bytes'][rank])}, peak tensor "
                f"{gib(m['peak_tensor_bytes'][rank])} (forecast "
                f"{gib(m['forecast_peak_bytes'][rank])}), peak RSS growth "
                f"{gib(m['peak_rss_bytes'][rank])}"
            )
    tp, ep = med["tp"], med["ep"]
    print(
        f"ep / tp: load {ep['load_seconds'] / tp['load_seconds']:.2f}x, forward "
        f"{ep['forward_seconds'] / tp['forward_seconds']:.2f}x, peak RSS (rank 0) "
        f"{ep['peak_rss_bytes'][0] / tp['peak_rss_bytes'][0]:.2f}x"
    )


if __name__ == "__main__":
    main()
