"""Tools around the library: the environment report (``python -m mpidtensor``), nested
launches, memory statistics, and torch.distributed's default group on MPI."""
