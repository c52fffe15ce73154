"""``save`` / ``load``: nested state dicts of DTensors, tensors and values over MPI-IO.

Both are collective over ``comm`` (``COMM_WORLD``) and take every decision from data
all ranks share: one ``allgather`` of the leaves' metadata (keys, global shapes,
dtypes, the box each rank holds) comes before any data moves, and errors found
there are raised on every rank.

save: every distinct non-empty box of a tensor is written once, by the lowest rank
holding it (replicas and plain tensors are written once), straight from the local
tensor into the tensor's row-major place in a new data file; then rank 0 commits
the index (see :mod:`.format`), so a save that dies midway leaves the previous
checkpoint as it was. ``Partial`` DTensors are reduced first.

load: each rank reads the box of the target layout it holds, whatever layout was
saved (resharding is the file view). Each saved block's CRC-32 is checked once: by a
rank whose target box is that block, else by a rank that reads it for the check.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from ..dtensor import DTensor
from ..placements import Replicate
from . import format as fmt
from . import io


def _box(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(start, shape) of the part of ``t``'s global tensor that this rank holds."""
    if isinstance(t, DTensor):
        shape, start = t._spec.local_shape_and_offset()
        return tuple(start), tuple(shape)
    return (0,) * t.ndim, tuple(t.shape)


def _leaf_meta(path: tuple, leaf: Any) -> tuple:
    """(key, None) for a value; (key, (global shape, dtype name, box)) for a tensor."""
    key = fmt.fqn(path)
    if not isinstance(leaf, torch.Tensor):
        return (key, None)
    dtype = fmt.DTYPE_NAMES.get(leaf.dtype, str(leaf.dtype))
    return (key, (tuple(leaf.shape), dtype, _box(leaf)))


def _local_bytes(t: torch.Tensor) -> np.ndarray:
    """This rank's block of ``t`` as contiguous CPU bytes (no copy when it already is)."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    local = local.detach().cpu().contiguous()
    return local.reshape(-1).view(torch.uint8).numpy()


def _raise_if(errors: list[str], cls: type = fmt.CheckpointError) -> None:
    if errors:
        raise cls("; ".join(dict.fromkeys(errors)))


def _check_same_leaves(gathered: list[list[tuple]]) -> None:
    """All ranks must pass state dicts with the same keys, global shapes and dtypes."""
    first = [(key, meta and meta[:2]) for key, meta in gathered[0]]
    _raise_if([f"{key!r} has dtype {meta[1]}, which cannot be checkpointed"
               for key, meta in gathered[0] if meta is not None and meta[1] not in fmt.DTYPES], TypeError)
    for rank, metas in enumerate(gathered[1:], 1):
        if [(key, meta and meta[:2]) for key, meta in metas] != first:
            raise ValueError(f"the state dict on rank {rank} differs from rank 0's in keys, shapes or dtypes")
    keys = [key for key, _ in gathered[0]]
    if len(set(keys)) != len(keys):
        dup = sorted({k for k in keys if keys.count(k) > 1})
        raise ValueError(f"state dict has leaves with the same dotted name: {dup}")


def save(state_dict: Any, checkpoint_id: str | os.PathLike, *, comm: MPI.Intracomm | None = None) -> None:
    """Write ``state_dict`` to the checkpoint directory ``checkpoint_id``. Collective."""
    comm = MPI.COMM_WORLD if comm is None else comm
    directory = os.fspath(checkpoint_id)
    leaves = list(fmt.flatten(state_dict))
    token, setup_error = None, None
    if comm.rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            token = fmt.new_token()
        except OSError as err:
            setup_error = err
    metas = [_leaf_meta(p, v) for p, v in leaves]
    gathered = comm.allgather((metas, token, setup_error))
    token, setup_error = gathered[0][1], gathered[0][2]
    if setup_error is not None:
        raise setup_error
    all_metas = [g[0] for g in gathered]
    _check_same_leaves(all_metas)

    tensor_ids = [i for i, (_, meta) in enumerate(metas) if meta is not None]
    offsets, size = fmt.layout([(metas[i][1][0], leaves[i][1].dtype) for i in tensor_ids])
    todo, written = [], {}
    for i, offset in zip(tensor_ids, offsets):
        t = leaves[i][1]
        if isinstance(t, DTensor) and any(p.is_partial() for p in t.placements):
            t = t.redistribute(t.device_mesh, [Replicate() if p.is_partial() else p for p in t.placements])
        boxes = [rank_metas[i][1][2] for rank_metas in all_metas]
        start, shape = boxes[comm.rank]
        if not np.prod(shape, dtype=np.int64) or boxes.index((start, shape)) != comm.rank:
            continue
        raw = _local_bytes(t)
        written[i] = (list(start), list(shape), fmt.crc32(raw))
        todo += io.pieces(offset, t.shape, start, shape, t.element_size(), raw)
    path = os.path.join(directory, fmt.data_name(token))
    io.write_pieces(path, comm, todo, size)

    blocks = comm.gather(written, root=0)
    error = None
    if comm.rank == 0:
        try:
            _commit(directory, token, size, leaves, metas, dict(zip(tensor_ids, offsets)), blocks)
        except Exception as err:  # noqa: BLE001  (raised on every rank below)
            error = err
    error = comm.bcast(error, root=0)
    if error is not None:
        raise error


def _commit(directory, token, size, leaves, metas, offsets, blocks) -> None:
    """Rank 0: the index from everyone's written blocks, committed (see format.commit_index)."""
    by_leaf: dict[int, list] = {}
    for rank_blocks in blocks:
        for i, block in rank_blocks.items():
            by_leaf.setdefault(i, []).append(block)
    entries = []
    for i, (path, value) in enumerate(leaves):
        meta = None
        if i in offsets:
            saved = [{"start": s, "shape": sh, "crc32": c} for s, sh, c in sorted(by_leaf.get(i, []))]
            covered = sum(int(np.prod(b["shape"], dtype=np.int64)) for b in saved)
            numel = int(np.prod(metas[i][1][0], dtype=np.int64))
            if covered != numel:
                raise fmt.CheckpointError(f"the saved blocks of {metas[i][0]!r} cover {covered} of {numel} elements")
            meta = fmt.tensor_meta(metas[i][1][0], value.dtype, offsets[i], saved)
        entries.append(fmt.make_entry(path, meta, value))
    fmt.commit_index(directory, fmt.make_index(token, size, entries))


