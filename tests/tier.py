"""The test tier, from ``MPIDTENSOR_TEST_TIER``: ``quick`` (``make test``) runs every module
with the exhaustive sweeps sampled; ``all`` (``make test-all``, and the default for a
bare ``pytest``) runs everything."""
from __future__ import annotations

import os
import re
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
QUICK_CASES = 3
QUICK_SHARE = 0.15

# At 4 ranks (2 per core here) a test costs about 3x what it costs at 3 ranks, and what
# only 4 ranks can check is the 2x2 mesh: the quick tier keeps there the tests of a 2-D
# mesh and OVERSUBSCRIBED_SHARE of the others of each module (at least one).
OVERSUBSCRIBED_SIZE = 4
OVERSUBSCRIBED_SHARE = 0.1
TWO_D = re.compile(r"2d|2x2|hsdp", re.IGNORECASE)


def _rank(items: list, world_size: int) -> list:
    """``items`` in a fixed order, by CRC-32 of the test id and the world size (the same
    on every rank and every run, different per world size)."""
    return sorted(items, key=lambda item: zlib.crc32(f"{item.nodeid}/{world_size}".encode()))


def sample(items: list, world_size: int) -> list:
    """The items the quick tier runs: every item of a test function with few cases (or
    marked ``every_case``); of one with many, a fixed share chosen by ``_rank``; at
    ``OVERSUBSCRIBED_SIZE`` ranks, of those, the 2-D mesh tests and a share per module."""
    by_function = defaultdict(list)
    for item in items:
        if "every_case" in item.keywords:
            by_function[item.nodeid].append(item)  # a group of one: kept
        else:
            by_function[(item.fspath, getattr(item, "originalname", item.name))].append(item)
    chosen = set()
    for group in by_function.values():
        keep = len(group) if len(group) <= QUICK_CASES else max(QUICK_CASES, round(QUICK_SHARE * len(group)))
        chosen.update(map(id, _rank(group, world_size)[:keep]))
    if world_size == OVERSUBSCRIBED_SIZE:
        chosen = _two_d_and_a_share(items, chosen, world_size)
    return [item for item in items if id(item) in chosen]


def _two_d_and_a_share(items: list, chosen: set, world_size: int) -> set:
    by_module = defaultdict(list)
    kept = set()
    for item in items:
        if id(item) not in chosen:
            continue
        if "mesh2d" in getattr(item, "fixturenames", ()) or TWO_D.search(item.nodeid):
            kept.add(id(item))
        else:
            by_module[item.fspath].append(item)
    for group in by_module.values():
        kept.update(map(id, _rank(group, world_size)[:max(1, round(OVERSUBSCRIBED_SHARE * len(group)))]))
    return kept
