"""Fast paths: code that runs on local tensors where the general DTensor dispatch path would
give the same result with more Python per call. Each one is registered in
:mod:`mpidtensor.fast.registry`, decided from the dispatcher's own plans and rules, and
checked against the general path by ``tests/test_fast_paths.py``."""