# --- load ----------------------------------------------------------------------------------------------
def _check_target(index_entries: dict, gathered: list[list[tuple]]) -> None:
    errors = []
    for metas in gathered:
        for key, meta in metas:
            entry = index_entries.get(key)
            if entry is None:
                errors.append(f"missing key {key!r} in the checkpoint")
            elif (meta is None) != ("tensor" not in entry):
                kinds = ("a value", "a tensor")
                errors.append(f"{key!r} is {kinds[meta is not None]} in the state dict but "
                              f"{kinds['tensor' in entry]} in the checkpoint")
            elif meta is not None:
                saved = entry["tensor"]
                if list(meta[0]) != saved["shape"]:
                    errors.append(f"shape mismatch for {key!r}: checkpoint {tuple(saved['shape'])}, "
                                  f"state dict {tuple(meta[0])}")
                if meta[1] != saved["dtype"]:
                    errors.append(f"dtype mismatch for {key!r}: checkpoint {saved['dtype']}, state dict {meta[1]}")
    _raise_if(errors)


def _destination(t: torch.Tensor) -> tuple[torch.Tensor, np.ndarray, bool]:
    """The local tensor to fill, a byte buffer to read into, and whether the buffer is it."""
    local = (t._local_tensor if isinstance(t, DTensor) else t).detach()
    if local.device.type == "cpu" and local.is_contiguous():
        return local, local.reshape(-1).view(torch.uint8).numpy(), True
    return local, np.empty(local.numel() * local.element_size(), np.uint8), False


def load(state_dict: Any, checkpoint_id: str | os.PathLike, *, comm: MPI.Intracomm | None = None) -> None:
    """Fill ``state_dict`` in place from the checkpoint ``checkpoint_id``: tensors are
    copied into (each rank's part of its layout), other values replaced. Collective."""
    comm = MPI.COMM_WORLD if comm is None else comm
    directory = os.fspath(checkpoint_id)
    leaves = list(fmt.flatten(state_dict))
    index = error = None
    if comm.rank == 0:
        try:
            index = fmt.read_index(directory)
        except Exception as err:  # noqa: BLE001  (raised on every rank below)
            error = err
    index, error = comm.bcast((index, error), root=0)
    if error is not None:
        raise error
    entries = {e["key"]: e for e in index["entries"]}
    metas = [_leaf_meta(p, v) for p, v in leaves]
    gathered = comm.allgather(metas)
    _check_target(entries, gathered)
    for (path, t), (key, _) in zip(leaves, metas):
        if isinstance(t, DTensor) and any(p.is_partial() for p in t.placements):
            raise fmt.CheckpointError(f"cannot load into {key!r}: its placements {t.placements} hold Partial values")

    todo, fills, checks = [], [], []
    for i, ((path, t), (key, meta)) in enumerate(zip(leaves, metas)):
        if meta is None:
            continue
        saved = entries[key]["tensor"]
        boxes = [g[i][1][2] for g in gathered]
        start, shape = boxes[comm.rank]
        local, buf, direct = _destination(t)
        fills.append((local, buf, direct))
        todo += io.pieces(saved["offset"], saved["shape"], start, shape, local.element_size(), buf)
        for b, block in enumerate(saved["blocks"]):
            box = (tuple(block["start"]), tuple(block["shape"]))
            checker = boxes.index(box) if box in boxes else (i + b) % comm.size
            if checker != comm.rank:
                continue
            if box == (start, shape):
                checks.append((key, block, buf))
            else:
                extra = np.empty(int(np.prod(box[1], dtype=np.int64)) * local.element_size(), np.uint8)
                todo += io.pieces(saved["offset"], saved["shape"], *box, local.element_size(), extra)
                checks.append((key, block, extra))
    io.read_pieces(os.path.join(directory, index["data_file"]), comm, todo)

    for local, buf, direct in fills:
        if not direct:
            local.copy_(torch.from_numpy(buf).view(local.dtype).reshape(local.shape))
    bad = [f"checksum mismatch in tensor {key!r} (block at {block['start']})"
           for key, block, buf in checks if fmt.crc32(buf) != block["crc32"]]
    _raise_if([msg for rank_bad in comm.allgather(bad) for msg in rank_bad])
    values = {path: fmt.decode_value(entries[key]) for (path, _), (key, meta) in zip(leaves, metas) if meta is None}
    if values:
        _fill_values(state_dict, (), values)


def _fill_values(node: Any, path: tuple, values: dict) -> Any:
    """``node`` with the leaves at the paths of ``values`` replaced; dicts and lists are
    updated in place, tuples rebuilt."""
    if isinstance(node, dict) and node:
        for key in list(node):
            kind = "d" if isinstance(key, str) else "i"
            node[key] = _fill_values(node[key], path + ((kind, key),), values)
        return node
    if isinstance(node, (list, tuple)) and node:
        kind = "l" if isinstance(node, list) else "t"
        items = [_fill_values(v, path + ((kind, i),), values) for i, v in enumerate(node)]
        if isinstance(node, list):
            node[:] = items
            return node
        return tuple(items)
    return values.get(path, node)
