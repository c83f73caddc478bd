"""The two expert layouts as plans: which modules are experts, and the keys that place them.

An experts module is found from structure, not from model names: a module the plan gives an
experts style, or one holding a stacked tensor (3-D or more) whose first dim is the config's
expert count.

- `experts="tp"` (the default): every experts module the plan leaves unplaced is cut along
  its intermediate features (`moe_tp_experts` on the module, `packed_colwise` or `colwise`
  and `rowwise` on its tensors), keys derived from the module's structure.
- `experts="ep"`: every experts module gets `ep_dispatch_experts` and its stacked tensors
  `grouped_gemm` (cut along the expert dim, whole experts per rank); the keys the TP plan gave
  the experts are replaced. Attention and everything else keep the TP plan.

Either way the plan JSON lists the keys that were really resolved.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from torch import nn

from .. import styles
from .issues import Issues
from .patterns import CompiledPlan, PlanKey
from .types import ResolvedPlan, TensorPlan

LAYOUTS = ("tp", "ep")
TP_MODULE = "moe_tp_experts"
EP_MODULE = "ep_dispatch_experts"
EP_TENSOR = "grouped_gemm"
EXPERT_STYLES = {TP_MODULE, EP_MODULE}  # the styles that run an experts module
GROUPED_MM_ALIGN = 16  # bytes: what each row of torch's grouped_mm operands must be a multiple of
# how configs name the number of routed experts (Mixtral, Qwen/OLMoE, DeepSeek)
_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def check_layout(experts: str) -> None:
    if experts not in LAYOUTS:
        raise ValueError(f"experts must be one of {', '.join(LAYOUTS)}, got {experts!r}")


def expert_count(config: Mapping[str, Any]) -> int | None:
    """The number of routed experts the config declares (its text config's, if nested)."""
    for where in (config, config.get("text_config") or {}):
        for key in _COUNT_KEYS:
            value = where.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def find_experts(
    skeleton: nn.Module, patterns: Mapping[str, str], count: int | None
) -> dict[str, list[str]]:
    """Experts module -> the names in it of its per-expert tensors (first dim = expert count).
    Only modules that follow transformers' experts interface count: both layouts rely on its
    kernels (the skipped expert id under EP, the declared layout under TP)."""
    compiled = CompiledPlan(patterns)
    found: dict[str, list[str]] = {}
    for name, module in skeleton.named_modules():
        if not isinstance(getattr(module, "is_transposed", None), bool):
            continue
        params = {leaf: p for leaf, p in module._parameters.items() if p is not None}
        stacked = [p for p in params.values() if p.dim() >= 3]
        if not stacked:
            continue
        key = compiled.peek(name)
        style = styles.executable(key.style_given) if key else None
        named = style is not None and style.name in EXPERT_STYLES
        # the module's own count (transformers' experts keep `num_experts`), else the config's
        own = getattr(module, "num_experts", None)
        n = stacked[0].shape[0] if named else own if isinstance(own, int) else count
        if n is None or not any(p.shape[0] == n for p in stacked):
            continue
        # per-expert tensors of its submodules too (Ergo's per-expert norm scales)
        inside = module.named_parameters()
        found[name] = [leaf for leaf, p in inside if p.dim() >= 1 and p.shape[0] == n]
    return found


def expert_parallel_plan(
    patterns: Mapping[str, str], skeleton: nn.Module, experts: Mapping[str, list[str]]
) -> dict[str, str]:
    """The TP plan with every experts module (and its stacked tensors) placed whole-expert."""
    # a key that reaches an experts module, or anything inside it (an identity expert), goes
    reached = _keys_reaching(patterns, [n for m in experts for n in _names_in(skeleton, m)])
    kept = {pattern: style for pattern, style in patterns.items() if pattern not in reached}
    added: dict[str, str] = {}
    for module, leaves in experts.items():
        added[_wildcard(module)] = EP_MODULE
        for leaf in leaves:
            added[f"{_wildcard(module)}.{leaf}"] = EP_TENSOR
    return {**kept, **added}


def expert_tensor_parallel_plan(
    patterns: Mapping[str, str],
    skeleton: nn.Module,
    experts: Mapping[str, list[str]],
    warnings: Issues,
) -> dict[str, str]:
    """The plan with every experts module that no key reaches cut by TP: each rank holds its
    slice of every expert's intermediate features, as transformers' MoE TP plans cut them
    (transformers 5.25 dropped those keys from its configs; a plan that places the experts
    itself, `replicate` included, is kept as given). Experts that normalise each expert's
    output stay whole, with a warning: a rank's partial output cannot be normalised."""
    added: dict[str, str] = {}
    for module, leaves in experts.items():
        if _keys_reaching(patterns, _names_in(skeleton, module)):
            continue
        if _acts_on_whole_outputs(skeleton.get_submodule(module)):
            warnings.add(
                "experts_kept_whole",
                module,
                f"{module}: its experts normalise each expert's whole output, which a rank "
                "cutting their intermediate features holds only a term of; they stay whole on "
                "every rank: --experts ep (experts='ep') splits them by expert",
            )
            continue
        cuts = _intermediate_cuts(skeleton.get_submodule(module), leaves)
        if not cuts:
            continue
        added[_wildcard(module)] = TP_MODULE
        for leaf, style in cuts.items():
            added[f"{_wildcard(module)}.{leaf}"] = style
    return {**patterns, **added}


def _intermediate_cuts(module: nn.Module, leaves: list[str]) -> dict[str, str]:
    """Leaf -> the style that cuts it along the experts' intermediate features, read from
    transformers' experts interface (its kernels name the input projection `gate_up_proj` or
    `up_proj`, the output one `down_proj`, their biases `<name>_bias`, and declare whether
    gate and up are concatenated or interleaved); empty: not that interface. The output bias
    stays replicated: the module's rank 0 adds it (see `moe_tp_experts`)."""
    inputs = [leaf for leaf in ("gate_up_proj", "up_proj") if leaf in leaves]
    if len(inputs) != 1 or "down_proj" not in leaves:
        return {}
    (into,) = inputs
    fused = into == "gate_up_proj"
    # the input projection's output features must be the down projection's input features
    # (twice them when gate and up are fused), in the layout the module declares
    out_dim, in_dim = (2, 1) if module.is_transposed else (1, 2)
    features = getattr(module, into).shape[out_dim]
    if features != (2 if fused else 1) * module.down_proj.shape[in_dim]:
        return {}
    # [gate; up] halves are cut part by part; interleaved pairs stay whole in a plain cut
    packed = fused and getattr(module, "is_concatenated", True) is not False
    cuts = {into: "packed_colwise" if packed else "colwise", "down_proj": "rowwise"}
    if f"{into}_bias" in leaves:
        cuts[f"{into}_bias"] = cuts[into]
    return cuts


def _acts_on_whole_outputs(module: nn.Module) -> bool:
    """Whether the experts module computes more than its projections with learned tensors: a
    post-expert norm, declared to transformers' experts interface or held as a module with
    parameters (Ergo's per-expert RMSNorm), acts on each expert's whole output, so the ranks'
    partial terms cannot pass through it and be summed after."""
    declared = getattr(module, "has_post_expert_norm", False) is True
    return declared or any(any(True for _ in c.parameters()) for c in module.children())


def _names_in(skeleton: nn.Module, module: str) -> list[str]:
    """The module's name, and those of everything inside it."""
    inner = skeleton.get_submodule(module)
    names = [_join(module, n) for n, _ in inner.named_modules()]
    return names + [_join(module, n) for n, _ in inner.named_parameters()]


def _keys_reaching(patterns: Mapping[str, str], names: list[str]) -> set[str]:
    return {
        pattern
        for pattern, style in patterns.items()
        if any(PlanKey.compile(pattern, str(style)).regex.search(n) for n in names)
    }


def _wildcard(module: str) -> str:
    """The module's name with its layer indices as `*`: one key for every layer."""
    return ".".join("*" if s.isdigit() else s for s in module.split("."))


def _join(module: str, leaf: str) -> str:
    return f"{module}.{leaf}" if leaf else module


def check_expert_parallel(
    entries: list[TensorPlan], module_styles: Mapping[str, str], world_size: int, errors: Issues
) -> None:
    """Whole experts per rank need both halves of the EP plan: `grouped_gemm` tensors inside an
    `ep_dispatch_experts` module (which remaps the routes to them), and an expert count the
    world size divides (transformers' experts kernels run the same count on every rank)."""
    held: dict[str, TensorPlan] = {}
    for e in entries:
        if e.style == EP_TENSOR and e.global_shape:
            held.setdefault(_experts_holding(e.module, module_styles), e)
    for module, style in module_styles.items():
        if style == EP_MODULE and module not in held:
            errors.add(
                "incomplete_expert_parallel",
                module,
                f"{module}: {EP_MODULE} needs its stacked expert tensors placed {EP_TENSOR} "
                "(whole experts per rank); use --experts ep (experts='ep'), which places both",
            )
    for module, e in held.items():
        if module_styles.get(module) != EP_MODULE:
            errors.add(
                "incomplete_expert_parallel",
                module,
                f"{e.name}: {EP_TENSOR} places whole experts per rank, which only a module "
                f"styled {EP_MODULE} runs (it remaps the routes); use --experts ep "
                "(experts='ep'), which places both",
            )
            continue
        n = e.global_shape[0]
        errors.require_divisor_of(n)
        if n % world_size:
            errors.add(
                "uneven_experts",
                module,
                f"{module}: {n} experts cannot be split evenly over {world_size} ranks (expert "
                "parallelism holds whole experts, the same number on every rank)",
                lists_world_sizes=True,
            )


def _experts_holding(module: str, module_styles: Mapping[str, str]) -> str:
    """The `ep_dispatch_experts` module that is `module` or holds it (a per-expert norm inside
    the experts); `module` itself when none does."""
    at = module
    while at and module_styles.get(at) != EP_MODULE:
        at = at.rpartition(".")[0]
    return at or module


def check_expert_tensor_parallel(
    skeleton: nn.Module,
    experts: Mapping[str, list[str]],
    entries: list[TensorPlan],
    module_styles: Mapping[str, str],
    errors: Issues,
) -> None:
    """Experts cut by TP compute one term of a sum per rank, which is right only when every
    expert's intermediate features are split alike in all its tensors and the module sums the
    terms (`moe_tp_experts`); any other mix runs and gives wrong numbers, so it is refused."""
    held = {e.name: e for e in entries}
    for module, leaves in experts.items():
        style = module_styles.get(module)
        placed = [held[_join(module, leaf)] for leaf in leaves if _join(module, leaf) in held]
        if style == EP_MODULE:
            continue  # check_expert_parallel's
        if style != TP_MODULE:
            cut = [e for e in placed if e.placement != "replicate" and e.style != EP_TENSOR]
            if cut:
                errors.add(
                    "inconsistent_experts",
                    module,
                    f"{cut[0].name} is cut ({cut[0].style}) but its experts module is not "
                    f"styled {TP_MODULE}, which sums the ranks' partial outputs; give "
                    f"{module} {TP_MODULE}, or leave the experts out of the plan (tpviz "
                    "derives their keys)",
                )
            continue
        _check_intermediate_cuts(skeleton.get_submodule(module), placed, errors)


def _check_intermediate_cuts(module: nn.Module, placed: list[TensorPlan], errors: Issues) -> None:
    """Each tensor of a `moe_tp_experts` module holds what the derived keys would give it, and
    the module sums its terms before anything else acts on them."""
    cut = [e for e in placed if e.placement != "replicate"]
    if cut and _acts_on_whole_outputs(module):
        errors.add(
            "inconsistent_experts",
            cut[0].name,
            f"{cut[0].name} is cut ({cut[0].style}), but its experts normalise each expert's "
            "whole output, which a rank holds only a term of; keep the experts whole "
            "('replicate') or use --experts ep",
        )
        return
    cuts = _intermediate_cuts(module, [e.name.rpartition(".")[2] for e in placed])
    if not cuts:
        return  # a layout tpviz cannot read: placed as the plan says
    for e in placed:
        leaf = e.name.rpartition(".")[2]
        style = styles.STYLES[cuts.get(leaf, "replicate")]
        want = style.cut(leaf, len(e.global_shape), module.is_transposed)
        ranks = want.rank_shards(e.global_shape, len(e.ranks), 1)  # blocks only: any itemsize
        if [r.blocks for r in ranks] != [r.blocks for r in e.ranks]:
            errors.add(
                "inconsistent_experts",
                e.name,
                f"{e.name}: under {TP_MODULE} every expert's intermediate features must be "
                f"split alike in all its tensors ({style.name}, {want.placement} here); the "
                f"plan places it {e.placement} ({e.style}). Leave the experts out of the plan "
                "(tpviz derives their keys) or use --experts ep",
            )


def local_experts(plan: ResolvedPlan, rank: int) -> dict[str, tuple[int, int]]:
    """Experts module -> (its first expert, how many) that `rank` holds whole, read from the
    plan's expert-parallel tensors."""
    out: dict[str, tuple[int, int]] = {}
    for e in plan.params:
        if e.style == EP_TENSOR and e.module not in out:
            shard = e.ranks[rank]
            out[e.module] = (shard.blocks[0].offset[0] if shard.blocks else 0, shard.shape[0])
    return out


def fit_expert_kernels(model: nn.Module, plan: ResolvedPlan | None = None, rank: int = 0) -> None:
    """transformers' experts run torch's grouped_mm by default, which refuses operands whose
    rows are not a multiple of 16 bytes. Where the expert tensors a model runs have narrower
    rows than that (a small or odd width, or a cut of one over many ranks), their forward would
    fail, so such a module runs transformers' batched_mm instead: the same products, any width.
    With `plan`: the rank's shards of it (real or simulated ranks); without: the tensors the
    model holds (a whole model, the reference). The module gets a config of its own, so the
    choice stays with it."""
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if getattr(config, "_experts_implementation", None) != "grouped_mm":
            continue
        for leaf, p in module.named_parameters(recurse=False):
            if p.dim() < 3:
                continue
            shape = plan.tensor(_join(name, leaf)).ranks[rank].shape if plan else p.shape
            if any(width * p.dtype.itemsize % GROUPED_MM_ALIGN for width in shape[-2:]):
                module.config = copy.deepcopy(config)
                module.config._experts_implementation = "batched_mm"
                break
