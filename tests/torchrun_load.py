"""Run by tests/test_torchrun.py under `torchrun --nproc-per-node 2`: load_sharded inside the
process group torchrun made, with an events dir, then one forward."""

import json
import sys

import torch
import torch.distributed as dist

import tpviz

if __name__ == "__main__":
    source, events_dir = sys.argv[1], sys.argv[2]
    loaded = tpviz.load_sharded(source, events_dir=events_dir)
    logits = loaded.forward(torch.tensor([[1, 5, 42, 7]]))
    if dist.get_rank() == 0:
        print(json.dumps({"result": loaded.result, "logits_shape": list(logits.shape)}))
    dist.barrier()  # no rank tears its group down while a peer still uses it
    dist.destroy_process_group()
