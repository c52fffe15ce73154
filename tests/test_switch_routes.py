"""Every path to a name under the torch.distributed switch (issue 38).

The set of names is derived, not listed: :func:`mpidtensor.compat.routes.provided` walks
torch's package tree below every aliased path (and the packages above them) and lists each
``(module, name)`` for which user code gets mpidtensor's object. Each must be reached by
the three spellings a program uses: attribute reads from ``import torch``, ``from module
import name``, and ``importlib.import_module(module).name``. And the simplest unmodified
program (it imports only ``torch.distributed.tensor``) runs under ``mpidtensor.run``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

import mpidtensor
from helpers import assert_all_ranks
from mpidtensor.backend import distributed as switch_dist
from mpidtensor.compat import importer, routes, views
from mpidtensor.compat.aliases import ALIASES, NAMES
from subjob import run_command

WORLD = MPI.COMM_WORLD
N = WORLD.size
PROGRAMS = Path(__file__).parent / "programs"


@pytest.fixture
def switched():
    """The import hook and the ``torch.distributed`` overrides for one test."""
    views.override("torch.distributed", switch_dist.OVERRIDES)
    importer.install()
    yield
    importer.uninstall()


def _user(source: str) -> dict:
    """Run ``source`` as user code (a module outside torch and mpidtensor) and return its names."""
    space = {"__name__": "user_program"}
    exec(source, space)
    return space


def _attribute_chain(path: str) -> bool:
    """Whether ``torch.a.b`` reads reach torch's module ``path`` in plain torch (not where a
    package attribute shadows its submodule: ``torch.distributed._composable.fsdp.fully_shard``
    is the function)."""
    parts = path.split(".")
    return all(getattr(sys.modules[".".join(parts[:k])], parts[k], None) is sys.modules[".".join(parts[:k + 1])]
               for k in range(1, len(parts)))


def test_every_provided_name_by_every_spelling(switched):
    found = routes.provided()
    problems = []
    for (path, name), ours in sorted(found.items()):
        spellings = {
            "attribute": f"import {path}\ngot = {path}.{name}",
            "from": f"from {path} import {name} as got",
            "import_module": f"import importlib\ngot = importlib.import_module({path!r}).{name}",
        }
        if not _attribute_chain(path):  # torch's own chain does not reach it either
            del spellings["attribute"]
        for spelling, source in spellings.items():
            try:
                got = _user(source)["got"]
            except Exception as err:  # noqa: BLE001 - reported below
                got = err
            if got is not ours:
                problems.append(f"{spelling} {path}.{name}: {got!r:.120} (want {ours!r:.80})")
    # the names the issue names, and that the set is the tree's, not a hand-made list
    for key in [("torch.distributed", "init_device_mesh"), ("torch.distributed", "DeviceMesh"),
                ("torch.distributed.tensor.parallel.style", "ColwiseParallel"),
                ("torch.distributed.tensor.parallel.api", "parallelize_module"),
                ("torch.distributed.tensor.placement_types", "Shard"),
                ("torch.distributed.tensor._api", "DTensor"),
                ("torch.distributed.fsdp._fully_shard._fully_shard", "fully_shard"),
                ("torch", "save"), ("torch", "load")]:
        if key not in found:
            problems.append(f"{'.'.join(key)} is not among the {len(found)} routed names")
    replaced = {(path, name) for path, name in found if path not in ALIASES and f"{path}.{name}" not in NAMES
                and not getattr(sys.modules[path], name).__module__.startswith(
                    ("torch.distributed", "torch._C._distributed"))}
    if replaced:
        problems.append(f"torch objects replaced from outside torch.distributed: {sorted(replaced)[:5]}")
    assert_all_ranks(not problems, f"{len(problems)} problems over {len(found)} names: " + "; ".join(problems[:20]))


def test_submodules_of_aliases_are_views(switched):
    """``import torch.distributed.tensor.parallel.style`` and ``from ... import style`` give
    the same module; torch's internals below an alias are torch's objects except what is
    replaced, read afresh (a reassigned global is seen)."""
    space = _user("import torch.distributed.tensor.parallel.style as a\n"
                  "from torch.distributed.tensor.parallel import style as b\n"
                  "import importlib\nc = importlib.import_module('torch.distributed.tensor.parallel.style')\n"
                  "import torch.distributed.tensor._random as rnd\n"
                  "from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as f\n")
    real = sys.modules["torch.distributed.tensor._random"]
    before = real._rng_tracker
    real._rng_tracker = marker = object()
    try:
        seen = space["rnd"]._rng_tracker
    finally:
        real._rng_tracker = before
    problems = []
    if not space["a"] is space["b"] is space["c"]:
        problems.append(f"three spellings, three modules: {space['a']}, {space['b']}, {space['c']}")
    if space["a"].ColwiseParallel is not mpidtensor.parallel.ColwiseParallel:
        problems.append("style.ColwiseParallel is torch's")
    if seen is not marker:
        problems.append("a reassigned torch global is stale through the view")
    if space["a"].__name__ != "torch.distributed.tensor.parallel.style":
        problems.append(f"view named {space['a'].__name__}")
    assert_all_ranks(not problems, "; ".join(problems))


def test_torch_keeps_torch_modules_in_sys_modules(switched):
    """Views are made after torch's module is imported (libtorch's dispatcher looks
    ``torch.distributed.tensor`` up in ``sys.modules``) and never replace it."""
    _user("from torch.distributed.tensor.parallel.style import ColwiseParallel\n"
          "import torch.distributed.checkpoint.planner\n")
    names = ["torch.distributed.tensor", "torch.distributed.tensor.parallel.style",
             "torch.distributed.checkpoint.planner"]
    wrong = [n for n in names if n not in sys.modules or type(sys.modules[n]).__name__ != "module"
             or getattr(sys.modules[n], "__alias_of__", None) or "site-packages" not in (sys.modules[n].__file__ or "")]
    assert_all_ranks(not wrong, f"sys.modules holds no torch module for {wrong}")


@pytest.mark.timeout(400)
@pytest.mark.quick_at(2)
def test_six_line_program():
    """The issue's program: it imports only torch.distributed.tensor, distributes a tensor
    and computes ``(x * 2).sum()`` (a ``KeyError: 'torch.distributed.tensor'`` before)."""
    ran = run_command([sys.executable, "-m", "mpidtensor.run", str(PROGRAMS / "six_lines.py")], ranks=N,
                      timeout=300, cwd=PROGRAMS)
    want = f"CHECKSUM {float(torch.arange(12.0).sum() * 2)}"
    assert_all_ranks(ran.returncode == 0 and want in ran.output, ran.output[-3000:])
