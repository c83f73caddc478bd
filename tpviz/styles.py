"""The TP style vocabulary: what each style name does to a module's weight, bias, input and output.

Pure data. The plan engine uses it to place tensors; the runtime maps each executable style to
a `torch.distributed.tensor.parallel` style for the forward.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

LINEAR = "linear"
EMBEDDING = "embedding"
ANY = "any"


@dataclass(frozen=True)
class Style:
    name: str
    weight_dim: int | None  # dim of the weight that is sharded; None: replicated
    bias_sharded: bool
    modules: tuple[str, ...]  # module kinds the style applies to
    packed: bool = False  # fused parts along `weight_dim`, each chunked on its own
    local_output: bool = False  # output stays sharded: the next module sees only local features
    local_input: bool = False  # input arrives sharded on its last dim
    places_params: bool = True  # False: each of the module's tensors is placed by its own key
    summary: str = ""

    def placement_dim(self, param_name: str, ndim: int) -> int | None:
        """Sharded dim of parameter `param_name` with `ndim` dims under this style; None:
        replicate. A bias follows `bias_sharded`; any other parameter is cut like the weight,
        and a 1-D one (attention sinks) along its only dim, as transformers does."""
        if param_name == "bias":
            return 0 if self.bias_sharded else None
        if self.weight_dim is None or ndim == 0:
            return None
        return min(self.weight_dim, ndim - 1)


STYLES: dict[str, Style] = {
    s.name: s
    for s in (
        Style(
            "colwise",
            0,
            True,
            (LINEAR,),
            local_output=True,
            summary="weight rows (output features) split; input replicated; output stays "
            "sharded on its last dim",
        ),
        Style(
            "rowwise",
            1,
            False,
            (LINEAR,),
            local_input=True,
            summary="weight columns (input features) split, bias replicated and added once; "
            "input sharded on its last dim; output all-reduced",
        ),
        Style(
            "colwise_gather_output",
            0,
            True,
            (LINEAR,),
            summary="weight rows split; output all-gathered so every rank sees all features",
        ),
        Style(
            "rowwise_split_input",
            1,
            False,
            (LINEAR,),
            summary="weight columns split; a replicated input is split locally; output all-reduced",
        ),
        Style(
            "embedding_rowwise",
            0,
            False,
            (EMBEDDING,),
            summary="embedding rows (vocabulary) split; masked lookup, then all-reduce",
        ),
        Style(
            "packed_colwise",
            0,
            True,
            (LINEAR,),
            packed=True,
            local_output=True,
            summary="fused weight (e.g. [gate; up]) split part by part along its rows; a rank "
            "holds one block of every part; output stays sharded",
        ),
        Style(
            "replicated_with_grad_allreduce",
            None,
            False,
            (ANY,),
            summary="every rank holds the whole tensor (gradients all-reduced when training; "
            "nothing in inference)",
        ),
        Style(
            "mla_kv_a_proj",
            None,
            False,
            (LINEAR,),
            summary="multi-head latent attention's shared kv down-projection: replicated (its "
            "rotary part's gradient is all-reduced when training; nothing in inference)",
        ),
        Style(
            "local_params",
            None,
            False,
            (ANY,),
            places_params=False,
            summary="the module computes with its own parameters as local tensors, each placed "
            "by its own key (e.g. attention sinks sharded by head)",
        ),
        Style("replicate", None, False, (ANY,), summary="every rank holds the whole tensor"),
    )
}

# Names transformers 4.x used for the same behaviour.
ALIASES: dict[str, str] = {
    "colwise_rep": "colwise_gather_output",
    "rowwise_rep": "rowwise_split_input",
    "local_colwise": "colwise",
    "local_rowwise": "rowwise",
}

# Styles transformers ships that tpviz recognises but cannot execute (yet).
UNSUPPORTED: frozenset[str] = frozenset(
    {
        "embedding_colwise",
        "packed_rowwise",
        "local_packed_rowwise",
        "sequence_parallel",
        "all_reduce",
        "moe_tp_experts",
        "moe_identity_expert",
        "ep_router",
        "grouped_gemm",
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
        hint = ", ".join(f"{s} (v4 alias {via[s]})" if via[s] else s for s in self.suggestions)
        aliases = ", ".join(f"{a} = {c}" for a, c in ALIASES.items())
        super().__init__(
            f"unknown TP style {name!r}"
            + (f"; did you mean {hint}?" if hint else "")
            + f" (valid: {', '.join(STYLES)}; v4 aliases: {aliases})"
        )


class UnsupportedStyle(ValueError):
    def __init__(self, name: str):
        self.name = name
        super().__init__(f"TP style {name!r} is known but tpviz cannot execute it")


def canonical(name: str) -> Style:
    """The style for a v5 name or v4 alias; raises UnknownStyle / UnsupportedStyle."""
    key = ALIASES.get(name, name)
    if key in STYLES:
        return STYLES[key]
    if key in UNSUPPORTED:
        raise UnsupportedStyle(name)
    raise UnknownStyle(name)
