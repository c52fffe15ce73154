"""``python -m mpidtensor`` (also under ``mpiexec``/``srun``): the environment report."""
import sys

from .tools.envreport import main

sys.exit(main())
