"""Attention heads in a plan, found from the model's structure rather than from module names.

An attention module is one that declares a head size (`head_dim`, `head_size`, `v_head_dim`,
...) or whose class is named `...Attention`, innermost if they nest. A projection inside one
that the plan cuts with a style that leaves its features local (colwise's output, rowwise's
input) carries heads when the cut dim is a whole number of heads: `heads` or `kv_heads` blocks,
each a multiple of a head size (q/k/v/o, GPT-NeoX's interleaved fused qkv with three head sizes
a head, latent attention's up-projections). Every rank's block must then start and end on a
head boundary; the same test, run for other world sizes, gives the sizes that work.

Parameters inside such attention that hold one row per head (q/k norms shaped heads x head_dim,
attention sinks) must be cut with the heads, or each rank would apply all heads' rows to its
own few heads.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch import nn

from . import styles
from .chunks import shard_blocks
from .models import HeadCounts

HEAD_SIZE_ATTRS = ("head_size", "head_dim")  # and any attribute ending in `_head_dim`


@dataclass(frozen=True)
class HeadCut:
    """A module whose weight dim `dim` (`size` features, `parts` packed parts) the plan cuts
    while the model sees the local features; it holds `count` heads of `unit` features each."""

    module: str
    attention: str
    shape: tuple[int, ...]
    dim: int
    parts: int
    count: int
    unit: int
    what: str

    def cuts_a_head(self, world_size: int) -> bool:
        return _cuts_a_head(self.shape, self.dim, self.parts, self.unit, world_size)


@functools.lru_cache(maxsize=4096)  # every layer repeats the same few geometries
def _cuts_a_head(shape: tuple[int, ...], dim: int, parts: int, unit: int, world_size: int) -> bool:
    part_len = shape[dim] // parts
    for blocks in shard_blocks(list(shape), dim, world_size, parts):
        for b in blocks:
            if (b.offset[dim] % part_len) % unit or b.shape[dim] % unit:
                return True
    return False


def _head_sizes(module: nn.Module) -> set[int]:
    found = set()
    for name, value in vars(module).items():
        named = name in HEAD_SIZE_ATTRS or name.endswith("_head_dim")
        if named and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            found.add(value)
    return found


def attention_modules(model: nn.Module) -> dict[str, set[int]]:
    """Innermost attention modules -> the head sizes they declare."""
    found: dict[str, set[int]] = {}
    for name, m in model.named_modules():
        sizes = _head_sizes(m)
        if sizes or type(m).__name__.endswith("Attention"):
            found[name] = sizes
    outer = {".".join(n.split(".")[:i]) for n in found if n for i in range(n.count(".") + 1)}
    return {n: d for n, d in found.items() if n not in outer}


def _counts(module: nn.Module, counts: HeadCounts) -> tuple[int, int]:
    """(heads, key-value heads): the module's own attributes first, then the config's."""
    heads = getattr(module, "num_heads", None) or getattr(module, "num_attention_heads", None)
    heads = heads if isinstance(heads, int) else counts.heads
    kv = getattr(module, "num_key_value_heads", None)
    groups = getattr(module, "num_key_value_groups", None)
    if not isinstance(kv, int):
        kv = heads // groups if isinstance(groups, int) and groups else counts.kv_heads
    return heads, kv or heads


def _owner(name: str, attention: dict[str, set[int]]) -> str | None:
    """The innermost attention module that holds module `name`."""
    parts = name.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:depth])
        if prefix in attention:
            return prefix
    return None


def head_cuts(
    model: nn.Module, module_styles: dict[str, str], counts: HeadCounts | None
) -> list[HeadCut]:
    """The cuts the plan makes through attention heads (see the module docstring)."""
    if counts is None:
        return []
    attention = attention_modules(model)
    cuts = []
    for mod_name, style_name in module_styles.items():
        style = styles.STYLES[style_name]
        owner = _owner(mod_name, attention) if style.model_sees_cut else None
        weight = getattr(model.get_submodule(mod_name), "weight", None) if owner else None
        if weight is None or weight.dim() <= style.weight_dim:
            continue
        attn = model.get_submodule(owner)
        sizes = attention[owner] | ({counts.head_dim} - {0})
        heads, kv = _counts(attn, counts)
        parts = style.packed_parts
        part_len = weight.shape[style.weight_dim] // parts
        for count, what in ((heads, "attention heads"), (kv, "key-value heads")):
            unit = part_len // count if count and part_len % count == 0 else 0
            if unit and any(unit % d == 0 for d in sizes):
                shape = tuple(weight.shape)
                cuts.append(
                    HeadCut(mod_name, owner, shape, style.weight_dim, parts, count, unit, what)
                )
                break
    return cuts


def working_world_sizes(cuts: list[HeadCut]) -> list[int]:
    """World sizes at which no cut falls inside a head (a world size above a count always
    cuts)."""
    limit = min((c.count for c in cuts), default=1)
    return [w for w in range(1, limit + 1) if not any(c.cuts_a_head(w) for c in cuts)]


def alignment_errors(cuts: list[HeadCut], world_size: int) -> list[tuple[str, str]]:
    """(module, message) per kind of head that `world_size` would cut."""
    cutting: dict[tuple[str, int], list[HeadCut]] = {}
    for c in cuts:
        if c.cuts_a_head(world_size):
            cutting.setdefault((c.what, c.count), []).append(c)
    if not cutting:
        return []
    works = ", ".join(map(str, working_world_sizes(cuts)))
    out = []
    for (what, count), found in cutting.items():
        first = found[0]
        out.append(
            (
                first.module,
                f"{count} {what} cannot be split over {world_size} ranks: the plan shards "
                f"{len(found)} module(s) by head (e.g. {first.module}, dim {first.dim}, "
                f"{first.unit} features a head) and would cut a head; world sizes that work: "
                f"{works}",
            )
        )
    return out


@dataclass(frozen=True)
class HeadParam:
    """A parameter inside head-cut attention that holds heads: one row per head of the cut
    projection `cut` (shard it with the heads), or, with `spans`, the full feature width of
    `cut`, which no rank can apply to its own heads alone (refuse)."""

    name: str
    module: str
    cut: str
    spans: bool


def head_params(model: nn.Module, cuts: list[HeadCut]) -> list[HeadParam]:
    """Parameters of head-cut attention modules, outside the cut projections, that hold heads."""
    by_attention: dict[str, list[HeadCut]] = {}
    for c in cuts:
        by_attention.setdefault(c.attention, []).append(c)
    cut_modules = {c.module for c in cuts}
    found = []
    for attn, attn_cuts in by_attention.items():
        module = model.get_submodule(attn)
        sizes = _head_sizes(module)
        for mod_name, owner in module.named_modules(prefix=attn):
            if mod_name in cut_modules or isinstance(owner, (nn.Linear, nn.Embedding)):
                continue
            for leaf, p in owner.named_parameters(recurse=False):
                held = _holds_heads(p, owner is module, attn_cuts, sizes)
                if held:
                    found.append(HeadParam(f"{mod_name}.{leaf}", mod_name, *held))
    return found


def _holds_heads(
    p: nn.Parameter, bare: bool, cuts: list[HeadCut], sizes: set[int]
) -> tuple[str, bool] | None:
    """(the cut projection whose heads `p` holds, whether it spans all of them) or None."""
    if p.dim() == 0:
        return None
    for c in cuts:
        # a bare parameter of the attention (sinks) or a norm's (heads, head_dim) weight
        if p.shape[0] == c.count and (bare or p.dim() >= 2):
            return c.module, False
    for c in cuts:
        width = c.shape[c.dim] // c.parts
        if p.dim() == 1 and p.shape[0] == width and width not in sizes:
            return c.module, True
    return None
