"""Functions the tests run on every rank through `LoadJob.call("tests.helpers:fn")`."""

from __future__ import annotations

import subprocess

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
