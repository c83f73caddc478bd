"""What makes a plan wrong or doubtful: the issue collector and the checks that run once the
skeleton has been walked (unsupported and unmatched keys, tied tensors, heads, replication).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from torch import nn

from .. import heads, styles
from ..checkpoint import torch_dtype
from ..format import fold_layers, human_bytes
from ..models import HeadCounts
from .patterns import CompiledPlan
from .types import PlanIssue, TensorPlan

MAX_ISSUES_PER_CODE = 10
MAX_LISTED_WORLD_SIZE = 64  # larger world sizes that work are counted, not listed
MOSTLY_REPLICATED = 0.5  # above this share of replicated bytes, a plan gets a warning

# Module styles that compute with their parameters as plain tensors (None: no style given),
# so a parameter re-placed by head is used as the rank's own rows.
PLAIN_TENSOR_STYLES = {None, "replicate", "replicated_with_grad_allreduce", "local_params"}


class Issues:
    """Collects issues, keeping at most MAX_ISSUES_PER_CODE of each code plus a count.

    Each world-size constraint (heads, experts) says which world sizes it allows, whether or not
    this world size breaks it; an issue that breaks one lists the sizes that all of them allow,
    so that no error suggests a world size that another would refuse."""

    def __init__(self) -> None:
        self.items: list[PlanIssue] = []
        self.dropped: dict[str, int] = {}
        # the constraints' allowed sizes, computed only when an issue lists them
        self._constraints: list[Callable[[], Iterable[int]]] = []
        self._common_divisor = 0  # gcd of the counts a world size must divide (0: none)
        self._listing: list[int] = []  # indices of the items that list them

    def add(self, code: str, name: str, message: str, *, lists_world_sizes: bool = False) -> None:
        if sum(i.code == code for i in self.items) < MAX_ISSUES_PER_CODE:
            if lists_world_sizes:
                self._listing.append(len(self.items))
            self.items.append(PlanIssue(code, name, message))
        else:
            self.dropped[code] = self.dropped.get(code, 0) + 1

    def allow_world_sizes(self, sizes: Callable[[], Iterable[int]]) -> None:
        """A world-size constraint: `sizes()` gives the world sizes it allows."""
        self._constraints.append(sizes)

    def require_divisor_of(self, count: int) -> None:
        """A world-size constraint: the world size must divide `count` (kept as one gcd, so that
        thousands of per-expert tensors cost nothing)."""
        self._common_divisor = math.gcd(self._common_divisor, count)

    def finish(self) -> list[PlanIssue]:
        if self._listing:
            works = self._working_world_sizes()
        for i in self._listing:
            self.items[i] = replace(self.items[i], message=f"{self.items[i].message}; {works}")
        for code, n in self.dropped.items():
            self.items.append(PlanIssue(code, "", f"... and {n} more {code} issue(s)", n))
        return self.items

    def _working_world_sizes(self) -> str:
        # 1 meets every constraint, so the list is never empty
        allowed = [set(sizes()) for sizes in self._constraints]
        if self._common_divisor:
            n = self._common_divisor
            allowed.append({w for w in range(1, n + 1) if n % w == 0})
        sizes = sorted(set.intersection(*allowed))
        listed = [str(w) for w in sizes if w <= MAX_LISTED_WORLD_SIZE]
        more = f" and {len(sizes) - len(listed)} larger" if len(sizes) > len(listed) else ""
        return f"world sizes that work: {', '.join(listed)}{more}"


@dataclass
class PlanIssues:
    """A resolution's errors (the plan cannot run) and warnings (it runs, but look)."""

    errors: Issues = field(default_factory=Issues)
    warnings: Issues = field(default_factory=Issues)


def report_unsupported(unsupported: dict[str, list[str]], errors: Issues) -> None:
    """One error per known but unexecutable style, naming the modules it was given to."""
    for style_name, mods in unsupported.items():
        shown = ", ".join(mods[:3]) + (f" and {len(mods) - 3} more" if len(mods) > 3 else "")
        errors.add(
            "unsupported_style",
            mods[0],
            f"style {style_name!r} is not executable by tpviz (modules: {shown}); give these "
            "modules another style, e.g. replicate",
        )


