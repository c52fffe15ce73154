"""Structure checks of the mpidtensor package, run from the project root:

    python tools/check_structure.py [--json]

(a) modules over ``MAX_LINES`` lines; (b) import cycles at module level among mpidtensor
modules (imports inside functions, and under ``if TYPE_CHECKING:``, excluded; relative
and absolute imports resolved); (c) the process-wide effects of ``import mpidtensor``
(Python's and torch's hooks and tables compared before and after the import, in a fresh
single-rank process) and of building a first, one-rank mesh, beside what
``mpidtensor.runtime.effects`` says it installed; (d) pairs of module names that differ
only by a suffix (``format`` / ``format_utils``, ``traced`` / ``tracing``); (e) caches that
``clear_cache()`` does not reach (``functools`` caches and module-level memo dicts not
registered with ``runtime.caches``, the rule at :func:`unowned_caches`); (f) module paths
named in docstrings and comments that name no module of the tree (the rule at
:func:`dangling_references`); (g) unwatched waits: a call of MPI's ``Wait`` / ``Waitall`` /
``Waitany`` / ``Waitsome`` outside ``mpidtensor/runtime/watchdog.py``, the one place that waits,
or a blocking MPI call on a communicator (collective, receive, probe, communicator
constructor) outside ``comm/`` and the watchdog, not made through ``watchdog.call`` (so that
a stuck rank reports).

The probe of (c) starts before mpi4py is imported, so it sees MPI started by the import
(``MPI.Is_initialized()``: the one effect ``runtime.effects.AT_IMPORT`` declares) and lists
the ``torch.ops.mpidtensor`` ops in torch's op registry after the import and the first mesh.

The exit status is 1 if (a), (e), (f) or (g) finds anything or (c) finds an undeclared effect of
the import itself; ``--strict`` makes (b) and (d) count too. ``--json`` prints the findings
as JSON.
"""
from __future__ import annotations

import argparse
import ast
import io
import json
import os
import re
import subprocess
import sys
import tokenize
from itertools import combinations
from pathlib import Path
from typing import Callable

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


# --- (e) caches nobody owns --------------------------------------------------------------------
# A cache is owned when ``clear_cache()`` (``runtime.caches``) reaches it. Two shapes are looked for:
# - a function decorated with functools' ``cache`` / ``lru_cache``: owned when its module passes
#   the function (``f.cache_clear``) to ``caches.on_clear``, directly or through the tuple a ``for``
#   loop around that call iterates over;
# - a module-level dict (``{}``, ``dict()``, ``OrderedDict()``, ``defaultdict(...)``, a weak
#   dictionary) that one function of the module both looks up (``.get``, ``[key]``, ``in``) and
#   fills (``[key] = ...``, ``.setdefault``): the memo pattern. Registries filled by a register
#   function and read elsewhere do not match it. Owned when a function passed to ``on_clear``
#   in that module names the dict. (Dicts made by ``caches.cache`` are the registry's own.)
# Either is exempt when its ``def`` / assignment line says why it is never cleared with a comment
# ``# not cleared: <why>`` (a memo of facts fixed for the process, or a registry of live objects).
_CACHE_DECORATORS = {"cache", "lru_cache"}
_DICT_FACTORIES = {"dict", "OrderedDict", "defaultdict", "WeakKeyDictionary", "WeakValueDictionary"}
_EXEMPT = "# not cleared:"


def _is_cache_decorator(node: ast.expr) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
    return name in _CACHE_DECORATORS


