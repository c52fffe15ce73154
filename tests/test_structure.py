"""``tools/check_structure.py``: no module over 600 lines, nothing installed in Python or
torch by ``import mpidtensor`` (each effect of the first mesh is one ``runtime.effects``
lists as installed); import cycles and suffix-named module pairs are printed, and asserted
once ``ENFORCE_CYCLES_AND_NAMES`` is switched on."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from mpi4py import MPI

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import check_structure  # noqa: E402

ENFORCE_CYCLES_AND_NAMES = True

pytestmark = [
    pytest.mark.quick_at(1),
    pytest.mark.skipif(MPI.COMM_WORLD.size != 1, reason="one process checks the tree (and starts a probe)"),
]

# What each observed change is: a word its effect's name or description names.
EXPLAINED_BY = {
    "sys.excepthook": "sys.excepthook",
    "sys.meta_path": "sys.meta_path",
    "torch.Tensor attributes": "Tensor.to_dtensor",
    "optimizer step hooks": "optimizer step",
    "foreach types": "foreach type",
    "aten::tensor_split kernel": "tensor_split",
    "threads": "thread",
    "torch.load safe globals": "add_safe_globals",
    "torch.ops.mpidtensor": "torch.ops.mpidtensor",
}


@pytest.fixture(scope="module")
def result() -> dict:
    found = check_structure.check(ROOT)
    print(check_structure.render(found))
    return found


def test_no_module_over_600_lines(result):
    assert not result["long modules"], check_structure.render(result)


def test_import_changes_nothing_and_the_first_mesh_installs_what_effects_lists(result):
    effects = result["effects"]
    assert effects["import"] == [] and effects["installed at import"] == [], check_structure.render(result)
    described = {name: f"{name}: {what}" for name, _, what, _ in effects["described"]}
    installed = [described[name] for name in effects["installed"]]
    for change in effects["first mesh"]:
        word = EXPLAINED_BY[change]
        assert any(word in text for text in installed), f"{change} changed, but no installed effect says {word!r}"
    for change, word in EXPLAINED_BY.items():
        claimed = any(word in text for text in installed)
        if change == "sys.meta_path" and effects["dynamo loaded"]:
            continue  # Dynamo was loaded already: the graph breaks were set without a hook
        assert claimed == (change in effects["first mesh"]), (
            f"{change}: an installed effect says {word!r}: {claimed}; observed: {effects['first mesh']}")


def test_import_cycles_and_suffix_names(result):
    findings = result["import cycles"] + result["suffix pairs"]
    if findings and not ENFORCE_CYCLES_AND_NAMES:
        pytest.skip(f"not enforced yet: {findings}")
    assert not findings, check_structure.render(result)


def test_every_wait_goes_through_the_watchdog(result):
    """No MPI Wait/Waitall/Waitany outside runtime/watchdog.py: a rank stuck there would not report."""
    assert not result["unwatched waits"], check_structure.render(result)
def test_every_cache_is_owned(result):
    assert not result["unowned caches"], check_structure.render(result)


def test_no_docstring_names_a_missing_module(result):
    assert not result["dangling references"], check_structure.render(result)


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        path = tmp_path / "mpidtensor" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return check_structure.modules(tmp_path)


def test_cache_rule_on_a_small_tree(tmp_path):
    """An unregistered functools cache and memo dict are reported; registered, exempt, or a
    registry filled elsewhere, they are not."""
    found = _tree(tmp_path, {
        "__init__.py": "",
        "a.py": ("from functools import cache, lru_cache\nfrom .runtime import caches\n\n"
                 "@cache\ndef loose(x):\n    return x\n\n"
                 "@lru_cache(maxsize=8)\ndef owned(x):\n    return x\n\n"
                 "@cache  # not cleared: fixed for the process\ndef constant():\n    return 1\n\n"
                 "caches.on_clear('owned', owned.cache_clear)\n"),
        "b.py": ("_MEMO = {}\n_TABLE = {}\n_REGISTRY = {}\n\n"
                 "def memo(k):\n    v = _MEMO.get(k)\n    if v is None:\n        v = _MEMO[k] = k * 2\n    return v\n\n"
                 "def table(k):\n    if k not in _TABLE:\n        _TABLE[k] = k\n    return _TABLE[k]\n\n"
                 "def register(k, v):\n    _REGISTRY[k] = v\n\n"
                 "def _forget():\n    _TABLE.clear()\n\n"
                 "from .runtime import caches\ncaches.on_clear('table', _forget)\n"),
    })
    found_caches = check_structure.unowned_caches(found, tmp_path)
    assert found_caches == ["mpidtensor/a.py:5 loose (functools cache)",
                            "mpidtensor/b.py:1 _MEMO (module-level dict filled as a memo)"], found_caches


def test_reference_rule_on_a_small_tree(tmp_path):
    """Roles, literals and absolute names that name a missing module (or a name a module does
    not bind) are reported with their line; attributes of variables are not references."""
    found = _tree(tmp_path, {
        "__init__.py": "from .mesh.core import Mesh\n",
        "mesh/__init__.py": "",
        "mesh/core.py": "class Mesh:\n    pass\n",
        "comm/__init__.py": "",
        "comm/pool.py": ('"""Buffers, see :mod:`.missing` and :mod:`..mesh.core`,\n'
                         ':class:`mesh.core.Mesh`, ``mesh.pool`` (gone) and ``mesh.size()``,\n'
                         '``tensor.shape`` and mpidtensor.Mesh; mpidtensor.mesh.gone.f."""\n'
                         "# comm.pool is here; ``comm.pool.nothing()`` is not\n"),
    })
    refs = check_structure.dangling_references(found, tmp_path)
    assert refs == ["mpidtensor/comm/pool.py:1 mpidtensor.comm.missing",
                    "mpidtensor/comm/pool.py:2 mpidtensor.mesh.pool",
                    "mpidtensor/comm/pool.py:3 mpidtensor.mesh.gone.f",
                    "mpidtensor/comm/pool.py:4 mpidtensor.comm.pool.nothing"], refs
