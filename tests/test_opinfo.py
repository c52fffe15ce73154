"""torch's OpInfo database on DTensors: every op of ``op_db`` that supports float32 on
CPU, with its first sample inputs, run on DTensors and compared with plain torch
(forward, and gradients where the op supports autograd): the values, and the memory layout
of every local output and local gradient (``opinfo_support.layout_mismatch``).

To keep ``make test`` quick each op runs its first sample once per world size, under
one layout that rotates with the op's position ``i`` in ``op_db``: 1 rank ``S0``; 2 and 3
ranks ``S0``/``S-1`` (3: uneven shards); 4 ranks ``S0``/``S-1``/``R``/``P`` on a 1-D mesh
and ``2d`` on the 2x2 mesh (see ``opinfo_support`` for the layouts). One op in
``EXTRA_EVERY`` also runs its next samples (up to ``SAMPLES``; ``OPINFO_SAMPLES``
overrides), sample ``j`` under the layout ``j`` steps further in the rotation; which ops
do rotates with the world size, so that world sizes 1-4 together give every op 3
samples, for half as many cases more at 3 and 4 ranks. 3 and 4 ranks check every op;
1 and 2 ranks, where sharding is least at stake, share the ops out (positions 0, 1 mod
4 at one rank, 2, 3 mod 4 at two). Each layout's ops are split over ``PARTS`` tests.
Ops without a sharding rule run through the replicated fallback here (MPIDTENSOR_STRICT
unset): the sweep's point is that no op gives a wrong value without an error.
``tests/opinfo_all_samples.py`` checks every sample under every layout. The quick tier
(``make test``) checks a fixed, seeded share of these ops per world size (``QUICK_SHARE``).
"""
from __future__ import annotations

import json
import os
import random

import pytest
from mpi4py import MPI

import opinfo_support as S
import tier
from helpers import assert_all_ranks
from mpidtensor import init_device_mesh
from mpidtensor.dispatch import planner
from mpidtensor.runtime.settings import settings

WORLD = MPI.COMM_WORLD

NOT_CHECKED = S.NOT_CHECKED
SAMPLES = int(os.environ.get("OPINFO_SAMPLES", "3"))  # samples of the ops that run more than one
EXTRA_EVERY = 4  # op i runs SAMPLES samples at world size n when (i + 3 n) % EXTRA_EVERY == 0

LAYOUTS = {1: ("S0",), 2: ("S0", "S-1"), 3: ("S0", "S-1"), 4: ("S0", "S-1", "R", "P", "2d")}


SHARE = {1: (0, 1), 2: (2, 3)}  # op positions (mod 4) that 1 and 2 ranks check


PARTS = 4  # each layout's ops in this many tests, so that none runs for minutes (pytest-timeout)

# The quick tier (make test) checks a fixed, seeded share of the ops at each world size,
# a different share per size; make test-all checks all of them.
QUICK_SHARE = {1: 0.2, 2: 0.25, 3: 0.12, 4: 0.1}


def _in_quick_sample(key: str) -> bool:
    return random.Random(f"{key}/{WORLD.size}").random() < QUICK_SHARE[WORLD.size]


def _cases_for(layout: str, part: int) -> list[tuple]:
    """``(op, samples drawn, positions)`` this world size checks under ``layout``: sample ``j`` of
    the op at position ``i`` when ``(i + j)`` modulo the layout count picks ``layout``."""
    layouts = LAYOUTS[WORLD.size]
    k = layouts.index(layout)
    share = SHARE.get(WORLD.size, (0, 1, 2, 3))
    cases = []
    for i, op in enumerate(S.sweep_ops()):
        if i % 4 not in share or (i // 4) % PARTS != part or S.op_key(op) in NOT_CHECKED:
            continue
        if tier.QUICK and not _in_quick_sample(S.op_key(op)):
            continue
        n = SAMPLES if (i + 3 * WORLD.size) % EXTRA_EVERY == 0 else 1
        positions = [j for j in range(n) if (i + j) % len(layouts) == k]
        if positions:
            cases.append((op, n, positions))
    return cases


@pytest.fixture(scope="module")
def meshes():
    mesh1 = init_device_mesh("cpu", (WORLD.size,))
    mesh2 = init_device_mesh("cpu", (2, 2)) if WORLD.size == 4 else None
    return {"1d": mesh1, "2d": mesh2}


@pytest.fixture
def fallback_allowed(monkeypatch):
    monkeypatch.setattr(settings, "strict", False)


_COUNTS: dict[str, dict] = {}


@pytest.mark.every_case  # the quick tier samples the ops instead (QUICK_SHARE)
@pytest.mark.parametrize("part", range(PARTS))
@pytest.mark.parametrize("layout", ["S0", "S-1", "R", "P", "2d"])
def test_opinfo(layout, part, meshes, fallback_allowed):
    if layout not in LAYOUTS[WORLD.size]:
        pytest.skip(f"layout {layout} runs at {[n for n, ls in LAYOUTS.items() if layout in ls]} ranks")
    mesh = meshes["2d" if layout == "2d" else "1d"]
    failures, via_fallback, checked = [], [], 0
    cases = _cases_for(layout, part)
    for op, n, positions in cases:
        key = S.op_key(op)
        warned = len(planner._WARNED)
        drawn = S.samples(key, n)
        for j in (j for j in positions if j < len(drawn)):
            sample, ref_out, ref_grads = drawn[j]
            checked += 1
            message = S.agreed(S.run_case(op, key, sample, ref_out, ref_grads, mesh, layout))
            if message:
                failures.append(f"{key} (sample {j}): {message[:500]}")
                break
        if len(planner._WARNED) > warned:
            via_fallback.append(key)
    counts = _COUNTS.setdefault(layout, dict(ops=0, samples=0, failed=0, fallback=0))
    for name, value in (("ops", len(cases)), ("samples", checked), ("failed", len(failures)),
                        ("fallback", len(via_fallback))):
        counts[name] += value
    report = os.environ.get("OPINFO_REPORT")
    if report and WORLD.rank == 0:
        with open(f"{report}.{WORLD.size}.json", "w") as f:
            json.dump(dict(_COUNTS, not_checked=len(NOT_CHECKED), fallback_aten=sorted(map(str, planner._WARNED))), f)
    assert_all_ranks(not failures, f"{len(failures)} ops differ from torch:\n" + "\n".join(failures))


def test_not_checked_list_names_real_ops():
    """Every entry of NOT_CHECKED names an op of the sweep (the list cannot go stale silently)."""
    keys = {S.op_key(op) for op in S.sweep_ops()}
    stale = sorted(set(NOT_CHECKED) - keys)
    assert_all_ranks(not stale, f"not in op_db: {stale}")


def test_random_ops_are_layout_invariant(meshes, fallback_allowed):
    """The random ops, whatever their rotation slot: same global values under Shard(0) and Replicate."""
    if WORLD.size == 1:
        pytest.skip("one rank gives one layout")
    failures = []
    for op in S.sweep_ops():
        key = S.op_key(op)
        if key not in S.RANDOM or key in NOT_CHECKED:
            continue
        for sample, ref_out, ref_grads in S.samples(key, 1):
            message = S.agreed(S.run_case(op, key, sample, ref_out, ref_grads, meshes["1d"], "S0"))
            if message:
                failures.append(f"{key}: {message}")
    assert_all_ranks(not failures, "\n".join(failures))
