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
