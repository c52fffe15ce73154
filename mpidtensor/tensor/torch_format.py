"""torch's pickle format for DTensors: written so that a plain torch process loads them,
read back as mpidtensor's DTensors on the live mesh.

**Writing** (:func:`saving`, :func:`reduce_as_torch`): inside ``with saving():`` a DTensor
pickles as torch's own DTensor does (``Tensor.__reduce_ex__``):
``_rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor, args, (dict, {"_local_tensor":
local, "_spec": spec}))``, naming torch's classes, with torch's ``DTensorSpec``,
``TensorMeta``, placements and ``DeviceMesh`` built from mpidtensor's. A plain torch process
that imported ``torch.distributed.tensor`` reads it with ``torch.load(weights_only=True)``
(without the import, torch's own "must be imported" error). The ``DeviceMesh`` is torch's
mesh over this rank's group (device, ranks, dim names; no process groups, which a file
cannot hold), with mpidtensor's description of the mesh (:func:`mpidtensor.mesh.pickling.
describe`: plain tuples) as one more attribute, ``_mpidtensor_mesh``, so that mpidtensor
gets its live mesh back (sub-meshes, flattened meshes). One torch mesh and spec per
mpidtensor mesh and spec in a file (pickle's memo writes each once). A DTensor with a
placement torch lacks keeps mpidtensor's format.

**Reading** (:func:`loading`, :class:`Unpickler`): torch's names are mapped to mpidtensor's
(:func:`loaders`): ``DTensor`` to mpidtensor's, whose ``__setstate__`` (:func:`set_state`)
finishes it; the spec, mesh and placements to small holders of their saved state,
converted there. ``torch.load`` finds those names in ``sys.modules`` (weights_only=False)
or in its safe globals (weights_only=True), which hold torch's classes once
``torch.distributed.tensor`` is imported: :func:`loading` puts mpidtensor's in their place
for the duration of one load, :class:`Unpickler` maps them for the other. A mesh torch
itself saved (no ``_mpidtensor_mesh``) maps to the program's root mesh of its ranks and
names (built if it has none).
"""
from __future__ import annotations

import contextlib
import pickle
import threading
import types
from typing import Any, Iterator, NamedTuple

import torch
from mpi4py import MPI

from ..mesh import DeviceMesh
from ..mesh.pickling import VERSION, describe, restore_mesh
from .placements import Partial, Replicate, Shard, _StridedShard, normalize_placements
from .spec import DTensorSpec
from .validate import check_local_shape

__all__ = ["Unpickler", "loaders", "loading", "reduce_as_torch", "saving", "saving_active", "set_state",
           "unpickler_module"]

_STATE = threading.local()  # .memo: {id(mpidtensor object): (object, torch's)} while saving


# --- writing -----------------------------------------------------------------------------------
@contextlib.contextmanager
def saving() -> Iterator[None]:
    """Within it, DTensors pickle in torch's format (on this thread)."""
    outer = getattr(_STATE, "memo", None)
    _STATE.memo = {} if outer is None else outer
    try:
        yield
    finally:
        _STATE.memo = outer


def saving_active() -> bool:
    return getattr(_STATE, "memo", None) is not None


def reduce_as_torch(tensor: torch.Tensor) -> tuple | None:
    """torch's DTensor's reduce tuple for mpidtensor's ``tensor``, or None if a placement has
    no torch equivalent."""
    spec = _torch_spec(tensor._spec)
    if spec is None:
        return None
    from torch.distributed.tensor import DTensor as TorchDTensor  # torch's, on the first save only
    args = (TorchDTensor, tensor.dtype, tuple(tensor.size()), tensor.stride(), tensor.storage_offset(),
            tensor.layout, tensor.device, tensor.requires_grad)
    state = (dict(tensor.__dict__) or None, {"_local_tensor": tensor._local_tensor, "_spec": spec})
    return torch._tensor._rebuild_from_type_v2, (torch._utils._rebuild_wrapper_subclass, TorchDTensor, args, state)


def _memo(obj: Any, make) -> Any:
    memo = _STATE.memo
    found = memo.get(id(obj))
    if found is None:
        found = memo[id(obj)] = (obj, make(obj))  # the object is held: its id stays its own
    return found[1]


def _torch_spec(spec: DTensorSpec) -> Any:
    return _memo(spec, _make_torch_spec)


