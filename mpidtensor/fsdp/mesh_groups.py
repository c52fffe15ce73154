"""One ``fully_shard`` call's parameters on several data-parallel meshes.

torch 2.13's ``shard_placement_fn`` may return a ``ShardPlacementResult(placement,
mesh_info)``: that parameter is sharded over ``mesh_info.mesh`` instead of the call's
mesh (torchtitan shards routed experts over its ``efsdp`` mesh, the rest of an MoE block
over ``fsdp``). Each mesh gets its own ``ParamGroup`` (own all-gather and reduce-scatter,
over its own communicator); :class:`ParamGroups` drives them together as the module's one
group: the hooks of ``state.FSDPState`` and the settings of ``module.FSDPModule`` reach
every part, in the order the parts were made (the same on every rank).
"""
from __future__ import annotations

from .group import SHARDED, UNSHARDED, ParamGroup

# settings the FSDPModule methods and hooks write and read: written to every part, read
# from the first (they are only ever written to all parts alike)
_SETTINGS = frozenset({
    "reshard_after_forward", "reshard_after_backward", "post_forward_comm", "requires_gradient_sync",
    "requires_all_reduce", "unshard_in_backward", "gradient_divide_factor", "force_sum_reduction",
    "all_reduce_hook", "custom_all_gather", "custom_reduce_scatter", "reduce_scatter_unused_params",
    "reduce_scatter_max_input_buffers", "allocate_from_process_group", "symm_mem_backend",
})


class ParamGroups:
    """Several ``ParamGroup`` (one per mesh) that act as one module's group."""

    def __init__(self, parts: list[ParamGroup]) -> None:
        object.__setattr__(self, "parts", parts)

    def __getattr__(self, name: str):
        if name in _SETTINGS:
            return getattr(self.parts[0], name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        if name not in _SETTINGS:
            raise AttributeError(f"{type(self).__name__}: cannot set {name!r}")
        for part in self.parts:
            setattr(part, name, value)

    @property
    def params(self) -> list:
        return [p for part in self.parts for p in part.params]

    @property
    def sharded_state(self):
        """``UNSHARDED`` when every part is, ``SHARDED`` when every part is, else the first
        part's other state (a part is between the two)."""
        states = {part.sharded_state for part in self.parts}
        if len(states) == 1:
            return states.pop()
        return next(s for s in (part.sharded_state for part in self.parts) if s not in (SHARDED, UNSHARDED))

    @property
    def reducing(self) -> bool:
        return any(part.reducing for part in self.parts)

    @property
    def holds_grads(self) -> bool:
        return any(part.holds_grads for part in self.parts)

    @property
    def has_pending_grads(self) -> bool:
        return any(part.has_pending_grads for part in self.parts)

    def start_unshard(self) -> None:
        for part in self.parts:
            part.start_unshard()

    def finish_unshard(self) -> None:
        for part in self.parts:
            part.finish_unshard()

    def reshard_post_forward(self) -> None:
        for part in self.parts:
            part.reshard_post_forward()

    def reshard(self) -> None:
        for part in self.parts:
            part.reshard()

    def post_backward(self) -> None:
        for part in self.parts:
            part.post_backward()

    def finish_reduce(self) -> None:
        for part in self.parts:
            if part.reducing:
                part.finish_reduce()

    def reset(self) -> None:
        for part in self.parts:
            part.reset()

    def use_separate_reduce_scatter(self, enable: bool) -> None:
        for part in self.parts:
            part.use_separate_reduce_scatter(enable)

    def sync(self) -> None:
        for part in self.parts:
            part.sync()
