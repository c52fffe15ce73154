"""``torch.distributed.tensor.experimental`` for mpidtensor: user sharding strategies for
(custom) ops, functions run on local shards, ``implicit_replication`` and context
parallelism (``context_parallel``: the sequence sharded, attention as ring attention)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from ._context_parallel import context_parallel, context_parallel_unshard, set_rotate_method
from .local_map import local_map
from ._register_sharding import register_sharding

__all__ = [
    "context_parallel",
    "context_parallel_unshard",
    "implicit_replication",
    "local_map",
    "register_sharding",
    "set_rotate_method",
]


@contextmanager
def implicit_replication() -> Iterator[None]:
    """Treat plain ``torch.Tensor`` operands of DTensor ops as ``Replicate()`` DTensors.

    mpidtensor always does this (a plain tensor mixed with DTensors is taken as
    replicated on every rank), so the context only marks code ported from torch,
    where it has to be switched on."""
    yield