def _make_torch_spec(spec: DTensorSpec) -> Any:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec as TorchSpec, TensorMeta
    placements = [_torch_placement(p) for p in spec.placements]
    if None in placements:
        return None
    return TorchSpec(_memo(spec.mesh, _torch_mesh), tuple(placements),
                     tensor_meta=TensorMeta(spec.shape, tuple(spec.stride), spec.dtype))


def _torch_placement(p: Any) -> Any:
    from torch.distributed.tensor import placement_types as torch_p
    if type(p) is Shard:
        return torch_p.Shard(p.dim)
    if type(p) is Replicate:
        return torch_p.Replicate()
    if type(p) is Partial:
        return torch_p.Partial(p.reduce_op)
    if type(p) is _StridedShard:
        return torch_p._StridedShard(p.dim, split_factor=p.split_factor)
    return None


def _torch_mesh(mesh: DeviceMesh) -> Any:
    """torch's ``DeviceMesh`` over ``mesh``'s group on this rank, carrying its description."""
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh
    made = TorchMesh(mesh.device_type, mesh.mesh, mesh_dim_names=mesh.mesh_dim_names, _init_backend=False,
                     _rank=MPI.COMM_WORLD.rank)
    made._mpidtensor_mesh = describe(mesh)
    return made


# --- reading -----------------------------------------------------------------------------------
class _Saved:
    """What a pickle built for a torch object: its state, converted by :func:`set_state`."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots), as pickle writes slotted objects
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise ValueError(f"not the state of torch's {type(self).__name__}: {state!r:.200}")
        self.state = state

    def field(self, name: str) -> Any:
        try:
            return self.state[name]
        except (AttributeError, KeyError):
            raise ValueError(f"a saved torch {type(self).__name__} without {name!r}") from None


class SavedSpec(_Saved):
    """torch's ``DTensorSpec`` as saved."""


class SavedMesh(_Saved):
    """torch's ``DeviceMesh`` as saved; :meth:`live` is mpidtensor's mesh for it."""

    def live(self) -> DeviceMesh:
        found = getattr(self, "_live", None)
        if found is None:
            found = self._live = restore_mesh(DeviceMesh, self._description())
        return found

    def _description(self) -> tuple:
        ours = self.state.get("_mpidtensor_mesh")
        if ours is not None:
            return ours
        # a mesh torch saved: the program's root mesh of its ranks and dim names (or a new one)
        root = self.state.get("_root_mesh")
        if root is not None and root is not self:
            raise ValueError(f"a DeviceMesh that torch saved as a part of a larger mesh "
                             f"({self.state.get('_mesh_dim_names')}): mpidtensor maps only a root mesh of torch's")
        shape = tuple(self.field("_layout").top_level_sizes)
        ranks = tuple(int(r) for r in self.field("_rank_map").tolist())
        return (VERSION, self.field("_device_type"), MPI.COMM_WORLD.size, 0, shape, ranks,
                self.state.get("_mesh_dim_names"), ())


class SavedPlacement(_Saved):
    """torch's placements as saved; :meth:`ours` is mpidtensor's."""

    def ours(self) -> Any:
        kind = type(self).__name__
        if kind == "Shard":
            return Shard(self.field("dim"))
        if kind == "Replicate":
            return Replicate()
        if kind == "Partial":
            return Partial(self.field("reduce_op"))
        return _StridedShard(self.field("dim"), split_factor=self.field("split_factor"))


class SavedTensorMeta(NamedTuple):
    """torch's ``TensorMeta`` as saved."""
    shape: torch.Size
    stride: tuple
    dtype: torch.dtype


class SavedShardOrderEntry(NamedTuple):
    """torch's ``ShardOrderEntry`` as saved (mpidtensor keeps torch's default order)."""
    tensor_dim: int
    mesh_dims: tuple


def _placement_holder(name: str) -> type:
    return type(name, (SavedPlacement,), {"__module__": __name__, "__qualname__": f"SavedPlacement.{name}"})


_TENSOR = "torch.distributed.tensor"
_PLACEMENTS = {name: _placement_holder(name) for name in ("Shard", "Replicate", "Partial", "_StridedShard")}

# torch's global names in a DTensor's pickle -> what mpidtensor loads them as (see loaders())
_LOADERS: dict[str, Any] = {
    f"{_TENSOR}._dtensor_spec.DTensorSpec": SavedSpec,
    f"{_TENSOR}._dtensor_spec.TensorMeta": SavedTensorMeta,
    f"{_TENSOR}._dtensor_spec.ShardOrderEntry": SavedShardOrderEntry,
    "torch.distributed.device_mesh.DeviceMesh": SavedMesh,
    **{f"{_TENSOR}.placement_types.{name}": cls for name, cls in _PLACEMENTS.items()},
}


