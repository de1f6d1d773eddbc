"""Training data shipped with infinity: a public-domain byte corpus and deterministic rank-sliced batches."""

from infinity.data.corpus import ByteBatches, load_corpus

__all__ = ["ByteBatches", "load_corpus"]
