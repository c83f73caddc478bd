"""The checkpoint-key mapping transformers applies when it loads a model class, as a `KeyMap`.

transformers keeps, per model type and class, a list of `WeightRenaming`s (renames such as
GPT-NeoX's `embed_out.` -> `lm_head.`, legacy `LayerNorm.gamma`) and `WeightConverter`s (several
checkpoint tensors made into one parameter by operations such as `MergeModulelist`, a stack,
and `Concatenate`; one saved transposed, by `Transpose`, such as Qwen3-VL-MoE's experts; or
one made into several by a last `Split` or `Chunk`, such as a fused `query_key_value` into q,
k and v). tpviz asks transformers for that list
(`get_model_conversion_mapping`) and renames every key with transformers' own
`rename_source_key`, so the table cannot drift; the operations are replayed on shapes only
(`tpviz.keymap`), which tells each rank which boxes of which source tensors hold its slice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn

from ..keymap import Assembly, KeyMap, KeyMapError, Layout, cat, split, stack, transpose


def checkpoint_map(model: nn.Module, shapes: Mapping[str, Sequence[int]]) -> KeyMap:
    """How the transformers model `model` reads a checkpoint whose tensors have `shapes`."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        dot_natural_key,
        rename_source_key,
    )

    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    model_shapes = {n: list(t.shape) for n, t in model.state_dict().items()}
    state = dict.fromkeys(model_shapes, True)
    prefix = model.base_model_prefix
    plain: dict[str, str] = {}
    unexpected: dict[str, list[str]] = {}  # renamed -> checkpoint keys the model lacks
    grouped: dict[str, tuple[object, dict[str, list[str]]]] = {}
    # transformers collects the tensors of a stack in this order
    for key in sorted(shapes, key=dot_natural_key):
        name, pattern = rename_source_key(key, renamings, converters, prefix, state)
        if name not in state and key in state:  # as transformers: keep a key the model has
            name, pattern = rename_source_key(key, [], [], prefix, state)
        if name not in state:
            unexpected.setdefault(name, []).append(key)
            continue
        if pattern is None:
            plain.setdefault(name, key)
        else:
            _, collected = grouped.setdefault(name, (by_pattern[pattern], {}))
            collected.setdefault(pattern, []).append(key)
    result = KeyMap({n: Assembly([k], list(shapes[k])) for n, k in plain.items()})
    result.ignored = {k for n in _ignored(model, set(unexpected)) for k in unexpected[n]}
    for name, (converter, collected) in grouped.items():
        names = _target_names(converter, name)
        try:
            result.assemblies.update(_assemble(converter, names, collected, shapes, model_shapes))
        except KeyMapError as e:
            keys = [k for ks in collected.values() for k in ks]
            for target in names:
                error = (
                    f"{target}: transformers builds it from {', '.join(keys[:3])}"
                    f"{' ...' if len(keys) > 3 else ''} with {_ops(converter)}; {e}"
                )
                result.assemblies[target] = Assembly(keys, [], error=error)
    return result


def _target_names(converter, name: str) -> list[str]:
    """The model tensors a converter makes; `name` is the first, the one transformers renames
    its source keys to, and the others differ from it in that target's pattern alone."""
    targets = converter.target_patterns
    if len(targets) < 2 or targets[0] not in name:
        return [name]
    before, _, after = name.partition(targets[0])
    return [before + target + after for target in targets]


def _ignored(model: nn.Module, unexpected: set[str]) -> set[str]:
    """The unexpected (renamed) keys transformers drops without a word when it loads: the
    class's `_keys_to_ignore_on_load_unexpected` and its own exceptions (old per-layer rotary
    `inv_freq`, `position_ids` that became non-persistent)."""
    from transformers.utils.loading_report import LoadStateDictInfo

    info = LoadStateDictInfo(
        missing_keys=set(),
        unexpected_keys=set(unexpected),
        mismatched_keys=set(),
        error_msgs=[],
        conversion_errors={},
        skipped_pp_keys=set(),
    )
    model._adjust_missing_and_unexpected_keys(info)
    return unexpected - info.unexpected_keys


def _ops(converter) -> str:
    return ", ".join(type(op).__name__ for op in converter.operations)