def loaders() -> dict[str, Any]:
    """torch's global names in a DTensor's pickle -> what mpidtensor loads them as; torch's
    ``DTensor`` is mpidtensor's (whose ``__setstate__`` is :func:`set_state`)."""
    if _TENSOR + ".DTensor" not in _LOADERS:
        from .dtensor import DTensor  # the class that imports this module
        _LOADERS[_TENSOR + ".DTensor"] = DTensor
    return _LOADERS


def set_state(tensor: torch.Tensor, state: Any) -> None:
    """``DTensor.__setstate__`` for torch's format: ``tensor`` (made by torch's
    ``_rebuild_wrapper_subclass``) gets its local tensor and mpidtensor's spec on the live
    mesh; a local tensor that is not this rank's shard raises ``ValueError``."""
    ok = isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict)
    dict_state, slots = state if ok else (None, {})
    local, saved = slots.get("_local_tensor"), slots.get("_spec")
    if not isinstance(local, torch.Tensor) or not isinstance(saved, SavedSpec):
        raise ValueError(f"not a DTensor in torch's format: state {state!r:.200}")
    mesh = saved.field("mesh")
    meta = saved.field("tensor_meta")
    if not isinstance(mesh, SavedMesh) or not isinstance(meta, SavedTensorMeta):
        raise ValueError(f"not a DTensorSpec in torch's format: {saved.state!r:.200}")
    live = mesh.live()
    placements = tuple(p.ours() if isinstance(p, SavedPlacement) else p for p in saved.field("placements"))
    spec = DTensorSpec(live, normalize_placements(placements, live.ndim, len(meta.shape)), tuple(meta.shape),
                       tuple(meta.stride), meta.dtype)
    if local.dtype != spec.dtype or tuple(tensor.shape) != tuple(spec.shape) or tensor.device != local.device:
        raise ValueError(f"a saved DTensor of {tuple(tensor.shape)} {tensor.dtype} on {tensor.device} "
                         f"holds a local {local.dtype} tensor on {local.device} for a spec of {spec}")
    check_local_shape(local, spec)
    tensor._local_tensor = local
    tensor._spec = spec
    for name, value in (dict_state or {}).items():
        setattr(tensor, name, value)


def _global_name(entry: Any) -> str:
    if isinstance(entry, tuple):
        return entry[1]
    return f"{getattr(entry, '__module__', '')}.{getattr(entry, '__qualname__', '')}"


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """Within it, ``torch.load(weights_only=True)`` loads torch's DTensor names as
    mpidtensor's (the safe globals of torch's classes by those names set aside, restored
    after)."""
    serialization = torch.serialization
    saved = serialization.get_safe_globals()
    ours = loaders()
    kept = [g for g in saved if _global_name(g) not in ours]
    serialization.clear_safe_globals()
    serialization.add_safe_globals(kept + [(obj, name) for name, obj in ours.items()])
    try:
        yield
    finally:
        serialization.clear_safe_globals()
        serialization.add_safe_globals(saved)


def _mapped(base: type) -> type:
    """``base`` (an unpickler class) with torch's DTensor names mapped to mpidtensor's."""

    class Unpickler(base):
        def find_class(self, module: str, name: str) -> Any:
            found = loaders().get(f"{module}.{name}")
            return found if found is not None else super().find_class(module, name)

    Unpickler.__doc__ = f"{base.__module__}.{base.__qualname__} with torch's DTensor names mapped to mpidtensor's."
    return Unpickler


Unpickler = _mapped(pickle.Unpickler)


_MODULES: dict[str, types.ModuleType] = {}  # not cleared: one small module per pickle module used


def unpickler_module(base: Any = pickle) -> types.ModuleType:
    """A pickle module for ``torch.load(pickle_module=...)``: ``base`` with its unpickler
    mapping torch's DTensor names to mpidtensor's."""
    found = _MODULES.get(base.__name__)
    if found is None:
        found = types.ModuleType(f"{__name__}.{base.__name__}")
        vars(found).update({k: v for k, v in vars(base).items() if not k.startswith("__")})
        found.Unpickler = Unpickler if base.Unpickler is pickle.Unpickler else _mapped(base.Unpickler)
        _MODULES[base.__name__] = found
    return found
