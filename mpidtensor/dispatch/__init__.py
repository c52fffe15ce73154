"""``__torch_dispatch__`` for DTensor: plan once per op signature, then run.

- :mod:`.key`: the entry point, :func:`dispatch`: the call's cache key and the plan cache;
- :mod:`.planner`: a new signature's plan: output metadata from meta tensors, the op's
  sharding rule (:mod:`mpidtensor.ops`), torch's decomposition, the replicated fallback;
- :mod:`.kinds`: the plan kinds: the general :class:`~.kinds.Plan` and two registered
  fast paths, :class:`~.kinds.LocalPlan` (moves nothing) and :class:`~.kinds.PerMeshPlan`;
- :mod:`.writeback`: in-place and out= results written back, views that cannot alias;
- :mod:`.args`: the call's tensors, specs and converters to local tensors.

Importing this package installs :func:`dispatch` as ``DTensor``'s dispatcher (as torch
sets ``DTensor._op_dispatcher``); ``mpidtensor`` imports it with ``DTensor``.
"""
from ..dtensor import DTensor
from .key import clear_cache, dispatch, moves_nothing, plan_for

DTensor._op_dispatch = staticmethod(dispatch)

__all__ = ["dispatch", "clear_cache", "plan_for", "moves_nothing"]
