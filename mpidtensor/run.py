"""``python -m mpidtensor.run script.py ARGS`` (or ``-m package.module ARGS``), under
``mpiexec`` or ``srun``: run an unmodified torch.distributed program on mpidtensor.

The switch (:func:`mpidtensor.install_torch_distributed`) is installed first, then the
program runs as ``__main__`` with ``sys.argv`` as it would under ``python script.py ARGS``
(the script's directory first on ``sys.path``; for ``-m``, the current directory).
"""
from __future__ import annotations

import os
import runpy
import sys

from .compat.switch import install_torch_distributed

USAGE = "usage: python -m mpidtensor.run script.py [args...] | -m module [args...]"


def main(argv: list[str] | None = None) -> None:
    """Install the switch and run the program that ``argv`` (``sys.argv[1:]``) names."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or (args[0] == "-m" and len(args) < 2):
        raise SystemExit(USAGE)
    install_torch_distributed()
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]  # runpy puts the module's file in argv[0]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
