"""Model and optimizer state dicts keyed by parameter FQN, as
``torch.distributed.checkpoint.state_dict`` gives them.

Sharded (default): the values are the DTensors themselves (model) or the optimizer's
state tensors, so ``checkpoint.load`` into them restores in place. Full: DTensors
become whole plain tensors (a collective per tensor). Setting accepts either: a
DTensor target takes its own block of a full tensor (no communication), or the
value redistributed to its placements; with ``broadcast_from_rank0`` only rank 0
needs the (full) state dict and the others get it by ``Bcast``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from mpi4py import MPI

from ..tensor.dtensor import DTensor
from ..runtime import watchdog
from ..runtime.agreement import on_rank0
from . import io, tree

WORLD = MPI.COMM_WORLD


@dataclass
class StateDictOptions:
    """``full_state_dict``: whole plain tensors instead of DTensors; ``cpu_offload``: values
    on the CPU (with ``full_state_dict`` only rank 0 keeps them, the others get ``{}``);
    ``broadcast_from_rank0``: set from rank 0's full state dict; ``strict``: missing or
    unexpected keys raise; ``flatten_optimizer_state_dict``: the optimizer state dict is
    flat, one key per parameter and setting (``state.<fqn>.<key>``,
    ``param_groups.<fqn>.<setting>``), as torch's: it reshards between layouts whose
    ranks hold different parameters (pipeline stages), which the nested form, whose param
    groups list each rank's own parameters, cannot."""

    full_state_dict: bool = False
    cpu_offload: bool = False
    broadcast_from_rank0: bool = False
    strict: bool = True
    flatten_optimizer_state_dict: bool = False


def _export(value: Any, options: StateDictOptions) -> Any:
    if isinstance(value, DTensor) and options.full_state_dict:
        value = value.full_tensor()
    if isinstance(value, torch.Tensor) and options.cpu_offload:
        value = value.cpu()
    return value


def _rank0_only(state: dict, options: StateDictOptions) -> dict:
    return {} if options.full_state_dict and options.cpu_offload and WORLD.rank != 0 else state


def get_model_state_dict(model: torch.nn.Module, *, options: StateDictOptions | None = None) -> dict:
    """``model.state_dict()``, DTensors kept (sharded) or gathered (``full_state_dict``)."""
    options = options or StateDictOptions()
    state = {k: _export(v, options) for k, v in model.state_dict().items()}
    return _rank0_only(state, options)


def _optimizers(optimizers) -> list[torch.optim.Optimizer]:
    return [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)


