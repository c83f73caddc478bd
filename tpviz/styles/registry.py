"""The one place style names live: names and aliases -> style instances.

Adding a style: a module with its class, and a line in `STYLES` below.
"""

from __future__ import annotations

import difflib

from .all_reduce import AllReduce
from .base import Style
from .colwise import Colwise
from .colwise_gather_output import ColwiseGatherOutput
from .embedding_rowwise import EmbeddingRowwise
from .expert_parallel import EpDispatchExperts, GroupedGemm
from .moe_experts import MoeIdentityExpert, MoeTpExperts
from .packed_colwise import PackedColwise
from .packed_rowwise import PackedRowwise
from .replicated import LocalParams, MlaKvAProj, Replicate, ReplicatedWithGradAllreduce
from .rowwise import Rowwise
from .rowwise_split_input import RowwiseSplitInput

# In this order: widgets colour and list styles by it.
STYLES: dict[str, Style] = {
    style.name: style
    for style in (
        Colwise(),
        Rowwise(),
        ColwiseGatherOutput(),
        RowwiseSplitInput(),
        EmbeddingRowwise(),
        PackedColwise(),
        PackedRowwise(),
        MoeTpExperts(),
        MoeIdentityExpert(),
        EpDispatchExperts(),
        GroupedGemm(),
        AllReduce(),
        ReplicatedWithGradAllreduce(),
        MlaKvAProj(),
        LocalParams(),
        Replicate(),
    )
}

# Other names transformers gives the same behaviour: 4.x's, and 5.x's unit_ styles (cuts that
# keep whole heads, replicating them over ranks when there are fewer heads than ranks, which
# tpviz's head analysis does for every cut by head: tpviz/heads.py).
ALIASES: dict[str, str] = {
    "colwise_rep": "colwise_gather_output",
    "rowwise_rep": "rowwise_split_input",
    "local_colwise": "colwise",
    "local_rowwise": "rowwise",
    "unit_colwise": "colwise",
    "unit_rowwise": "rowwise",
}

# Styles transformers ships that tpviz recognises but cannot execute (yet).
UNSUPPORTED: frozenset[str] = frozenset(
    {
        "embedding_colwise",
        "local_packed_rowwise",
        "sequence_parallel",
        "ep_router",
        "isolated",
        "gather",
        "local",
    }
)

DEFAULT_STYLE = "replicate"


class UnknownStyle(ValueError):
    def __init__(self, name: str):
        self.name = name
        close = difflib.get_close_matches(name, [*STYLES, *ALIASES], n=5, cutoff=0.5)
        # suggest canonical names only; an alias that matched first is shown beside its name
        via: dict[str, str | None] = {}
        for match in close:
            via.setdefault(ALIASES.get(match, match), match if match in ALIASES else None)
        self.suggestions = list(via)[:3]
        hint = ", ".join(f"{s} (alias {via[s]})" if via[s] else s for s in self.suggestions)
        aliases = ", ".join(f"{a} = {c}" for a, c in ALIASES.items())
        super().__init__(
            f"unknown TP style {name!r}"
            + (f"; did you mean {hint}?" if hint else "")
            + f" (valid: {', '.join(STYLES)}; aliases: {aliases})"
        )


class UnsupportedStyle(ValueError):
    def __init__(self, name: str):
        self.name = name
        super().__init__(f"TP style {name!r} is known but tpviz cannot execute it")


def executable(name: str) -> Style | None:
    """The style tpviz executes for a name or an alias, or None."""
    return STYLES.get(ALIASES.get(name, name))


def canonical(name: str) -> Style:
    """The style for a name or an alias; raises UnknownStyle / UnsupportedStyle."""
    style = executable(name)
    if style is not None:
        return style
    key = ALIASES.get(name, name)
    if key in UNSUPPORTED:
        raise UnsupportedStyle(name)
    raise UnknownStyle(name)
