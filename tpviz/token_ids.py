"""Token ids for a sharded forward, checked before they reach the ranks.

A vocabulary-sharded embedding looks an id up on the rank that owns its row and all-reduces;
an id no rank owns (negative, or past the vocabulary) comes back as a zero vector and finite,
meaningless logits, where a single-process `nn.Embedding` raises. So ids are checked here.
"""

from __future__ import annotations

from typing import Any

import torch


def check_token_ids(input_ids: Any, vocab_size: int) -> torch.Tensor:
    """`input_ids` (a tensor or nested lists, shape (batch, seq) or (seq,)) as a (batch, seq)
    long tensor; raises ValueError naming what is wrong (an id out of range, with the
    vocabulary size)."""
    try:
        ids = torch.as_tensor(input_ids)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"input_ids must be a tensor or nested lists of ints ({e})") from None
    if ids.numel() == 0:
        raise ValueError(f"input_ids is empty (shape {tuple(ids.shape)}); give at least one token")
    if ids.dtype == torch.bool or ids.dtype.is_floating_point or ids.dtype.is_complex:
        raise ValueError(f"input_ids must hold integers, not {str(ids.dtype).split('.')[-1]}")
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2:
        raise ValueError(
            f"input_ids must be (batch, seq) or (seq,), not {ids.dim()}-D {tuple(ids.shape)}"
        )
    # Compared in int64: in a narrow dtype the vocabulary size itself wraps (1000 as int8 is
    # -24), and torch has no comparisons for uint16..uint64. Every id a vocabulary can hold
    # fits int64; a uint64 id past it wraps negative, so it is refused as it should be.
    wide = ids.to(torch.long)
    bad = (wide < 0) | (wide >= vocab_size)
    if bad.any():
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"token id {ids[index].tolist()} at input_ids{list(index)} is outside the vocabulary "
            f"(ids 0..{vocab_size - 1}, vocabulary size {vocab_size})"
        )
    return wide
