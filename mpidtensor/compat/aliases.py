"""The switch's rows: a torch module path and the mpidtensor module that user code gets in
its place (:data:`ALIASES`), and the few torch functions below a row replaced by name
(:data:`NAMES`); :mod:`.routes` derives everything else from them
(docs/unchanged-programs.md).

A plain data table; rows may be added by anyone. A row whose mpidtensor module does not
import (``mpidtensor.pipelining`` before it exists) leaves user code with torch's module.
Paths under a row that have no row of their own (``torch.distributed.tensor._utils``)
resolve to torch's module.
"""
from __future__ import annotations

ALIASES: dict[str, str] = {
    # DTensor and its submodules
    "torch.distributed.tensor": "mpidtensor",
    "torch.distributed.tensor.parallel": "mpidtensor.parallel",
    "torch.distributed.tensor.experimental": "mpidtensor.experimental",
    "torch.distributed.tensor.experimental._attention": "mpidtensor.experimental._attention",
    "torch.distributed.tensor.experimental._context_parallel": "mpidtensor.experimental._context_parallel",
    "torch.distributed.tensor.experimental._context_parallel._attention":
        "mpidtensor.experimental._context_parallel._attention",
    "torch.distributed.tensor.placement_types": "mpidtensor.tensor.placements",
    "torch.distributed.tensor.debug": "mpidtensor.debug",
    "torch.distributed.tensor.device_mesh": "mpidtensor.mesh.device_mesh",
    "torch.distributed.device_mesh": "mpidtensor.mesh.device_mesh",
    # functional collectives over mpidtensor's meshes and communicators
    "torch.distributed._functional_collectives": "mpidtensor.backend.funcol",
    # FSDP2
    "torch.distributed.fsdp": "mpidtensor.fsdp",
    # distributed checkpoints
    "torch.distributed.checkpoint": "mpidtensor.checkpoint",
    "torch.distributed.checkpoint.state_dict": "mpidtensor.checkpoint.state_dict",
    "torch.distributed.checkpoint.stateful": "mpidtensor.checkpoint.stateful",
    "torch.distributed.checkpoint.filesystem": "mpidtensor.checkpoint.filesystem",
    "torch.distributed.checkpoint.hf_storage": "mpidtensor.checkpoint.hf_storage",
    "torch.distributed.checkpoint.format_utils": "mpidtensor.checkpoint.format_utils",
    "torch.distributed.checkpoint.metadata": "mpidtensor.checkpoint.metadata",
    "torch.distributed.checkpoint.storage": "mpidtensor.checkpoint.storage",
    # older paths
    "torch.distributed._tensor": "mpidtensor",
    "torch.distributed._tensor.device_mesh": "mpidtensor.mesh.device_mesh",
    "torch.distributed._tensor.placement_types": "mpidtensor.tensor.placements",
    "torch.distributed._composable.fsdp": "mpidtensor.fsdp",
    # pipeline parallelism (aliased once mpidtensor.pipelining imports)
    "torch.distributed.pipelining": "mpidtensor.pipelining",
    "torch.distributed.pipelining.schedules": "mpidtensor.pipelining",
    "torch.distributed.pipelining.stage": "mpidtensor.pipelining.stage",
    "torch.distributed.pipelining.microbatch": "mpidtensor.pipelining.microbatch",
}

# torch functions below a row (or at a package above one) that user code gets as mpidtensor's
# (torch path -> mpidtensor path), where torch's own would read mpidtensor's objects wrongly:
# torch's compute_local_shape_and_global_offset tests `isinstance(p, Shard)` against torch's
# class and so skips mpidtensor's placements (a full shape, no error); torch.save would write
# mpidtensor's classes (a file plain torch cannot load) and torch.load would give torch's
# DTensor for a file in torch's format.
NAMES: dict[str, str] = {
    "torch.save": "mpidtensor.compat.serialization.save",
    "torch.load": "mpidtensor.compat.serialization.load",
    "torch.distributed.tensor._utils.compute_local_shape_and_global_offset":
        "mpidtensor.compat.torch_utils.compute_local_shape_and_global_offset",
    "torch.distributed.tensor._utils._compute_local_shape_and_global_offset":
        "mpidtensor.compat.torch_utils._compute_local_shape_and_global_offset",
    "torch.distributed.tensor._utils.compute_global_tensor_shape":
        "mpidtensor.compat.torch_utils.compute_global_tensor_shape",
    "torch.distributed.tensor._api._shard_tensor": "mpidtensor.tensor.api._shard_tensor",
    "torch.distributed.tensor._collective_utils.shard_dim_alltoall":
        "mpidtensor.compat.torch_utils.shard_dim_alltoall",
    "torch.distributed.checkpoint.state_dict_loader._load_state_dict":
        "mpidtensor.checkpoint.format_utils._load_state_dict",
}

# torch objects below a row that mpidtensor lacks and the switch gives as torch's own instead of
# a stand-in (by the path they are defined at; "Class.attribute" keeps one attribute of a class
# that is otherwise a stand-in): an enum, FSDP1's static re-keying of a full optimizer state
# dict between parameter names and ids, a pure function of the dict and the module's parameters
# that runs no collective (Lightning's Trainer calls it to save a full checkpoint), and
# ``_init_optim_state``, one optimizer step with zero gradients and a learning rate of 0 on
# each rank's own parameters (torchtune 0.6.1 calls it before loading a full optimizer state).
TORCH_KEPT: frozenset[str] = frozenset({
    "torch.distributed.fsdp.fully_sharded_data_parallel.OptimStateKeyType",
    "torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel.rekey_optim_state_dict",
    "torch.distributed.checkpoint.state_dict._init_optim_state",
})
