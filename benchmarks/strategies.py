"""The three loading strategies side by side, and the sliced read throughput against the
machine's own copy bandwidth, measured in the same run.

For each round it loads the checkpoint with sliced, rank0_broadcast and replicated in turn
(alternating, because this machine is shared and noisy) and prints per strategy and rank the
medians of: load seconds, peak RSS growth, peak tensor bytes (the loader's own accounting) and
bytes sent/received, with ratios to sliced. Then:

- sliced read throughput per rank (its shard bytes / its load seconds) as a fraction of the
  copy bandwidth of this machine: a single-threaded `copy_` of the same number of bytes
  between two tensors that own their memory, best of 5, as many processes at once as ranks;
  both into memory already touched and into fresh tensors (which any loader must fault in);
- each sliced rank's `seconds` against the floor of a loader that owns its memory (fresh
  memory for exactly the rank's bytes, filled from the page cache by large reads), measured
  in every round right after the sliced load, inside the same rank processes, all at once:
  its memory made as tpviz makes a shard's (torch's allocator, which in the ranks marks large
  allocations for huge pages unless THP_MEM_ALLOC_ENABLE=0; pages populated), and again in a
  mapping of its own marked for transparent huge pages;
- the same comparison on warm ranks: one job reloads the sliced load `--rounds` x 3 times, each
  load followed by the floor in the same processes (both then reuse memory the ranks freed a
  moment before, so the host's cost of fresh memory, which swings by 10x on a virtual machine,
  weighs less on the ratio), and by the plan's own reads alone (the same block reads into the
  same kind of memory, nothing else): what the plan's read pattern costs over the floor
  (column blocks read each row's part on its own), apart from what tpviz adds around reads;
- the check that each sliced rank's peak tensor bytes stay within its final shard plus the
  largest single slice it reads;
- what profiling off costs: the no-op span calls of one load, timed.

    python benchmarks/strategies.py [SOURCE] [--world-size 2] [--rounds 3]

Without SOURCE it uses the `medium` demo checkpoint (made once in the cache dir).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import time
import timeit

import torch
from common import floor_in_rank, fresh_memory_note, gib, median, parse_args, plan_reads_in_rank

import tpviz
from tpviz.profiling import no_span
from tpviz.strategies import STRATEGIES


def copy_bandwidth(nbytes: int, queue) -> None:
    """Bytes/s of copying `nbytes` into memory already touched, and into fresh memory (which
    the kernel must fault in and zero first, as for any loader's new tensors)."""
    torch.set_num_threads(1)
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch both
    warm = min(timeit.repeat(lambda: dst.copy_(src), number=1, repeat=5))
    dst = None  # free it before the fresh copies
    fresh = min(timeit.repeat(lambda: torch.empty_like(src).copy_(src), number=1, repeat=5))
    queue.put((nbytes / warm, nbytes / fresh))


def machine_copy_bandwidth(nbytes: int, processes: int) -> tuple[float, float]:
    """(warm, fresh) bytes/s one process copies while `processes` copy at once (as the
    ranks read)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=copy_bandwidth, args=(nbytes, queue)) for _ in range(processes)]
    for p in procs:
        p.start()
    rates = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    return median(r[0] for r in rates), median(r[1] for r in rates)


def warm_ranks(source, plan, reloads: int) -> None:
    """Sliced `seconds` against the floor, alternating in the same warm rank processes."""
    seconds, floors, plan_reads = [], [], []
    with tpviz.launch(source, plan.world_size, plan) as job:
        job.wait()
        for i in range(reloads):
            job = job.reload()
            seconds.append([r["seconds"] for r in job.wait()["ranks"]])
            for measure in (0, 1) if i % 2 == 0 else (1, 0):
                if measure:
                    plan_reads.append(job.call(plan_reads_in_rank, plan))
                else:
                    floors.append(job.call(floor_in_rank, str(source), plan.per_rank_bytes))
        job.shutdown()
    print(
        f"\non warm ranks, {reloads} reloads each followed by the floor and by the plan's own "
        "reads alone (the floor for its read pattern) in the same processes:"
    )
    for rank in range(plan.world_size):
        mine, floor = [s[rank] for s in seconds], [f[rank] for f in floors]
        reads = [r[rank] for r in plan_reads]
        print(
            f"  rank {rank}: sliced {median(mine):.3f} s, floor {median(floor):.3f} s, the "
            f"plan's reads {median(reads):.3f} s; sliced / floor {ratios(mine, floor)} (target "
            f"<= 1.1x), the plan's reads / floor {ratios(reads, floor)}, sliced / the plan's "
            f"reads {ratios(mine, reads)}"
        )


def ratios(a: list[float], b: list[float]) -> str:
    """The median of the ratios of paired runs, with their range."""
    each = [x / y for x, y in zip(a, b)]
    return f"{median(each):.2f}x ({min(each):.2f}-{max(each):.2f})"


def main() -> None:
    args, source = parse_args(__doc__.splitlines()[0])
    w = args.world_size
    plan = tpviz.resolve_plan(source, w)
    plan.raise_for_errors()
    print(
        f"{source}: {gib(plan.total_bytes)} {plan.dtype}, world size {w}, "
        f"{os.cpu_count()} CPU cores, {args.rounds} rounds; {fresh_memory_note()}"
    )

    with tpviz.launch(source, w, plan) as job:  # warm the page cache: every run reads warm
        job.wait()
    results: dict[str, list[dict]] = {s: [] for s in STRATEGIES}
    floors: list[list[float]] = []  # per round, per rank: memory made as tpviz makes it
    floors_huge: list[list[float]] = []  # the same backed by transparent huge pages
    for i in range(args.rounds):
        for strategy in STRATEGIES:
            with tpviz.launch(source, w, plan, strategy=strategy) as job:
                results[strategy].append(job.wait())
                if strategy == "sliced":  # in the same rank processes, all at once
                    for huge in (True, False) if i % 2 == 0 else (False, True):
                        seconds = job.call(floor_in_rank, str(source), plan.per_rank_bytes, huge)
                        (floors_huge if huge else floors).append(seconds)
            r = results[strategy][-1]
            print(f"  round {i + 1} {strategy:16s} load {r['load_seconds']:.2f} s", flush=True)

    def med(strategy: str, rank: int, key: str) -> float:
        return median(r["ranks"][rank][key] for r in results[strategy])

    print("\nmedians per strategy and rank")
    print(
        f"{'strategy':16s} {'rank':>4s} {'load s':>7s} {'x sliced':>8s} {'peak RSS +':>11s} "
        f"{'x sliced':>8s} {'peak tensors':>12s} {'forecast':>10s} {'sent':>10s} "
        f"{'received':>10s}"
    )
    for strategy in STRATEGIES:
        for rank in range(w):
            s, rss = med(strategy, rank, "seconds"), med(strategy, rank, "peak_rss_bytes")
            print(
                f"{strategy:16s} {rank:4d} {s:7.2f} {s / med('sliced', rank, 'seconds'):7.2f}x "
                f"{gib(rss):>11s} {rss / med('sliced', rank, 'peak_rss_bytes'):7.2f}x "
                f"{gib(med(strategy, rank, 'peak_tensor_bytes')):>12s} "
                f"{gib(med(strategy, rank, 'forecast_peak_bytes')):>10s} "
                f"{gib(med(strategy, rank, 'bytes_sent')):>10s} "
                f"{gib(med(strategy, rank, 'bytes_received')):>10s}"
            )

    shard = max(plan.per_rank_bytes)
    warm, fresh = machine_copy_bandwidth(shard, w)
    print(
        f"\ncopy bandwidth of this machine, {w} processes copying {gib(shard)} each at once "
        f"(single-threaded): {warm / 1e9:.2f} GB/s per process between tensors already "
        f"touched, {fresh / 1e9:.2f} GB/s into freshly allocated tensors"
    )
    for rank in range(w):
        read = plan.per_rank_bytes[rank] / med("sliced", rank, "seconds")
        print(
            f"  sliced rank {rank} reads {read / 1e9:.2f} GB/s (page cache warm) = "
            f"{read / warm:.0%} of the warm copy, {read / fresh:.0%} of the fresh copy"
        )

    print(
        "\nsliced rank seconds (tpviz load --json `seconds`: allocation included) against the "
        "floor (fresh memory for exactly the rank's bytes, filled from the page cache), "
        "measured in the same rounds: the floor's memory made as tpviz makes it (torch's "
        "allocator, pages populated), and in a mapping of its own marked for huge pages:"
    )
    for rank in range(w):
        ratios = {}
        for name, runs in (("floor", floors), ("huge-page floor", floors_huge)):
            each = [r["ranks"][rank]["seconds"] / f[rank] for r, f in zip(results["sliced"], runs)]
            ratios[name] = (
                f"{name} {median(f[rank] for f in runs):.3f} s: {median(each):.2f}x "
                f"({min(each):.2f}-{max(each):.2f})"
            )
        print(
            f"  rank {rank}: sliced {med('sliced', rank, 'seconds'):.3f} s; "
            f"{ratios['floor']} (target <= 1.1x); {ratios['huge-page floor']}"
        )

    warm_ranks(source, plan, args.rounds * 3)

    print("\nsliced peak tensor bytes against final shard + largest slice:")
    for rank in range(w):
        largest = max(
            t.source_nbytes(math.prod(b.shape)) for t in plan.params for b in t.ranks[rank].blocks
        )
        peak = med("sliced", rank, "peak_tensor_bytes")
        bound = plan.per_rank_bytes[rank] + largest
        print(
            f"  rank {rank}: peak {peak} B <= shard {plan.per_rank_bytes[rank]} B + largest "
            f"slice {largest} B = {bound} B: {'yes' if peak <= bound else 'NO'}"
        )

    spans = len(plan.units()) + sum(len(t.ranks[0].blocks) for t in plan.params)
    per_call = min(timeit.repeat(lambda: no_span("x").__enter__(), number=10000, repeat=5)) / 1e4
    overhead = spans * per_call
    print(
        f"\nprofiling off: {spans} no-op spans per load x {per_call * 1e9:.0f} ns = "
        f"{overhead * 1e6:.0f} us, {overhead / med('sliced', 0, 'seconds'):.4%} of the sliced "
        "load"
    )


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"\n(benchmark took {time.perf_counter() - start:.0f} s)")
