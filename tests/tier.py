"""The test tier, from ``MPIDTENSOR_TEST_TIER``: ``quick`` (``make test``) runs every module
with the exhaustive sweeps sampled; ``all`` (``make test-all``, and the default for a
bare ``pytest``) runs everything."""
from __future__ import annotations

import os
import zlib
from collections import defaultdict

TIERS = ("quick", "all")
TIER = os.environ.get("MPIDTENSOR_TEST_TIER", "all")
QUICK = TIER == "quick"


def count(full: int, quick: int) -> int:
    """How many examples a sweep draws in this tier."""
    return quick if QUICK else full


# A test function with more parametrized cases than this runs this many of them (at
# least) in the quick tier, or QUICK_SHARE of them if that is more.
QUICK_CASES = 4
QUICK_SHARE = 0.25


def sample(items: list, world_size: int) -> list:
    """The items the quick tier runs: every item of a test function with few cases (or
    marked ``every_case``); of one with many, a fixed share chosen by a hash of the test id and the world size
    (CRC-32: the same on every rank and every run, different per world size)."""
    by_function = defaultdict(list)
    for item in items:
        if "every_case" in item.keywords:
            by_function[item.nodeid].append(item)  # a group of one: kept
        else:
            by_function[(item.fspath, getattr(item, "originalname", item.name))].append(item)
    chosen = set()
    for group in by_function.values():
        if len(group) <= QUICK_CASES:
            chosen.update(map(id, group))
            continue
        keep = max(QUICK_CASES, round(QUICK_SHARE * len(group)))
        ranked = sorted(group, key=lambda item: zlib.crc32(f"{item.nodeid}/{world_size}".encode()))
        chosen.update(map(id, ranked[:keep]))
    return [item for item in items if id(item) in chosen]
