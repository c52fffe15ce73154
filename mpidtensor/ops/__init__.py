"""Sharding rules, one module per op family; importing this package registers them."""
from . import (  # noqa: F401
    advanced_indexing,
    gather_scatter,
    histogram,
    losses,
    matrix,
    nn,
    pointwise,
    random,
    reductions,
    registry,
    sorting,
    tensor_ops,
    reshape,
    views,
)
