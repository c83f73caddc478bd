"""How plan resolution scales with model depth, and what `tpviz plan` costs as a process.

Resolves a Llama-70B-shaped config (hidden 8192, 64 heads, 8 KV heads, vocab 128256) at
world size 8 with 8, 80 and 800 layers, in-process, best of several runs each, and prints
the ratios to the 8-layer time: linear cost means about 10x and 100x. Then times the whole
CLI process (`python -m tpviz plan ... --world-size 8`) on the 80-layer config.

Then the two mixture-of-experts configs of tests/moe_configs.py (Mixtral-8x7B, DeepSeek-V3
671B) at world size 8 under `--experts tp` and `ep`: in-process resolution (best of runs), the
part of it spent building transformers' meta skeleton, and the whole `tpviz plan` process.

    python benchmarks/plan_bench.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tpviz.models import build_skeleton, get_adapter, read_config
from tpviz.plan import resolve_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' real MoE configs
from tests.moe_configs import DEEPSEEK_V3, MIXTRAL_8X7B, config_dir  # noqa: E402

BASE = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=8192,
    intermediate_size=28672,
    num_attention_heads=64,
    num_key_value_heads=8,
    vocab_size=128256,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    torch_dtype="bfloat16",
)


def best_of(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        sources = {}
        for layers in (8, 80, 800):
            d = Path(tmp) / f"l{layers}"
            d.mkdir()
            (d / "config.json").write_text(json.dumps({**BASE, "num_hidden_layers": layers}))
            sources[layers] = d
        resolve_plan(sources[8], 8)  # warm imports
        times = {
            n: best_of(lambda s=s: resolve_plan(s, 8), 9 if n < 800 else 5)
            for n, s in sources.items()
        }
        print("resolve_plan, world size 8, best of runs:")
        for n, t in times.items():
            print(f"  {n:4d} layers: {t * 1000:8.1f} ms   ratio to 8 layers: {t / times[8]:6.1f}x")
        cli = []
        for _ in range(3):
            start = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "tpviz", "plan", str(sources[80]), "--world-size", "8"],
                check=True,
                capture_output=True,
            )
            cli.append(time.perf_counter() - start)
        print(
            f"tpviz plan (80 layers, 70B) whole process: best {min(cli):.2f} s, "
            f"worst {max(cli):.2f} s (target < 3 s); in-process resolve "
            f"{times[80] * 1000:.0f} ms (target < 300 ms)"
        )


def whole_process(args: list[str], runs: int = 3) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "tpviz", *args], check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return times


def moe() -> None:
    print("mixture of experts from config.json alone, world size 8:")
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in (("Mixtral-8x7B", MIXTRAL_8X7B), ("DeepSeek-V3", DEEPSEEK_V3)):
            source = config_dir(Path(tmp) / name, config)
            resolve_plan(source, 8)  # warm imports
            raw = read_config(source)
            adapter = get_adapter(raw, None, source)
            skeleton = best_of(lambda a=adapter, c=raw: build_skeleton(a, c, torch.bfloat16), 3)
            for experts in ("tp", "ep"):
                plan = resolve_plan(source, 8, experts=experts)
                t = best_of(lambda s=source, e=experts: resolve_plan(s, 8, experts=e), 3)
                cli = whole_process(
                    ["plan", str(source), "--world-size", "8", "--experts", experts]
                )
                print(
                    f"  {name:12s} {experts}: {len(plan.params)} tensors, "
                    f"{plan.per_rank_bytes[0] / 2**30:7.1f} GiB per rank of "
                    f"{plan.total_bytes / 2**30:7.1f} GiB; resolve {t * 1000:6.0f} ms in-process "
                    f"(of which {skeleton * 1000:.0f} ms building transformers' meta skeleton), "
                    f"whole process best {min(cli):.2f} s"
                )


if __name__ == "__main__":
    main()
    moe()
