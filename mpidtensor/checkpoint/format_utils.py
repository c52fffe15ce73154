"""``torch.distributed.checkpoint.format_utils``'s functions and command line:

    python -m mpidtensor.checkpoint.format_utils {dcp_to_torch,torch_to_dcp} SRC DST

``dcp_to_torch_save(dir, file)`` writes a native or torch DCP checkpoint whole with
``torch.save``; ``torch_save_to_dcp(file, dir)`` makes a native checkpoint of a
``torch.save`` file (both in :mod:`.plain`). One process, the whole state in memory.
"""
from __future__ import annotations

import argparse
import os
import sys

from .plain import dcp_to_torch_save, torch_save_to_dcp

__all__ = ["dcp_to_torch_save", "torch_save_to_dcp"]


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
