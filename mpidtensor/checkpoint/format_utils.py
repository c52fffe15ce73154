"""``torch.distributed.checkpoint.format_utils``'s functions and command line:

    python -m mpidtensor.checkpoint.format_utils {dcp_to_torch,torch_to_dcp} SRC DST

``dcp_to_torch_save(dir, file)`` writes a native or torch DCP checkpoint whole with
``torch.save``; ``torch_save_to_dcp(file, dir)`` makes a native checkpoint of a
``torch.save`` file (both in :mod:`.plain`). One process, the whole state in memory.

``_load_state_dict(sd, reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)`` is
torch's private way to read a whole checkpoint into an empty dict (its own
``dcp_to_torch_save`` and Lightning's ``consolidate_checkpoint`` use it): here it reads the
checkpoint at the reader's path whole, in its own format (native or torch DCP), without
communicating; with any other planner it is :func:`.api.load`.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from mpi4py import MPI

from .api import load
from .plain import dcp_to_torch_save, read_whole, torch_save_to_dcp
from .storage import StorageReader

__all__ = ["dcp_to_torch_save", "torch_save_to_dcp"]


class _EmptyStateDictLoadPlanner:
    """torch's planner that loads everything a checkpoint holds into an empty state dict;
    here the marker that makes :func:`_load_state_dict` read the checkpoint whole.
    ``keys`` (torch's filter of what to load) is not supported."""

    def __init__(self, keys: set | None = None, *args: Any, **kwargs: Any) -> None:
        if keys is not None:
            raise NotImplementedError("_EmptyStateDictLoadPlanner(keys=...) is not supported by mpidtensor: "
                                      "read the whole checkpoint and take the keys from it")
        self.keys = keys


def _load_state_dict(state_dict: dict, storage_reader: StorageReader, process_group: MPI.Intracomm | None = None,
                     coordinator_rank: int = 0, no_dist: bool = False, planner: Any = None) -> None:
    """torch.distributed.checkpoint.state_dict_loader._load_state_dict: with an
    :class:`_EmptyStateDictLoadPlanner`, fill the empty ``state_dict`` with the whole
    checkpoint at ``storage_reader.path`` (plain tensors, nested as saved; each calling
    process alone); otherwise :func:`.api.load` (``coordinator_rank`` is unused there)."""
    if isinstance(planner, _EmptyStateDictLoadPlanner):
        if state_dict:
            raise ValueError("_EmptyStateDictLoadPlanner loads into an empty state dict")
        state_dict.update(read_whole(storage_reader.path))
        return
    load(state_dict, storage_reader=storage_reader, planner=planner, process_group=process_group, no_dist=no_dist)


def main(argv: list[str] | None = None) -> int:
    """The command line (``argv``: its arguments); the exit status."""
    parser = argparse.ArgumentParser(prog="python -m mpidtensor.checkpoint.format_utils",
                                     description="Convert between checkpoints and torch.save files.")
    parser.add_argument("mode", choices=["dcp_to_torch", "torch_to_dcp"], help="conversion direction")
    parser.add_argument("src", help="the checkpoint directory (dcp_to_torch) or torch.save file (torch_to_dcp)")
    parser.add_argument("dst", help="the torch.save file (dcp_to_torch) or checkpoint directory (torch_to_dcp)")
    args = parser.parse_args(argv)
    try:
        if args.mode == "dcp_to_torch":
            dcp_to_torch_save(args.src, args.dst)
        else:
            if not os.path.isfile(args.src):
                raise FileNotFoundError(f"no torch.save file at {args.src!r}")
            torch_save_to_dcp(args.src, args.dst)
    except (OSError, ValueError, TypeError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 1
    print(f"converted {args.src} to {args.dst} ({args.mode})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