def report_unmatched(compiled: CompiledPlan, modules: Iterable[str], warnings: Issues) -> None:
    """A warning per plan key that styles nothing: it matches no name, or only modules that
    hold no parameters of their own (a style acts on a module's own tensors)."""
    unused = [k for k in compiled.keys if k.pattern not in compiled.used]
    holders = {k.pattern: next((m for m in modules if k.regex.search(m)), None) for k in unused}
    for pattern, holder in holders.items():
        what = (
            f"matches only modules without parameters of their own (such as {holder}): its "
            "style reaches nothing; give it to the modules inside that hold the weights"
            if holder
            else "matches no module or tensor"
        )
        warnings.add("unmatched_pattern", pattern, f"plan key {pattern!r} {what}")


def check_tie(first: TensorPlan, name: str, dim: int | None, errors: Issues) -> None:
    """Tensor `name` is tied to the earlier `first` and its own style would place it along
    `dim`: tied tensors share one storage, so they must be placed alike."""
    if dim != first.shard_dim:
        errors.add(
            "tied_mismatch",
            name,
            f"{name} is tied to {first.name}, but its style places it as "
            f"{'replicate' if dim is None else f'shard({dim})'} while {first.name} is "
            f"{first.placement}; tied tensors need styles that place them alike",
        )


def warn_if_mostly_replicated(entries: list[TensorPlan], world_size: int, warnings: Issues) -> None:
    """A plan that shards nothing, or leaves over half of the bytes whole on every rank, saves
    little memory: say so (transformers gives some architectures no TP plan at all)."""
    if world_size < 2:
        return
    total = replicated = 0
    for e in entries:
        nbytes = e.nbytes
        total += nbytes
        replicated += nbytes if e.placement == "replicate" else 0
    if not total:
        return
    share = replicated / total
    if replicated < total and share <= MOSTLY_REPLICATED:
        return
    what = "the plan shards nothing: " if replicated == total else ""
    warnings.add(
        "mostly_replicated",
        "",
        f"{what}{share:.0%} of the model's bytes ({replicated} of {total}) are replicated, "
        f"so every one of the {world_size} ranks holds them whole; give a plan that shards "
        "the large tensors with --plan FILE.json (plan=...)",
    )


def check_heads(
    skeleton: nn.Module,
    counts: HeadCounts | None,
    entries: list[TensorPlan],
    module_styles: dict[str, str],
    world_size: int,
    issues: PlanIssues,
    kv_replication: bool = True,
) -> dict[str, int]:
    """Refuse world sizes that cut a head, unless (`kv_replication`) replicating key-value
    heads avoids it; make parameters that hold one row per head follow their heads (this may
    re-place entries and change `module_styles`). Returns the attention modules whose
    key-value heads are replicated -> their query heads per key-value head on each rank."""
    attention = heads.attention_modules(skeleton)
    cuts = heads.head_cuts(skeleton, attention, module_styles, counts)
    if cuts:
        issues.errors.allow_world_sizes(lambda: heads.working_world_sizes(cuts, kv_replication))
    for module, message in heads.alignment_errors(cuts, world_size, kv_replication):
        issues.errors.add("head_alignment", module, message, lists_world_sizes=True)
    grouped = heads.replicated_kv(cuts, world_size) if kv_replication else []
    kv_groups = {c.module: c.count for c in grouped}
    _replicate_kv(kv_groups, entries, module_styles, world_size, issues)
    found = heads.head_params(skeleton, attention, cuts)
    _place_head_params(found, entries, module_styles, world_size, issues, kv_groups)
    return heads.local_kv_groups(cuts, grouped, world_size)


