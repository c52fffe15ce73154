"""Tools around the library: the environment report (``python -m mpidtensor``), nested
launches and memory statistics (torch.distributed on MPI is :mod:`mpidtensor.backend`)."""
