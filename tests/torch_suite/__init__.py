"""torch's own DTensor test files as a conformance tier (docs/torch-conformance.md).

- :mod:`.worker`: one MPI job, every rank running the same ordered tests of one file;
- :mod:`.routing`: torch's test helpers loaded so that, under the switch, they see mpidtensor;
- :mod:`.driver`: plans a file, runs its classes at their world sizes, watches for hangs;
- :mod:`.compare`: torch's recorded outcomes, the documented differences, the report;
- ``python -m torch_suite expect|check|draft``: the make targets' entry point.
"""
