"""The arguments that ``save``, ``load`` and ``async_save`` share, checked and resolved
alike: the communicator (``process_group``, ``comm``, ``no_dist``), the storage object
(``checkpoint_id`` / ``storage_writer`` / ``storage_reader``) and the planner."""
from __future__ import annotations

import os
from typing import Any

from mpi4py import MPI

from ..tensor.dtensor import DTensor
from . import tree
from .storage import StorageReader, StorageWriter


def communicator(process_group: MPI.Intracomm | None, comm: MPI.Intracomm | None, no_dist: bool) -> MPI.Intracomm:
    """The communicator a call runs over: ``COMM_SELF`` with ``no_dist``, else the
    ``process_group`` (or its older name ``comm``), else ``COMM_WORLD``."""
    if process_group is not None and comm is not None:
        raise TypeError("pass the communicator as process_group or comm, not both")
    group = process_group if process_group is not None else comm
    if group is not None and not isinstance(group, MPI.Intracomm):
        raise TypeError(f"process_group must be an MPI intracommunicator (e.g. mesh.get_group()), "
                        f"got {type(group).__name__}")
    if no_dist:
        return MPI.COMM_SELF
    return MPI.COMM_WORLD if group is None else group


def storage(checkpoint_id: str | os.PathLike | None, given: Any, default: type, role: str) -> Any:
    """The storage object of a call: ``given`` (its path replaced by ``checkpoint_id``
    when both are given, as torch's ``reset(checkpoint_id)`` does) or ``default(checkpoint_id)``."""
    if given is None:
        if checkpoint_id is None:
            raise ValueError(f"give checkpoint_id (a directory) or storage_{role}")
        return default(checkpoint_id)
    base = StorageWriter if role == "writer" else StorageReader
    if not isinstance(given, base):
        raise TypeError(f"storage_{role} must be a mpidtensor.checkpoint {base.__name__} (NativeWriter, "
                        f"FileSystemWriter, ...), got {type(given).__name__}")
    if checkpoint_id is not None:
        given.path = os.fspath(checkpoint_id)
    return given


def check_planner(planner: Any, kind: str) -> None:
    """Accept no planner, or torch's default planner (a ``DefaultLoadPlanner`` without
    ``allow_partial_load``): the storage classes plan their writes and reads themselves
    (torch's planners rewrite torch's write and read items, which mpidtensor does not have)."""
    if planner is None:
        return
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

    default = DefaultSavePlanner if kind == "save" else DefaultLoadPlanner
    if type(planner) is default and not getattr(planner, "allow_partial_load", False):
        return
    raise ValueError(f"{kind}: planner {type(planner).__name__} is not supported: mpidtensor plans "
                     f"{'writes' if kind == 'save' else 'reads'} itself (each distinct box once, resharding "
                     f"by box intersection); pass planner=None or a default {default.__name__}()")


def refuse_sharded(state_dict: Any) -> None:
    """With ``no_dist`` every process saves alone: its tensors must be whole."""
    for leaf in tree.leaves(state_dict):
        if isinstance(leaf.value, DTensor) and not all(p.is_replicate() for p in leaf.value.placements):
            raise ValueError(f"no_dist=True saves each process's own tensors, but {leaf.fqn!r} is a DTensor "
                             f"with placements {tuple(leaf.value.placements)}; save full tensors (StateDictOptions("
                             "full_state_dict=True)) or save without no_dist")
