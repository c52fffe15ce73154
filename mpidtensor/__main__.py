"""``python -m mpidtensor`` (also under ``mpiexec``/``srun``): the environment report."""
import sys

from .envreport import main

sys.exit(main())