def _param_fqns(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _init_state(optim: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors (in the parameters' layouts) by one step with
    zero gradients and a learning rate of 0 when some parameter has none yet."""
    params = [p for g in optim.param_groups for p in g["params"] if p.requires_grad]
    if all(p in optim.state for p in params):
        return
    lrs = [g["lr"] for g in optim.param_groups]
    zeroed = [p for p in params if p.grad is None]
    for p in zeroed:
        p.grad = torch.zeros_like(p)
    for g in optim.param_groups:
        g["lr"] = 0.0
    try:
        optim.step()
    finally:
        for g, lr in zip(optim.param_groups, lrs):
            g["lr"] = lr
        for p in zeroed:
            p.grad = None


def get_optimizer_state_dict(
    model: torch.nn.Module, optimizers, *, options: StateDictOptions | None = None
) -> dict:
    """The optimizers' state with parameters named by FQN: ``{"state": {fqn: {...}},
    "param_groups": [{..., "params": [fqn, ...]}]}``. Creates missing state first."""
    options = options or StateDictOptions()
    names = _param_fqns(model)
    state, groups = {}, []
    for optim in _optimizers(optimizers):
        _init_state(optim)
        own = _named(optim, names, optim.state_dict())
        groups.extend(own["param_groups"])
        state.update({fqn: {k: _export(v, options) for k, v in values.items()} for fqn, values in own["state"].items()})
    if options.flatten_optimizer_state_dict:
        return _rank0_only(_flatten(state, groups), options)
    return _rank0_only({"state": state, "param_groups": groups}, options)


def _flatten(state: dict, groups: list[dict]) -> dict:
    """torch's flat optimizer state dict: ``state.<fqn>.<key>`` and, for every parameter
    of a group, ``param_groups.<fqn>.<setting>``."""
    flat = {f"state.{fqn}.{k}": v for fqn, values in state.items() for k, v in values.items()}
    for group in groups:
        settings = {k: v for k, v in group.items() if k != "params"}
        flat.update({f"param_groups.{fqn}.{k}": v for fqn in group["params"] for k, v in settings.items()})
    return flat


def _unflatten(optimizers: list[torch.optim.Optimizer], names: dict[int, str], flat: dict) -> dict:
    """The nested optimizer state dict of ``optimizers``' parameters from a flat one
    (:func:`_flatten`); a group takes the settings of its first parameter."""
    state, groups = {}, []
    for optim in optimizers:
        _init_state(optim)
        for group in optim.param_groups:
            fqns = [names[id(p)] for p in group["params"]]
            for p, fqn in zip(group["params"], fqns):
                values = {k: flat[f"state.{fqn}.{k}"] for k in optim.state.get(p, {}) if f"state.{fqn}.{k}" in flat}
                if values:
                    state[fqn] = values
            first = f"param_groups.{fqns[0]}." if fqns else ""
            settings = {k: flat[first + k] for k in group if k != "params" and first + k in flat}
            groups.append({**{k: v for k, v in group.items() if k != "params"}, **settings, "params": fqns})
    return {"state": state, "param_groups": groups}


def get_state_dict(model: torch.nn.Module, optimizers, *, options: StateDictOptions | None = None):
    """``(get_model_state_dict(...), get_optimizer_state_dict(...))``."""
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, optimizers, options=options)


# --- setting ---------------------------------------------------------------------------------------------
def _skeleton(leaves: list[tuple[tuple, Any]]) -> list[tuple]:
    """``(path, (shape, dtype) or None, value or None)`` of each leaf of a full state
    dict: what the other ranks need to receive it."""
    dtensors = [tree.fqn(p) for p, v in leaves if isinstance(v, DTensor)]
    if dtensors:
        raise ValueError(f"broadcast_from_rank0 needs a full state dict (plain tensors); got DTensors {dtensors}")
    return [(p, (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None,
             None if isinstance(v, torch.Tensor) else v) for p, v in leaves]


def broadcast_state(state: Any) -> Any:
    """Rank 0's nested ``state`` (plain tensors and values) on every rank; tensors go by
    ``Bcast`` in pieces of at most ``io.MAX_CHUNK_BYTES``."""
    leaves = list(tree.flatten(state)) if WORLD.rank == 0 else []
    skeleton = on_rank0(WORLD, _skeleton, leaves)
    out = []
    for i, (path, meta, value) in enumerate(skeleton):
        if meta is None:
            out.append((path, value))
            continue
        t = leaves[i][1].detach().cpu().contiguous() if WORLD.rank == 0 else torch.empty(meta[0], dtype=meta[1])
        raw = t.reshape(-1).view(torch.uint8).numpy()
        step = io.MAX_CHUNK_BYTES
        for lo in range(0, raw.size, step):
            watchdog.call("state dict broadcast from rank 0 (Bcast)", WORLD, WORLD.Bcast,
                          [raw[lo: lo + step], MPI.BYTE], 0)
        out.append((path, t))
    return tree.unflatten(out) if out else {}


def _assign(target: torch.Tensor, value: torch.Tensor, key: str) -> None:
    """Copy ``value`` (a DTensor or the full tensor) into ``target`` (a DTensor or a tensor)."""
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(f"shape mismatch for {key!r}: got {tuple(value.shape)}, expected {tuple(target.shape)}")
    with torch.no_grad():
        if not isinstance(target, DTensor):
            target.copy_(value.full_tensor() if isinstance(value, DTensor) else value)
            return
        if isinstance(value, DTensor):
            if value.placements != target.placements:
                value = value.redistribute(target.device_mesh, target.placements)
            target._local_tensor.copy_(value._local_tensor)
            return
        shape, start = target._spec.local_shape_and_offset()
        block = value
        for d, (o, n) in enumerate(zip(start, shape)):
            block = block.narrow(d, o, n)
        target._local_tensor.copy_(block)


def _keys_or_raise(expected: Iterable[str], given: Iterable[str], strict: bool, what: str):
    missing = [k for k in expected if k not in given]
    unexpected = [k for k in given if k not in expected]
    if strict and (missing or unexpected):
        raise KeyError(f"{what}: missing keys {missing}, unexpected keys {unexpected}")
    return missing, unexpected


def set_model_state_dict(
    model: torch.nn.Module, model_state_dict: dict, *, options: StateDictOptions | None = None
):
    """Copy ``model_state_dict`` (sharded or full) into the model's parameters and buffers.
    Returns ``(missing_keys, unexpected_keys)`` like ``load_state_dict``."""
    options = options or StateDictOptions()
    if options.broadcast_from_rank0:
        model_state_dict = broadcast_state(model_state_dict)
    targets = model.state_dict()
    missing, unexpected = _keys_or_raise(targets, model_state_dict, options.strict, "set_model_state_dict")
    for key, target in targets.items():
        if key in model_state_dict:
            _assign(target, model_state_dict[key], key)
    return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)


def set_optimizer_state_dict(
    model: torch.nn.Module, optimizers, optim_state_dict: dict, *, options: StateDictOptions | None = None
) -> None:
    """Load an FQN-keyed optimizer state dict (sharded or full; flat with
    ``flatten_optimizer_state_dict``) into the optimizers. An optimizer's own
    ``state_dict()`` form (parameters numbered) is accepted too, as torch does: its numbers
    name the optimizer's parameters by position."""
    options = options or StateDictOptions()
    if options.broadcast_from_rank0:
        optim_state_dict = broadcast_state(optim_state_dict)
    names = _param_fqns(model)
    if options.flatten_optimizer_state_dict:
        optim_state_dict = _unflatten(_optimizers(optimizers), names, optim_state_dict)
    numbered = _numbered(optim_state_dict)
    for optim in _optimizers(optimizers):
        _init_state(optim)
        osd = _named(optim, names, optim_state_dict) if numbered else optim_state_dict
        given_groups = {frozenset(g["params"]): g for g in osd["param_groups"]}  # any order, as torch
        state = osd["state"]
        raw_state, raw_groups = {}, []
        for index_base, group in _numbered_groups(optim):
            fqns = tuple(names[id(p)] for p in group["params"])
            if frozenset(fqns) not in given_groups:
                raise KeyError(f"set_optimizer_state_dict: no param group for parameters {list(fqns)}")
            raw_groups.append({**given_groups[frozenset(fqns)],
                               "params": list(range(index_base, index_base + len(fqns)))})
            for i, (p, name) in enumerate(zip(group["params"], fqns)):
                if name not in state:
                    if options.strict and p in optim.state:
                        raise KeyError(f"set_optimizer_state_dict: missing state for {name!r}")
                    continue
                current = optim.state.get(p, {})
                values = {}
                for k, v in state[name].items():
                    if isinstance(v, torch.Tensor) and isinstance(current.get(k), torch.Tensor):
                        _assign(current[k], v, f"{name}.{k}")
                        v = current[k]
                    values[k] = v
                raw_state[index_base + i] = values
        optim.load_state_dict({"state": raw_state, "param_groups": raw_groups})


def _numbered(osd: dict) -> bool:
    """Whether ``osd`` is in an optimizer's own form: parameters numbered, not named."""
    return ("param_groups" in osd and all(isinstance(k, int) for k in osd.get("state", {}))
            and all(isinstance(i, int) for g in osd["param_groups"] for i in g["params"]))


def _named(optim: torch.optim.Optimizer, names: dict[int, str], osd: dict) -> dict:
    """An optimizer's own-form ``osd`` keyed by FQN: the i-th number of a group names the
    i-th parameter of ``optim``'s group at the same position (``Optimizer.load_state_dict``'s rule)."""
    groups = osd["param_groups"]
    if len(groups) != len(optim.param_groups) or any(
            len(g["params"]) != len(h["params"]) for g, h in zip(groups, optim.param_groups)):
        raise ValueError("set_optimizer_state_dict: the numbered optimizer state dict's param groups do not "
                         "match the optimizer's (group count or sizes)")
    fqn = {i: names[id(p)] for g, h in zip(groups, optim.param_groups) for i, p in zip(g["params"], h["params"])}
    return {"state": {fqn[i]: v for i, v in osd["state"].items()},
            "param_groups": [{**g, "params": [fqn[i] for i in g["params"]]} for g in groups]}


def _numbered_groups(optim: torch.optim.Optimizer):
    base = 0
    for group in optim.param_groups:
        yield base, group
        base += len(group["params"])


def set_state_dict(
    model: torch.nn.Module, optimizers, *, model_state_dict: dict, optim_state_dict: dict,
    options: StateDictOptions | None = None,
):
    """``set_model_state_dict`` then ``set_optimizer_state_dict``."""
    keys = set_model_state_dict(model, model_state_dict, options=options)
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return keys