def _on_clear_names(tree: ast.Module) -> set[str]:
    """The names passed to ``on_clear`` in ``tree`` (also those a ``for`` loop around the call
    iterates over), and the names used inside the functions so passed."""
    passed: set[str] = set()
    loops = [n for n in ast.walk(tree) if isinstance(n, ast.For)]
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and ast.unparse(call.func).endswith("on_clear"):
            args = [*call.args, *(k.value for k in call.keywords)]
            passed |= {n.id for a in args for n in ast.walk(a) if isinstance(n, ast.Name)}
            for loop in loops:
                if any(c is call for c in ast.walk(loop)):
                    passed |= {n.id for n in ast.walk(loop.iter) if isinstance(n, ast.Name)}
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.name in passed:
            passed |= {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
    return passed


def _module_dicts(tree: ast.Module) -> dict[str, int]:
    """Module-level names bound to a new dict, by line."""
    found = {}
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        made = isinstance(value, ast.Dict) and not value.keys or isinstance(value, ast.Call) and (
            getattr(value.func, "id", None) or getattr(value.func, "attr", None)) in _DICT_FACTORIES
        if made:
            found.update({t.id: node.lineno for t in targets if isinstance(t, ast.Name)})
    return found


def _memoizes(fn: ast.FunctionDef, name: str) -> bool:
    """Whether ``fn`` both looks ``name`` up and fills it."""
    reads = writes = False
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and getattr(node.func.value, "id", None) == name:
            reads |= node.func.attr == "get"
            writes |= node.func.attr == "setdefault"
        elif isinstance(node, ast.Subscript) and getattr(node.value, "id", None) == name:
            if isinstance(node.ctx, ast.Store):
                writes = True
            else:
                reads = True
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                and any(getattr(c, "id", None) == name for c in node.comparators):
            reads = True
    return reads and writes


def unowned_caches(found: dict[str, Path], root: Path) -> list[str]:
    """``path:line name`` of each cache ``clear_cache()`` does not reach (the rule above)."""
    problems = []
    for path in found.values():
        text = path.read_text()
        lines, tree = text.splitlines(), ast.parse(text, str(path))
        owned = _on_clear_names(tree)
        where = path.relative_to(root)
        functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
        for fn in functions:
            if any(_is_cache_decorator(d) for d in fn.decorator_list) and fn.name not in owned \
                    and not any(_EXEMPT in lines[d.lineno - 1] for d in fn.decorator_list):
                problems.append(f"{where}:{fn.lineno} {fn.name} (functools cache)")
        for name, line in _module_dicts(tree).items():
            if name not in owned and _EXEMPT not in lines[line - 1] and any(_memoizes(fn, name) for fn in functions):
                problems.append(f"{where}:{line} {name} (module-level dict filled as a memo)")
    return problems


# --- (f) module paths in docstrings and comments that name nothing -----------------------------
# What counts as a reference (in docstrings and ``#`` comments of the package's modules):
# - the target of a Sphinx role (``:mod:``, ``:func:``, ``:class:``, ``:meth:``, ``:attr:``,
#   ``:data:``, ``:exc:``), ``~`` dropped, when it is relative (``.meta``, ``..runtime.agreement``),
#   absolute (``mpidtensor.mesh``) or starts with a subpackage of mpidtensor (``mesh.prepared``);
# - a double-backticked literal or a bare word of dotted identifiers starting with ``mpidtensor.``;
# - a double-backticked literal of dotted identifiers (at most ``()`` after) that starts with a
#   subpackage of mpidtensor and whose second part is the name of some module of the tree
#   (``mesh.pool``, as ``comm.pool`` exists): a variable's attribute (``tensor.shape``) is not
#   taken for one.
# It resolves when the longest prefix naming a module of the tree is followed by nothing (a
# ``:mod:`` must be a module) or by a name that module binds at top level (def, class,
# assignment, import); further attributes are not followed.
_ROLE = re.compile(r":(mod|func|class|meth|attr|data|exc):`~?([.\w]+)`")
_LITERAL = re.compile(r"``([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?``")
_ABSOLUTE = re.compile(r"(?<![\w.`])(mpidtensor(?:\.[A-Za-z_]\w*)+)")


def _texts(tree: ast.Module, source: str) -> list[tuple[int, str]]:
    """(line, text) of each docstring and comment of a module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = node.body[0] if node.body else None
            if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
                found.append((doc.lineno, doc.value.value))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found.append((token.start[0], token.string))
    return found


def _bound_names(path: Path) -> set[str]:
    """The names a module binds at top level."""
    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def _resolves(dotted: str, found: dict[str, Path], bound: Callable[[str], set[str]], module_only: bool) -> bool:
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        prefix = ".".join(parts[:k])
        if prefix in found:
            rest = parts[k:]
            return not rest or (not module_only and rest[0] in bound(prefix))
    return False


def _references(text: str, package: str, subpackages: set[str], module_words: set[str]) -> list[tuple[str, bool]]:
    """(absolute dotted name, must be a module) of each reference in one line of text, for a
    module of ``package``."""
    refs: list[tuple[str, bool]] = []
    for role, target in _ROLE.findall(text):
        if target.startswith("."):
            up = len(target) - len(target.lstrip("."))
            base = package.split(".")
            refs.append((".".join(base[:len(base) - (up - 1)] + [target.lstrip(".")]), role == "mod"))
        elif target.startswith(PACKAGE + "."):
            refs.append((target, role == "mod"))
        elif target.split(".")[0] in subpackages and "." in target:
            refs.append((f"{PACKAGE}.{target}", role == "mod"))
    for literal in _LITERAL.findall(text):
        first, second = literal.split(".")[:2]
        if literal.startswith(PACKAGE + "."):
            refs.append((literal, False))
        elif first in subpackages and second in module_words:
            refs.append((f"{PACKAGE}.{literal}", False))
    refs += [(absolute, False) for absolute in _ABSOLUTE.findall(text)]
    return list(dict.fromkeys(refs))


def dangling_references(found: dict[str, Path], root: Path) -> list[str]:
    """``path:line reference`` of each module path in a docstring or comment that names
    nothing in the tree (the rule above)."""
    subpackages = {name.split(".")[1] for name in found if name.count(".") >= 1}
    module_words = {part for name in found for part in name.split(".")[1:]}
    bound_by: dict[str, set[str]] = {}

    def bound(module: str) -> set[str]:
        if module not in bound_by:
            bound_by[module] = _bound_names(found[module])
        return bound_by[module]

    problems = []
    for name, path in found.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        source = path.read_text()
        for start, block in _texts(ast.parse(source, str(path)), source):
            for line, text in enumerate(block.splitlines(), start):
                for ref, module_only in _references(text, package, subpackages, module_words):
                    if not _resolves(ref, found, bound, module_only):
                        problems.append(f"{path.relative_to(root)}:{line} {ref}")
    return problems

# --- (g) unwatched waits -----------------------------------------------------------------------
WAITS = ("Wait", "Waitall", "Waitany", "Waitsome")
WATCHED = "mpidtensor/runtime/watchdog.py"
# MPI calls that block until other ranks take part: collectives (pickle-based lower-case and
# buffer-based), receives and probes, and the communicator constructors (themselves collective).
BLOCKING = frozenset(
    "Barrier Bcast Allreduce Allgather Allgatherv Gather Gatherv Scatter Scatterv Alltoall Alltoallv Alltoallw "
    "Reduce Reduce_scatter Reduce_scatter_block Scan Exscan Recv Sendrecv Sendrecv_replace Probe Mprobe Split "
    "Split_type Sub Create Create_cart Create_group Create_graph Create_dist_graph Create_intercomm Dup Merge "
    "barrier bcast allreduce allgather gather scatter alltoall reduce scan exscan recv sendrecv probe mprobe".split())
# ... on a receiver named as a communicator is (an object named ``comm``, ``_cart``, ``WORLD``, ``ctl``...):
# torch's ``tensor.gather`` or a helper's ``route.reduce`` are not MPI calls.
COMMUNICATOR = re.compile(r"(comm|cart|world|ctl|group|ordered|members)\w*$", re.IGNORECASE)
# Where an MPI call may block unwatched: comm/ brackets its own calls (comm.base.enter/leave),
# the watchdog is the watched call itself.
OWN_WATCH = ("mpidtensor/comm/", WATCHED)
UNWATCHED_ALLOWED: dict[str, str] = {}  # "path: call" -> why it must stay unwatched


def unwatched_waits(found: dict[str, Path], root: Path) -> list[tuple[str, int, str]]:
    """(module path, line, call) of every MPI wait (``request.Wait()``, ``MPI.Request.Waitall``,
    ...) outside the watchdog module, and of every blocking MPI call on a communicator
    (collective, receive, probe, ``Split`` / ``Create*`` / ``Dup``) outside ``comm/`` and the
    watchdog not passed through ``watchdog.call`` (a reference, not a call): each would block
    a rank with no report."""
    hits = []
    for path in found.values():
        relative = path.relative_to(root).as_posix()
        if relative == WATCHED:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            call, attr = ast.unparse(node.func), node.func.attr
            blocking = attr in BLOCKING and COMMUNICATOR.search(ast.unparse(node.func.value)) is not None \
                and not relative.startswith(OWN_WATCH)
            if (attr in WAITS or blocking) and f"{relative}: {call}" not in UNWATCHED_ALLOWED:
                hits.append((relative, node.lineno, call))
    return sorted(hits)


# --- report ------------------------------------------------------------------------------------
def check(root: Path) -> dict:
    """Every finding of (a)-(g) for the project at ``root``."""
    found = modules(root)
    return {
        "long modules": long_modules(found, root),
        "import cycles": cycles(import_graph(found)),
        "effects": process_effects(root),
        "suffix pairs": suffix_pairs(found),
        "unowned caches": unowned_caches(found, root),
        "dangling references": dangling_references(found, root),
        "unwatched waits": unwatched_waits(found, root),
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
    lines.append(f"(e) caches clear_cache() does not reach: {len(result['unowned caches']) or 'none'}")
    lines += [f"    {where}" for where in result["unowned caches"]]
    lines.append(f"(f) module paths in docstrings and comments that name nothing: "
                 f"{len(result['dangling references']) or 'none'}")
    lines += [f"    {where}" for where in result["dangling references"]]
    lines.append(f"(g) unwatched MPI waits and blocking calls: {len(result['unwatched waits']) or 'none'}")
    lines += [f"    {path}:{line}: {call}" for path, line, call in result["unwatched waits"]]
    return "\n".join(lines)


def failed(result: dict, strict: bool = False) -> bool:
    """Whether the checks that must hold fail (all of them with ``strict``)."""
    bad = bool(result["long modules"]) or bool(result["effects"]["import"]) \
        or bool(result["effects"]["installed at import"]) or bool(result["unowned caches"]) \
        or bool(result["dangling references"]) or bool(result["unwatched waits"])
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