def _check_members(collected: dict[str, list[str]]) -> None:
    """The per-module keys a stack gathers (`experts.N.w1.weight`, N the last index in the key)
    must run 0..n-1 in every pattern: a gap would shift every later member."""
    indices = {p: [_last_index(k) for k in keys] for p, keys in collected.items()}
    count = max((max(found) + 1 for found in indices.values() if None not in found), default=0)
    for pattern, keys in collected.items():
        found = indices[pattern]
        if None in found:
            continue
        for n in sorted(set(range(count)) - set(found)):
            parts = keys[0].split(".")
            at = max(i for i, part in enumerate(parts) if part.isdigit())
            missing = ".".join([*parts[:at], str(n), *parts[at + 1 :]])
            raise KeyMapError(
                f"{missing} is missing from the checkpoint ({len(keys)} of {count} modules "
                "found); the checkpoint is incomplete or does not match config.json"
            )


def _last_index(key: str) -> int | None:
    numbers = [int(part) for part in key.split(".") if part.isdigit()]
    return numbers[-1] if numbers else None


def _assemble(
    converter, names: list[str], collected: dict[str, list[str]], shapes, model_shapes
) -> dict[str, Assembly]:
    """Replay the converter's operations on the shapes of its source tensors: the assembly of
    each model tensor in `names`."""
    from transformers.core_model_loading import Concatenate, MergeModulelist, Transpose

    if any(isinstance(op, MergeModulelist) for op in converter.operations):
        _check_members(collected)
    value: dict[str, list[Layout]] = {
        p: [Layout.of(k, shapes[k]) for k in keys] for p, keys in collected.items()
    }
    steps = []
    for op in converter.operations:
        if isinstance(op, MergeModulelist):
            value = {p: [stack(layouts, op.dim)] for p, layouts in value.items()}
            steps.append(f"stack({op.dim})")
        elif isinstance(op, Concatenate):
            # transformers concatenates in the order of the converter's source patterns
            ordered = [lay for p in converter.source_patterns for lay in value.get(p, [])]
            value = {"": [cat(ordered, op.dim)]}
            steps.append(f"cat({op.dim})")
        elif isinstance(op, Transpose):
            # with check_dims, transformers leaves a tensor already of the model's shape as it is
            value = {
                p: [
                    lay
                    if op.check_dims and lay.shape == model_shapes.get(names[0])
                    else transpose(lay, op.dim0, op.dim1)
                    for lay in layouts
                ]
                for p, layouts in value.items()
            }
            steps.append(f"transpose({op.dim0}, {op.dim1})")
        elif _splits(op) and op is converter.operations[-1] and len(names) > 1:
            whole = _one_layout(value)
            sizes = _split_sizes(op, whole, names, model_shapes)
            value = {n: [part] for n, part in zip(names, split(whole, op.dim, sizes))}
            steps.append(f"{type(op).__name__.lower()}({op.dim})")
        else:
            raise KeyMapError(
                "tpviz reads tensors stacked (MergeModulelist), concatenated (Concatenate), "
                "transposed (Transpose) or split last (Split, Chunk) from checkpoint tensors, "
                f"not {type(op).__name__} there; save the checkpoint with the model's own "
                "tensor names"
            )
    if len(names) == 1:
        value = {names[0]: [_one_layout(value)]}
    combine = ", ".join(steps)
    return {
        n: Assembly([s.key for s in lay.sources], lay.shape, lay.sources, combine)
        for n, (lay,) in value.items()
    }


def _splits(op) -> bool:
    """A Split, or a Chunk into as many parts as the converter has targets."""
    from transformers.core_model_loading import Chunk, Split

    return isinstance(op, Split) or (isinstance(op, Chunk) and op.num_shards_attribute is None)


def _one_layout(value: dict[str, list[Layout]]) -> Layout:
    layouts = [lay for lays in value.values() for lay in lays]
    if len(layouts) != 1:
        raise KeyMapError(f"its operations leave {len(layouts)} tensors, not one")
    return layouts[0]


def _split_sizes(op, whole: Layout, names: list[str], model_shapes) -> list[int]:
    """A Split's parts are as long as its targets are in the model; a Chunk's are equal."""
    from transformers.core_model_loading import Split

    length = whole.shape[op.dim]
    if isinstance(op, Split):
        missing = [n for n in names if n not in model_shapes]
        if missing:
            raise KeyMapError(f"the model has no {missing[0]} to split into")
        return [model_shapes[n][op.dim] for n in names]
    if length % len(names):
        raise KeyMapError(f"{length} does not chunk evenly into {len(names)} tensors")
    return [length // len(names)] * len(names)
