"""Sharding rules, one module per op family; importing this package registers them."""
from . import pointwise, registry, tensor_ops  # noqa: F401
