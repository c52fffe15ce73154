"""The torch.distributed switch, one explicit process-wide effect: after
:func:`install_torch_distributed` (or under ``python -m mpidtensor.run``) an unmodified
torch.distributed program runs on mpidtensor (docs/unchanged-programs.md)."""
from __future__ import annotations

from ..runtime import effects
from ..backend import cpp_groups, distributed, process_group, rendezvous
from . import importer, views

__all__ = ["EFFECT", "install_torch_distributed"]

EFFECT = "torch.distributed switch"


@effects.effect(EFFECT, "explicit",
                "user code's imports of torch.distributed.tensor, .device_mesh, .fsdp, .checkpoint (and the "
                "older paths) give mpidtensor's modules, torch's own code keeping torch's (builtins.__import__ "
                "and importlib.import_module wrapped); torch.save/torch.load write DTensors in torch's format and read "
                "it back as mpidtensor's; torch.distributed's default group is the MPI backend; "
                "RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT set from MPI")
def _install() -> None:
    rendezvous.export_launcher_environment()
    process_group.init_process_group()
    views.override("torch.distributed", distributed.OVERRIDES)
    views.override("torch.distributed._composable", cpp_groups.COMPOSABLE_OVERRIDES)
    importer.install()


def install_torch_distributed() -> None:
    """Make this process run torch.distributed programs on mpidtensor: user code importing
    ``torch.distributed.tensor``, ``.device_mesh``, ``.fsdp``, ``.checkpoint`` (and
    ``torch.distributed._tensor``, ``torch.distributed._composable.fsdp``) gets mpidtensor's
    modules, ``dist.init_process_group`` (any backend) the MPI-backed default group (made
    now), and the launcher variables are set from MPI. Collective over ``MPI.COMM_WORLD``;
    once per process (later calls do nothing)."""
    effects.install(EFFECT)
