"""``__torch_dispatch__`` for DTensor: plan once per op signature, then run.

- :mod:`.key`: the entry point, :func:`dispatch`: the call's cache key and the plan cache;
- :mod:`.planner`: a new signature's plan: output metadata from meta tensors, the op's
  sharding rule (:mod:`mpidtensor.ops`), torch's decomposition, the replicated fallback;
- :mod:`.kinds`: the plan kinds: the general :class:`~.kinds.Plan` and two registered
  fast paths, :class:`~.kinds.LocalPlan` (moves nothing) and :class:`~.kinds.PerMeshPlan`;
- :mod:`.writeback`: in-place and out= results written back, views that cannot alias;
- :mod:`.args`: the call's tensors, specs and converters to local tensors.

Importing this package makes :func:`dispatch` ``DTensor.__torch_dispatch__`` (as torch
sets ``DTensor._op_dispatcher``; a method set here, not an attribute looked up per call,
which cost 0.1 µs of a DTensor add's 8); ``mpidtensor`` imports it with ``DTensor``.
"""
from ..tensor.dtensor import DTensor
from .key import dispatch, moves_nothing, plan_for, torch_dispatch

DTensor.__torch_dispatch__ = classmethod(torch_dispatch)

__all__ = ["dispatch", "plan_for", "moves_nothing"]
