"""Structure checks of the mpidtensor package, run from the project root:

    python tools/check_structure.py [--json]

(a) modules over ``MAX_LINES`` lines; (b) import cycles at module level among mpidtensor
modules (imports inside functions, and under ``if TYPE_CHECKING:``, excluded; relative
and absolute imports resolved); (c) the process-wide effects of ``import mpidtensor``
(Python's and torch's hooks and tables compared before and after the import, in a fresh
single-rank process) and of building a first, one-rank mesh, beside what
``mpidtensor.runtime.effects`` says it installed; (d) pairs of module names that differ
only by a suffix (``format`` / ``format_utils``, ``traced`` / ``tracing``).

The exit status is 1 if (a) finds a module or (c) finds an effect of the import itself;
``--strict`` makes (b) and (d) count too. ``--json`` prints the findings as JSON.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
from itertools import combinations
from pathlib import Path

MAX_LINES = 600
PACKAGE = "mpidtensor"


# --- (a) sizes ---------------------------------------------------------------------------------
def modules(root: Path) -> dict[str, Path]:
    """Every module of the package under ``root``, by dotted name (a package by its own name)."""
    found = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def long_modules(found: dict[str, Path], root: Path, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    """(module path from ``root``, lines) of every module over ``limit`` lines, longest first."""
    sizes = [(path.relative_to(root).as_posix(), len(path.read_text().splitlines())) for path in found.values()]
    return sorted(((p, n) for p, n in sizes if n > limit), key=lambda item: -item[1])


# --- (b) import cycles -------------------------------------------------------------------------
def _top_level_imports(tree: ast.Module):
    """Import nodes that run when the module is imported: not inside a function, nor under
    ``if TYPE_CHECKING:``."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
        else:
            stack.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt))


def import_graph(found: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports at module level."""
    graph: dict[str, set[str]] = {}
    for name, path in found.items():
        is_package = path.name == "__init__.py"
        here = name.split(".") if is_package else name.split(".")[:-1]
        edges = graph[name] = set()
        for node in _top_level_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = here[:len(here) - node.level + 1] if node.level else []
                module = ".".join(base + (node.module.split(".") if node.module else []))
                targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in found else module
                           for alias in node.names]
            for target in targets:
                while target and target not in found:  # `import a.b.c` where c is a name
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path back to its start) per strongly connected group of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm, iterative over each node's edges
        work = [(v, iter(sorted(graph.get(v, ()))))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, edges = work[-1]
            for w in edges:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        group.append(w)
                        if w == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(group, graph) for group in sorted(groups)]


def _cycle_in(group: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for w in sorted(graph[node] & members):
                if w == start:
                    return paths[node] + [start]
                if w not in paths:
                    paths[w] = paths[node] + [w]
                    nxt.append(w)
        frontier = nxt
    return group


# --- (c) process-wide effects ------------------------------------------------------------------
_PROBE = r"""
import json, sys, threading
import torch, torch.utils._foreach_utils
import torch.optim.optimizer as opt

def state():
    mpi = sys.modules.get("mpi4py.MPI")  # not imported before mpidtensor is: its import is observed
    return {
        "MPI initialized": mpi is not None and mpi.Is_initialized(),
        "torch.ops.mpidtensor": sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("mpidtensor::")),
        "sys.excepthook": repr(sys.excepthook),
        # mpi4py's own finder (mpi4py._mpiabi) comes with importing mpi4py: part of the declared MPI start-up
        "sys.meta_path": [repr(f) for f in sys.meta_path
                          if not getattr(f, "__module__", type(f).__module__).startswith("mpi4py")],
        "torch.Tensor attributes": sorted(torch.Tensor.__dict__),
        "optimizer step hooks": [sorted(map(str, opt._global_optimizer_pre_hooks)),
                                 sorted(map(str, opt._global_optimizer_post_hooks))],
        "foreach types": [repr(t) for t in torch.utils._foreach_utils._foreach_supported_types]
                         + [repr(t) for t in opt._foreach_supported_types],
        "aten::tensor_split kernel": torch._C._dispatch_dump("aten::tensor_split.tensor_indices_or_sections"),
        "threads": sorted(t.name for t in threading.enumerate()),
        "torch.load safe globals": sorted(map(repr, torch.serialization.get_safe_globals())),
    }

def changed(before, after):
    return sorted(k for k in before if before[k] != after[k])

before = state()
import mpidtensor
at_import = state()
from mpi4py import MPI
from mpidtensor.runtime import effects
installed_at_import = effects.installed()
mesh = mpidtensor.DeviceMesh("cpu", [0], comm=MPI.COMM_SELF)
after_mesh = state()
print(json.dumps({
    "import": changed(before, at_import),
    "MPI initialized by the import": at_import["MPI initialized"],
    "torch ops after the import": at_import["torch.ops.mpidtensor"],
    "declared at import": [e[0] for e in effects.describe() if e[1] == "import"],
    "installed at import": installed_at_import,
    "first mesh": changed(at_import, after_mesh),
    "installed": effects.installed(),
    "described": [list(e) for e in effects.describe()],
    "dynamo loaded": "torch._dynamo" in sys.modules,
}))
"""


# the variables an outer launcher sets, as mpidtensor.tools.launcher.nested_env drops them (this
# script imports no mpidtensor module itself: the probe does, in a fresh process)
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPI_LOCAL", "OMPI_", "PRTE_", "SLURM_")


def process_effects(root: Path) -> dict:
    """What ``import mpidtensor`` and a first one-rank mesh change, from a fresh process
    started without the outer launcher's variables (a singleton MPI process)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    if os.geteuid() == 0:  # Open MPI starts as root only when told twice
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    env["MPIDTENSOR_ABORT_ON_EXCEPTION"] = "1"
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env,
                          cwd=root, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"the effects probe failed ({done.returncode}):\n{done.stderr[-3000:]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    declared = {change for change, name in DECLARED_AT_IMPORT.items() if name in found["declared at import"]}
    found["declared import"] = [c for c in found["import"] if c in declared]
    found["import"] = [c for c in found["import"] if c not in declared]  # what no declaration names
    return found


