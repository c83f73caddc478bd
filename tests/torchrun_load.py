"""Run by tests/test_torchrun.py under `torchrun --nproc-per-node 2`: load_sharded inside the
process group torchrun made, with an events dir, then one forward. A third argument is
rank 1's own source argument (rank 0 resolves the plan from the first), a fourth its own
strategy; a third argument `exit` makes rank 1 exit at once, and rank 0 wait for it 5 s.
A third argument `resolved` gives every rank a plan resolved beforehand, in the dtype of the
fourth (rank 1 only), and asks for the dtype of the fifth (every rank)."""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.tensor  # noqa: F401  (as in any TP program)
from torch import nn
from torch.distributed.tensor import DTensor

import tpviz

if __name__ == "__main__":
    source, events_dir = sys.argv[1], sys.argv[2]
    strategy, timeout, plan, dtype = "sliced", None, None, None
    if sys.argv[3:4] == ["resolved"]:
        rank1_dtype, dtype = [given or None for given in (sys.argv[4:] + ["", ""])[:2]]
        mine = rank1_dtype if os.environ["RANK"] == "1" else None
        plan = tpviz.resolve_plan(source, 2, dtype=mine)
    elif sys.argv[3:] == ["exit"]:
        if os.environ["RANK"] == "1":
            sys.exit(0)  # as a program does whose rank 1 finds nothing to do
        timeout = 5.0
    elif len(sys.argv) > 3 and os.environ["RANK"] == "1":  # this rank's own arguments
        source = sys.argv[3]
        strategy = sys.argv[4] if len(sys.argv) > 4 else strategy
    loaded = tpviz.load_sharded(
        source, plan, events_dir=events_dir, strategy=strategy, dtype=dtype, timeout=timeout
    )
    # the load builds its DTensor parameters without importing torch._dynamo (about a second);
    # the forward, dispatching through DTensor, imports it
    dynamo_in_load = "torch._dynamo" in sys.modules
    params = dict(loaded.model.named_parameters())
    dtensor_params = sum(
        isinstance(p, DTensor) and isinstance(p, nn.Parameter) for p in params.values()
    )
    logits = loaded.forward(torch.tensor([[1, 5, 42, 7]]))
    if dist.get_rank() == 0:
        print(
            json.dumps(
                {
                    "result": loaded.result,
                    "logits_shape": list(logits.shape),
                    "dynamo_in_load": dynamo_in_load,
                    "dtensor_params": dtensor_params,
                    "params": len(params),
                }
            )
        )
    dist.barrier()  # no rank tears its group down while a peer still uses it
    dist.destroy_process_group()
    # Leave without the interpreter's finalization: torch's gloo objects destroyed there abort
    # the process now and then ("terminate called without an active exception", SIGABRT;
    # pytorch#179291), which torchrun reports as the job failing after all was done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
