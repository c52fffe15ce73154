"""Helpers that mpidtensor's own tests and benchmarks share; not part of the API.

They live in the package so that both ``tests/`` and ``benchmarks/`` import one copy
(``gloo``: torch.distributed over the MPI ranks, to compare with torch's DTensor).
"""
