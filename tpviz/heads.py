"""Attention heads in a plan, found from the model's structure rather than from module names.

An attention module is one that declares a head size (`head_dim`, `head_size`, `v_head_dim`,
...) or whose class is named `...Attention`; where they nest (DeepSeek-V3.2's indexer, with
heads of its own, inside its attention), a module belongs to the innermost. A projection inside one
that the plan cuts with a style that leaves its features local (colwise's output, rowwise's
input) carries heads when the cut dim is a whole number of heads: `heads` or `kv_heads` blocks,
each a multiple of a head size (q/k/v/o, GPT-NeoX's interleaved fused qkv with three head sizes
a head, latent attention's up-projections). Every rank's block must then start and end on a
head boundary; the same test, run for other world sizes, gives the sizes that work.

With more ranks than key-value heads, a world size that is a multiple of their count (and
splits the query heads evenly) still works: each key-value projection is cut into its heads,
each held by the consecutive ranks whose query heads use it (`replicated_kv`).

Parameters inside such attention that hold one row per head (q/k norms shaped heads x head_dim,
attention sinks) must be cut with the heads, or each rank would apply all heads' rows to its
own few heads.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from . import styles
from .chunks import shard_blocks
from .models import HeadCounts

HEAD_SIZE_ATTRS = ("head_size", "head_dim")  # and any attribute ending in `_head_dim`
QUERY_HEADS, KV_HEADS = "attention heads", "key-value heads"  # what a HeadCut's heads are


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
    """Attention modules -> the head sizes they declare."""
    found: dict[str, set[int]] = {}
    for name, m in model.named_modules():
        sizes = _head_sizes(m)
        if name and (sizes or type(m).__name__.endswith("Attention")):
            found[name] = sizes
    return found


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
    model: nn.Module,
    attention: dict[str, set[int]],
    module_styles: dict[str, str],
    counts: HeadCounts | None,
) -> list[HeadCut]:
    """The cuts the plan makes through attention heads (see the module docstring);
    `attention`: the model's `attention_modules`."""
    if counts is None:
        return []
    cuts = []
    for mod_name, style_name in module_styles.items():
        style = styles.STYLES[style_name]
        owner = _owner(mod_name, attention) if style.model_sees_cut else None
        weight = getattr(model.get_submodule(mod_name), "weight", None) if owner else None
        if weight is None or weight.dim() <= style.weight_dim:
            continue
        attn = model.get_submodule(owner)
        # the module's own head sizes; the config's only where it declares none (a config
        # that sets head_dim per layer, Gemma 4's, gives hidden / heads, a size no head has)
        sizes = attention[owner] or ({counts.head_dim} - {0})
        heads, kv = _counts(attn, counts)
        parts = style.packed_parts
        found = _heads_of(weight.shape[style.weight_dim] // parts, sizes, heads, kv)
        if found:
            count, unit, what = found
            shape = tuple(weight.shape)
            cuts.append(HeadCut(mod_name, owner, shape, style.weight_dim, parts, count, unit, what))
    return cuts


def _heads_of(features: int, sizes: set[int], heads: int, kv: int) -> tuple[int, int, str] | None:
    """(count, unit, what) of the heads `features` holds: a unit that is a head size, else a
    multiple of one (fused q/k/v, latent up-projections); query heads first. A value head
    wider than the query/key head (MiMo's) can hold as many features as two query heads'
    worth: the unit that is itself a head size says which it is."""
    candidates = []
    for count, what in ((heads, QUERY_HEADS), (kv, KV_HEADS)):
        if count and features % count == 0:
            candidates.append((count, features // count, what))
    for fits in (lambda unit: unit in sizes, lambda unit: any(unit % d == 0 for d in sizes)):
        for count, unit, what in candidates:
            if fits(unit):
                return count, unit, what
    return None


def replicated_kv(cuts: list[HeadCut], world_size: int) -> list[HeadCut]:
    """The key-value cuts to replicate so that `world_size` cuts no head, or [] (nothing to
    replicate, or replication cannot make it work). A key-value projection can be cut into its
    heads, each held by world_size/heads consecutive ranks, when the world size is a multiple
    of its heads and its attention's query heads split evenly over the ranks: then rank r's
    query heads all use key-value head r // (world_size/heads), the one it holds."""
    cutting = [c for c in cuts if c.cuts_a_head(world_size)]
    queries: dict[str, list[int]] = {}
    for c in cuts:
        if c.what == QUERY_HEADS:
            queries.setdefault(c.attention, []).append(c.count)

    def groupable(c: HeadCut) -> bool:
        counts = queries.get(c.attention)
        return (
            c.what == KV_HEADS
            and c.parts == 1
            and world_size % c.count == 0
            and bool(counts)
            and all(n % world_size == 0 for n in counts)
        )

    return cutting if cutting and all(groupable(c) for c in cutting) else []


def local_kv_groups(cuts: list[HeadCut], grouped: list[HeadCut], world_size: int) -> dict[str, int]:
    """Attention module -> query heads per key-value head on each rank, for the attention
    modules of `grouped` cuts (each rank holds one key-value head)."""
    queries = {c.attention: c.count for c in cuts if c.what == QUERY_HEADS}
    return {c.attention: queries[c.attention] // world_size for c in grouped}


def working_world_sizes(cuts: list[HeadCut], replicate_kv: bool = False) -> list[int]:
    """World sizes at which no cut falls inside a head (a world size above a count always
    cuts), or, with `replicate_kv`, at which replicating key-value heads avoids it."""
    counts = [c.count for c in cuts]
    limit = (max if replicate_kv else min)(counts, default=1)
    return [
        w
        for w in range(1, limit + 1)
        if not any(c.cuts_a_head(w) for c in cuts) or (replicate_kv and replicated_kv(cuts, w))
    ]


def alignment_errors(
    cuts: list[HeadCut], world_size: int, replicate_kv: bool = False
) -> list[tuple[str, str]]:
    """(module, message) per kind of head that `world_size` would cut (none when `replicate_kv`
    and replicating key-value heads avoids every cut)."""
    if replicate_kv and replicated_kv(cuts, world_size):
        return []
    cutting: dict[tuple[str, int], list[HeadCut]] = {}
    for c in cuts:
        if c.cuts_a_head(world_size):
            cutting.setdefault((c.what, c.count), []).append(c)
    if not cutting:
        return []
    also = ""
    if not replicate_kv and replicated_kv(cuts, world_size):
        also = " (this world size works with key-value replication, the default)"
    out = []
    for (what, count), found in cutting.items():
        first = found[0]
        out.append(
            (
                first.module,
                f"{count} {what} cannot be split over {world_size} ranks: the plan shards "
                f"{len(found)} module(s) by head (e.g. {first.module}, dim {first.dim}, "
                f"{first.unit} features a head) and would cut a head{also}",
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


def head_params(
    model: nn.Module, attention: dict[str, set[int]], cuts: list[HeadCut]
) -> list[HeadParam]:
    """Parameters of head-cut attention modules, outside the cut projections, that hold heads;
    `attention`: the model's `attention_modules`."""
    by_attention: dict[str, list[HeadCut]] = {}
    for c in cuts:
        by_attention.setdefault(c.attention, []).append(c)
    cut_modules = {c.module for c in cuts}
    found = []
    for attn, attn_cuts in by_attention.items():
        module = model.get_submodule(attn)
        # its own modules: not those of an attention nested in it, whose heads are its own
        modules = {
            n: m
            for n, m in module.named_modules(prefix=attn)
            if n == attn or (n not in attention and _owner(n, attention) == attn)
        }
        # all heads' features as the cut projections put them out (dim 0: a weight's rows)
        head_outputs = {c.shape[0] // c.parts for c in attn_cuts if c.dim == 0}
        # a norm as wide as the output of a linear the plan leaves whole may be that linear's
        # (latent attention's q_a_layernorm after q_a_proj), however many heads' features it
        # equals: not refused, unless that linear takes the heads in (a whole o_proj)
        widths = _head_sizes(module) | {
            m.out_features
            for n, m in modules.items()
            if isinstance(m, nn.Linear)
            and n not in cut_modules
            and m.in_features not in head_outputs
        }
        for mod_name, owner in modules.items():
            if mod_name in cut_modules or isinstance(owner, (nn.Linear, nn.Embedding)):
                continue
            for leaf, p in owner.named_parameters(recurse=False):
                held = _holds_heads(p, owner is module, attn_cuts, widths)
                if held:
                    found.append(HeadParam(f"{mod_name}.{leaf}", mod_name, *held))
    return found


def _holds_heads(
    p: nn.Parameter, bare: bool, cuts: list[HeadCut], other_widths: set[int]
) -> tuple[str, bool] | None:
    """(the cut projection whose heads `p` holds, whether it spans all of them) or None. A
    1-D `p` as wide as one of `other_widths` (a head size, a whole linear's output) is taken
    to belong to that instead."""
    if p.dim() == 0:
        return None
    for c in cuts:
        # a bare parameter of the attention (sinks) or a norm's (heads, head_dim) weight
        if p.shape[0] == c.count and (bare or p.dim() >= 2):
            return c.module, False
    for c in cuts:
        width = c.shape[c.dim] // c.parts
        if p.dim() == 1 and p.shape[0] == width and width not in other_widths:
            return c.module, True
    return None


def set_local_kv_groups(model: nn.Module, groups: Mapping[str, int]) -> None:
    """On a rank (real or simulated): each attention module in `groups` (a plan's
    `local_kv_groups`) holds one key-value head for that many query heads; attention code that
    repeats key-value heads by the module's `num_key_value_groups` (transformers') must repeat
    them that often, not by the global ratio. Code that reads the ratio off the tensors' head
    counts (the built-in Llama) needs nothing."""
    for name, count in groups.items():
        attention = model.get_submodule(name)
        if isinstance(getattr(attention, "num_key_value_groups", None), int):
            attention.num_key_value_groups = count
