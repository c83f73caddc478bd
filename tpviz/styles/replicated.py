"""Styles under which every rank holds the module's tensors whole (or places each tensor by
its own key): nothing is cut and the forward sends nothing."""

from __future__ import annotations

from .base import LINEAR, Style


class Replicate(Style):
    name = "replicate"
    summary = "every rank holds the whole tensor"


class ReplicatedWithGradAllreduce(Style):
    name = "replicated_with_grad_allreduce"
    summary = (
        "every rank holds the whole tensor (gradients all-reduced when training; nothing in "
        "inference)"
    )


class MlaKvAProj(Style):
    name = "mla_kv_a_proj"
    summary = (
        "multi-head latent attention's shared kv down-projection: replicated (its rotary "
        "part's gradient is all-reduced when training; nothing in inference)"
    )
    modules = (LINEAR,)


class LocalParams(Style):
    name = "local_params"
    summary = (
        "the module computes with its own parameters as local tensors, each placed by its own "
        "key (e.g. attention sinks sharded by head)"
    )
    places_params = False