def _replicate_kv(
    kv_groups: dict[str, int],
    entries: list[TensorPlan],
    module_styles: dict[str, str],
    world_size: int,
    issues: PlanIssues,
) -> None:
    """Cut each key-value projection's sharded tensors into its heads (`kv_groups`: module ->
    heads), each held by world_size/heads consecutive ranks, and warn with the bytes that adds
    over an exact split. Such a module computes on its plain local tensors: the rank's own
    key-value head from the replicated input, which is all colwise would do."""
    grouped = [e for e in entries if e.module in kv_groups and e.shard_dim is not None]
    for entry in grouped:
        heads_held = kv_groups[entry.module]
        # one key-value head (multi-query attention) is simply whole on every rank
        dim = entry.shard_dim if heads_held > 1 else None
        _place(entry, styles.Cut(dim, groups=heads_held if dim is not None else None), world_size)
        module_styles[entry.module] = "local_params"
    if not grouped:
        return
    extra = sum(sum(r.bytes for r in e.ranks) - e.nbytes for e in grouped)
    heads_of = sorted(set(kv_groups.values()))
    issues.warnings.add(
        "kv_heads_replicated",
        grouped[0].module,
        f"{world_size} ranks exceed the {'/'.join(map(str, heads_of))} key-value heads: "
        f"{len(grouped)} tensor(s) of {len(kv_groups)} key-value projection(s) (e.g. "
        f"{fold_layers(grouped[0].name)}) are cut into their heads, each held by the "
        f"{world_size // heads_of[0]} consecutive ranks whose query heads use it "
        f"({grouped[0].placement}); this adds {human_bytes(extra)} ({extra} bytes) in all, "
        f"{human_bytes(extra // world_size)} per rank, over an exact split; pass "
        "--no-kv-replication (kv_replication=False) to refuse instead",
    )


def _place_head_params(
    found: list[heads.HeadParam],
    entries: list[TensorPlan],
    module_styles: dict[str, str],
    world_size: int,
    issues: PlanIssues,
    kv_groups: dict[str, int],
) -> None:
    """Parameters that hold one row per head follow their heads (sharded by head where the
    plan left them whole, in groups where the heads are replicated); a norm spanning all heads
    of a cut projection is refused."""
    by_name = {e.name: e for e in entries}
    resharded: dict[str, list[TensorPlan]] = {}  # layer-folded name -> entries
    for hp in found:
        entry = by_name.get(hp.name)
        if entry is None:
            continue
        if hp.spans:
            issues.errors.add(
                "head_parameter",
                hp.module,
                f"{hp.module}: {hp.name} {entry.global_shape} spans the features of all heads "
                f"of {hp.cut}, which the plan cuts by head, so no rank can apply it to its own "
                "heads; gather its output instead (colwise_gather_output, and rowwise_split_input "
                "on the output projection)",
            )
        elif (
            entry.placement == "replicate"
            and module_styles.get(hp.module) in PLAIN_TENSOR_STYLES
            and kv_groups.get(hp.cut) != 1
        ):
            _shard_by_head(entry, world_size, kv_groups.get(hp.cut))
            module_styles[hp.module] = "local_params"
            resharded.setdefault(fold_layers(hp.name), []).append(entry)
    for folded, same in resharded.items():
        issues.warnings.add(
            "sharded_by_head",
            same[0].name,
            f"{folded} ({len(same)} tensor(s), {same[0].global_shape}) holds one row per "
            "head of a projection the plan cuts by head; tpviz shards it by head too "
            f"({same[0].placement}), so each rank applies its own heads' rows",
        )


def _shard_by_head(entry: TensorPlan, world_size: int, groups: int | None) -> None:
    """Re-place a replicated entry as colwise cuts it, shard(0), or in `groups` (the name
    given stays)."""
    colwise = styles.canonical("colwise")
    cut = colwise.cut(entry.name.rpartition(".")[2], len(entry.global_shape))
    entry.style = colwise.name
    entry.pattern = None
    _place(entry, styles.Cut(cut.dim, cut.parts, groups), world_size)


def _place(entry: TensorPlan, cut: styles.Cut, world_size: int) -> None:
    itemsize = torch_dtype(entry.dtype).itemsize
    entry.placement = cut.placement
    entry.ranks = cut.rank_shards(entry.global_shape, world_size, itemsize)
