"""Functions the tests run on every rank through `LoadJob.call("tests.helpers:fn")`."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import torch
from torch import nn

from tpviz.models.adapter import local_of


def local_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's local tensors (shards as they are held), on CPU."""
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    return {name: local_of(t).detach().cpu().clone() for name, t in tensors.items()}


def start_program(model: nn.Module) -> int:
    """Start a program that would run for ten minutes, and leave it running: its pid."""
    return subprocess.Popen(["sleep", "600"]).pid


def wait_for_go(model: nn.Module, directory: str) -> str:
    """Say this rank has begun (a file `started<rank>` in `directory`), then wait until the
    test writes `go` there (bounded: a test that never does fails, it does not hang)."""
    import torch.distributed as dist

    (Path(directory) / f"started{dist.get_rank()}").touch()
    deadline = time.monotonic() + 120
    while not (Path(directory) / "go").exists():
        if time.monotonic() > deadline:
            raise TimeoutError("no go")
        time.sleep(0.01)
    return "went"


def llama_whose_attention_fails(config: dict) -> nn.Module:
    """A `--model` factory: tpviz's Llama, each attention clamping without bounds (as DBRX's
    does in transformers when its config leaves clip_qkv unset), which fails in any process."""
    from tpviz.models.config import LlamaDims
    from tpviz.models.llama import Attention, LlamaForCausalLM

    class ClampsWithoutBounds(Attention):
        def forward(self, x, cos, sin):
            return torch.clamp(self.q_proj(x), min=None, max=None)

    model = LlamaForCausalLM(LlamaDims.from_config(config), config)
    for layer in model.model.layers:
        layer.self_attn.__class__ = ClampsWithoutBounds
    return model


def transformers_llama(config: dict) -> nn.Module:
    """A `--model` factory: transformers' Llama for the config (its rotary frequencies are a
    buffer its code computes)."""
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))


class _Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)


def with_a_computed_buffer(config: dict) -> nn.Module:
    """A `--model` factory whose model computes a buffer and has no way to compute it again."""
    return nn.Sequential(nn.Embedding(config["vocab_size"], 8), _Rotary())
