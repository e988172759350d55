"""Torch modules whose `forward` is exactly one registered graph's I/O (see `..graphs.EXPORT_RECIPES`)."""
