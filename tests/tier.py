"""The test tier, from ``MPIDTENSOR_TEST_TIER``: ``quick`` (``make test``) runs every module
with the exhaustive sweeps sampled; ``all`` (``make test-all``, and the default for a
bare ``pytest``) runs everything."""
from __future__ import annotations

import os

TIERS = ("quick", "all")
TIER = os.environ.get("MPIDTENSOR_TEST_TIER", "all")
QUICK = TIER == "quick"


def count(full: int, quick: int) -> int:
    """How many examples a sweep draws in this tier."""
    return quick if QUICK else full
