"""`embedding_rowwise`: an Embedding cut along its vocabulary."""

from __future__ import annotations

from .base import EMBEDDING, REPLICATE, Forward, Style


class EmbeddingRowwise(Style):
    name = "embedding_rowwise"
    summary = "embedding rows (vocabulary) split; masked lookup, then all-reduce"
    modules = (EMBEDDING,)
    weight_dim = 0
    # each rank looks up the ids in its rows (zeros elsewhere); DTensor sums the partial rows
    forward = Forward(REPLICATE, REPLICATE, REPLICATE, collective="all-reduce of the output")