# An observed change of the import and the effect (``runtime.effects.AT_IMPORT``) that declares it.
DECLARED_AT_IMPORT = {"MPI initialized": "MPI start-up"}


# --- (d) names that differ by a suffix -----------------------------------------------------------
_WORD_SUFFIXES = ("_utils", "_util", "_helpers", "_helper", "_impl", "_base", "_common", "_tools")
_INFLECTIONS = ("able", "ing", "ed", "es", "s")


def _stem(name: str) -> str:
    stem = name.strip("_")
    for suffix in _WORD_SUFFIXES:
        if stem.endswith(suffix) and len(stem) > len(suffix):
            stem = stem[:-len(suffix)]
            break
    for suffix in _INFLECTIONS:
        if stem.endswith(suffix) and len(stem) - len(suffix) >= 4:
            stem = stem[:-len(suffix)]
            break
    return stem.rstrip("e")


# Module paths that torch's API fixes (code ports by changing ``torch.distributed`` to
# ``mpidtensor``), so a pair with one of them is not renamed away.
TORCH_PATHS = {
    "mpidtensor.checkpoint.format_utils": "torch.distributed.checkpoint.format_utils",
    "mpidtensor.parallel.loss": "torch.distributed.tensor.parallel.loss",
}


def suffix_pairs(found: dict[str, Path]) -> list[tuple[str, str]]:
    """Pairs of modules (anywhere in the package) whose names differ only by a suffix,
    except pairs with a module whose path torch fixes (``TORCH_PATHS``)."""
    leaves = {name: name.rpartition(".")[2] for name in found if not name.endswith("__main__")}
    pairs = []
    for a, b in combinations(sorted(leaves), 2):
        la, lb = leaves[a].strip("_"), leaves[b].strip("_")
        if a in TORCH_PATHS or b in TORCH_PATHS:
            continue
        if la != lb and _stem(la) == _stem(lb):
            pairs.append((a, b))
    return pairs


# --- report ------------------------------------------------------------------------------------
def check(root: Path) -> dict:
    """Every finding of (a)-(d) for the project at ``root``."""
    found = modules(root)
    return {
        "long modules": long_modules(found, root),
        "import cycles": cycles(import_graph(found)),
        "effects": process_effects(root),
        "suffix pairs": suffix_pairs(found),
    }


def render(result: dict) -> str:
    effects = result["effects"]
    lines = [f"(a) modules over {MAX_LINES} lines: {len(result['long modules']) or 'none'}"]
    lines += [f"    {path}: {n}" for path, n in result["long modules"]]
    lines.append(f"(b) import cycles at module level: {len(result['import cycles']) or 'none'}")
    lines += ["    " + " -> ".join(cycle) for cycle in result["import cycles"]]
    lines.append(f"(c) process-wide effects of `import mpidtensor`: {', '.join(effects['import']) or 'none'} undeclared"
                 f"; declared: {', '.join(effects['declared import']) or 'none'}")
    lines.append(f"    MPI initialized by the import: {effects['MPI initialized by the import']}; "
                 f"torch.ops.mpidtensor after it: {', '.join(effects['torch ops after the import']) or 'none'}")
    lines.append(f"    after a first one-rank mesh: {', '.join(effects['first mesh']) or 'none'}")
    lines.append(f"    effects installed (runtime.effects): {', '.join(effects['installed']) or 'none'}")
    for name, when, what, done in effects["described"]:
        lines.append(f"      - {name} [{when}, {'installed' if done else 'not installed'}]: {what}")
    lines.append(f"(d) module names that differ by a suffix: {len(result['suffix pairs']) or 'none'}")
    lines += [f"    {a} / {b}" for a, b in result["suffix pairs"]]
    return "\n".join(lines)


def failed(result: dict, strict: bool = False) -> bool:
    """Whether the checks that must hold fail (all four with ``strict``)."""
    bad = bool(result["long modules"]) or bool(result["effects"]["import"]) \
        or bool(result["effects"]["installed at import"])
    return bad or (strict and bool(result["import cycles"] or result["suffix pairs"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    parser.add_argument("--strict", action="store_true", help="import cycles and suffix pairs fail too")
    parser.add_argument("--root", default=".", help="the project root (default: the current directory)")
    args = parser.parse_args(argv)
    result = check(Path(args.root).resolve())
    print(json.dumps(result, indent=1) if args.json else render(result))
    return 1 if failed(result, args.strict) else 0


if __name__ == "__main__":
    sys.exit(main())
