"""Each tensor a plan loads, matched with the checkpoint tensors it is read from: its keys
(renamed or assembled by the model class's key map), checked against the headers (dtype kind,
shape); what the checkpoint lacks, holds beyond the model, or holds twice (tied copies)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from ..checkpoint import Checkpoint, torch_dtype
from ..keymap import Assembly, KeyMap, odd_one_out

MISMATCH_ADVICE = "check that config.json matches the weights"
# what quantisers save beside or instead of a weight: FP8 block scales, GPTQ/AWQ packed
# integers and their zero points, MXFP4 blocks
QUANTIZATION_KEY = re.compile(
    r"(^|[._])(weight_scale(_inv)?|input_scale|scales|qweight|qzeros|g_idx|zero_point|blocks)$"
)
QUANTIZED_ADVICE = (
    "the weights look quantized, though config.json declares no quantization_config; tpviz "
    "loads floating-point weights: use an unquantized checkpoint of the model"
)


def match_checkpoint(
    entries: Sequence,
    ckpt: Checkpoint,
    keymap: KeyMap | None,
    errors,
    warnings,
    advice: str,
) -> None:
    """Give each loaded tensor plan its checkpoint keys (and sources, if assembled), checked
    against the headers; `errors.add` the model tensors the checkpoint lacks (with `advice`)
    or cannot give and the checkpoint tensors the model does not use, `warnings.add` the
    copies of tied tensors left unread. `keymap` None: a tensor's key is its name."""
    used = set(keymap.ignored) if keymap else set()
    missing, renamed = [], {}  # renamed: a model name's numbering -> its checkpoint key's
    for e in entries:
        if e.origin != "checkpoint":
            continue
        found = _assembly(e, ckpt, keymap)
        if found is not None and found.keys != [e.name] and len(found.keys) == 1:
            renamed.setdefault(_numbering(e.name)[0], _numbering(found.keys[0])[0])
        used.update(_tied_copies_said(e, found, ckpt, keymap, errors, warnings))
        if found is None:
            missing.append(e.name)
            continue
        used.update(found.keys)
        if found.error:
            errors.add("unsupported_conversion", e.name, found.error)
            continue
        e.checkpoint_keys, e.sources, e.combine = found.keys, found.sources, found.combine
        _check_found(e, found, [ckpt.tensors[k] for k in found.keys], errors)
    for name in missing:
        errors.add(
            "missing_tensor",
            name,
            f"{name}{_saved_as(name, renamed)} is in the model but not in the checkpoint "
            f"{ckpt.path}; {advice}",
        )
    for name in sorted(set(ckpt.tensors) - used):
        errors.add(
            "unexpected_tensor",
            name,
            f"{name} is in the checkpoint ({ckpt.tensors[name].file}) but not in the model; "
            + (QUANTIZED_ADVICE if QUANTIZATION_KEY.search(name) else MISMATCH_ADVICE),
        )


def _numbering(name: str) -> tuple[str, list[str]]:
    """A dotted name with its numbered parts (layer, expert) taken out: the name with `{}`
    where each was, and the numbers."""
    parts = name.split(".")
    numbers = [p for p in parts if p.isdigit()]
    return ".".join("{}" if p.isdigit() else p for p in parts), numbers


def _saved_as(name: str, renamed: Mapping[str, str]) -> str:
    """`name`'s checkpoint key, where the checkpoint holds tensors like it (another layer's or
    expert's) under other names than the model's: " (saved as KEY)", else ""."""
    pattern, numbers = _numbering(name)
    around = renamed[pattern].split("{}") if pattern in renamed else []
    if len(around) != len(numbers) + 1:
        return ""
    key = "".join(part + number for part, number in zip(around, [*numbers, ""]))
    return f" (saved as {key})"


def _check_found(e, found: Assembly, infos: list, errors) -> None:
    """The checkpoint tensors a model tensor is read from, against it: one dtype, of the same
    kind (floating point or not), making its shape."""
    e.source_dtype = infos[0].dtype
    differ = odd_one_out(infos, lambda i: i.dtype)
    if differ:
        odd, like = differ
        errors.add(
            "mixed_dtypes",
            e.name,
            f"{e.name}: {odd.file}: tensor {odd.name!r} is {odd.dtype} where {like.name!r} is "
            f"{like.dtype}, and the {len(infos)} tensors it is made from must share one dtype; "
            "save them in one dtype",
        )
    if infos[0].torch_dtype.is_floating_point != torch_dtype(e.dtype).is_floating_point:
        errors.add(
            "dtype_mismatch",
            e.name,
            f"{infos[0].file}: tensor {found.keys[0]!r} is {infos[0].dtype}, but {e.name} is "
            f"{e.dtype} (floating point and integer values do not convert); check that the "
            "checkpoint matches the model",
        )
    if found.shape != e.global_shape:
        if len(infos) == 1:
            held = f"{infos[0].file} holds {list(infos[0].shape)} as {found.keys[0]}"
            if found.combine:  # saved in another layout (transposed)
                held += f", which {found.combine} makes {found.shape}"
        else:
            held = f"its {len(infos)} checkpoint tensors make {found.shape} ({found.combine})"
        errors.add(
            "shape_mismatch",
            e.name,
            f"{e.name}: the model expects shape {e.global_shape}, {held}",
        )


def _assembly(e, ckpt: Checkpoint, keymap: KeyMap | None) -> Assembly | None:
    """How the tensor is read: from the first of its tied names the checkpoint holds."""
    return next(filter(None, (_assembly_of(n, ckpt, keymap) for n in [e.name, *e.tied_to])), None)


def _assembly_of(name: str, ckpt: Checkpoint, keymap: KeyMap | None) -> Assembly | None:
    if keymap is not None:
        return keymap.assemblies.get(name)
    return Assembly([name], list(ckpt.tensors[name].shape)) if name in ckpt.tensors else None


def _tied_copies_said(
    e, found: Assembly | None, ckpt: Checkpoint, keymap: KeyMap | None, errors, warnings
) -> list[str]:
    """The checkpoint's own tensors for the tensor's other tied names (returned: they are
    accounted for): a copy is left unread with a warning, another shape is an error."""
    copies, unlike = _tied_copies(e, found, ckpt, keymap)
    for key in unlike:
        errors.add(
            "shape_mismatch",
            e.name,
            f"{key} ({ckpt.tensors[key].file}) is {list(ckpt.tensors[key].shape)}, but it is "
            f"tied to {e.name}, which is read from {', '.join(found.keys)} as {found.shape}; "
            "check that config.json's ties (tie_word_embeddings) match the checkpoint",
        )
    if copies:
        warnings.add(
            "tied_copy_unread",
            e.name,
            f"{', '.join(copies)}: tied to {e.name} (tie_word_embeddings or the model's own "
            f"ties), which is read from {', '.join(found.keys)}; the checkpoint's copy is "
            "not read, as transformers does not use it either",
        )
    return copies + unlike


def _tied_copies(
    e, found: Assembly | None, ckpt: Checkpoint, keymap: KeyMap | None
) -> tuple[list[str], list[str]]:
    """The checkpoint keys of the tensor's other tied names that hold one tensor of their own
    (a checkpoint saved without dropping tied copies): copies of the tensor read (its shape),
    and tensors of another shape, which cannot be the same tensor."""
    copies, unlike = [], []
    if found is None or found.error:
        return copies, unlike
    for name in [e.name, *e.tied_to]:
        other = _assembly_of(name, ckpt, keymap)
        if other and other.keys != found.keys and len(other.keys) == 1 and not other.error:
            (copies if other.shape == found.shape else unlike).extend(other.keys)
    return copies, unlike
