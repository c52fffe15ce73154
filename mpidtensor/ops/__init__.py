"""Sharding rules, one module per op family; importing this package registers them."""
from . import indexing, losses, matrix, nn, pointwise, random, reductions, registry, tensor_ops, views  # noqa: F401
