"""The native checkpoint format's writer and reader (the default of ``save``/``load``).

Both are collective over ``comm`` and take every decision from data all ranks share:
one ``allgather`` of the leaves' metadata (keys, global shapes, dtypes, the box each
rank holds) comes before any data moves, and errors found there are raised on every
rank.

save: every distinct non-empty box of a tensor is written once, by one of the ranks
holding it (the one with the fewest bytes to write so far, so replicas spread over
the ranks), straight from the local tensor into that rank's own new data file (one
``pwritev`` batch, one fsync); then rank 0 gathers where each block went, with its
CRC-32, and commits the index (see :mod:`.format`), so a save that dies midway
leaves the previous checkpoint as it was. ``Partial`` DTensors are reduced first.
Every rank returns the same torch ``Metadata`` of the save (:func:`_metadata`).

load: each rank reads the box of the target layout it holds from the saved blocks
that overlap it, whatever layout was saved (resharding is box intersection). Each
saved block's CRC-32 is checked once: by a rank whose target box is that block, else
by a rank that reads it for the check.

Tensor subclasses that cannot be viewed as bytes (:mod:`.opaque`) are stored as the
``torch.save`` bytes of each box and loaded only into targets holding saved boxes
(every rank that reads such a block checks its CRC-32).
"""
from __future__ import annotations

import os
from math import prod
from typing import Any

import numpy as np
import torch
from mpi4py import MPI
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from . import format as fmt
from . import collective, io, opaque, shards
from .metadata import describe, gc_paused, start_save, torch_leaves
from .storage import StorageReader, StorageWriter


def _leaf_meta(path: tuple, leaf: Any) -> tuple:
    """(key, None) for a value; (key, (global shape, dtype name, box)) for a tensor."""
    return shards.leaf_meta(fmt.fqn(path), leaf)


class NativeWriter(StorageWriter):
    """Writes mpidtensor's own format (docs/checkpoint-format.md) to the directory ``path``."""

    def write(self, state_dict: Any, comm: MPI.Intracomm) -> Metadata:
        """Write ``state_dict``; its torch ``Metadata`` (see :func:`_metadata`). Collective."""
        return _save(state_dict, self.path, comm)


class NativeReader(StorageReader):
    """Reads mpidtensor's own format (both versions) from the directory ``path``."""

    @classmethod
    def recognizes(cls, path: str | os.PathLike) -> bool:
        return os.path.isfile(os.path.join(os.fspath(path), fmt.INDEX))

    def read(self, state_dict: Any, comm: MPI.Intracomm) -> None:
        _load(state_dict, self.path, comm)


def _save(state_dict: Any, directory: str, comm: MPI.Intracomm) -> Metadata:
    """Write ``state_dict`` to the checkpoint directory ``directory``; its ``Metadata``.
    Collective."""
    leaves = list(fmt.flatten(state_dict))
    token = collective.on_rank0(comm, start_save, directory, state_dict)
    metas = [_leaf_meta(p, v) for p, v in leaves]
    all_metas = shards.gather_metas(metas, comm)
    writers = shards.box_writers(all_metas)
    mine = shards.boxes_to_write(writers, comm.rank)

    todo = []
    for i, (_, value) in enumerate(leaves):  # every rank reduces the Partial DTensors, in the same order
        if metas[i][1] is not None:
            t = shards.reduced(value)
            if i in mine:
                todo.append((i, t))
    path = os.path.join(directory, fmt.data_name(token, comm.rank))
    blocks, error = collective.attempt(_write_blocks, path, todo, metas)
    try:
        stale, pickled = collective.commit_on_rank0(comm, blocks, error,
                                                    lambda written: _commit(directory, token, leaves, metas, written))
    except Exception:
        if todo and os.path.exists(path):
            os.remove(path)  # this save's data file: no index will name it
        raise
    collective.remove_stale(comm, directory, stale)
    return _metadata(state_dict, directory, token, leaves, metas, writers, pickled)


def _write_blocks(path: str, todo: list, metas: list) -> dict[int, dict]:
    """Write this rank's boxes (``todo``: leaf index and tensor) into its new data file
    ``path``: the raw ones in leaf order, then the ``torch.save`` bytes of the opaque ones
    (so that the raw ones' offsets follow from their sizes alone); where each block
    went, with its CRC-32 (and an opaque one's ``nbytes``), by leaf index."""
    raws = [(i, shards.local_bytes(t)) for i, t in todo if metas[i][1][3] is None]
    raws += [(i, opaque.to_bytes(t)) for i, t in todo if metas[i][1][3] is not None]
    offsets = fmt.layout([raw.nbytes for _, raw in raws])
    blocks = {}
    for (i, raw), offset in zip(raws, offsets):
        start, shape = metas[i][1][2]
        blocks[i] = {"start": list(start), "shape": list(shape), "offset": offset, "crc32": fmt.crc32(raw)}
        if metas[i][1][3] is not None:
            blocks[i]["nbytes"] = raw.nbytes
    if raws:
        io.write_file(path, [(offset, raw) for (_, raw), offset in zip(raws, offsets)])
    return blocks


def _commit(directory: str, token: str, leaves: list, metas: list,
            written: list[dict]) -> tuple[list[str], dict[str, list]]:
    """Rank 0: the index from every rank's written blocks, committed; the files it
    supersedes (see format.commit_index) and the opaque leaves' saved chunks for the
    ``Metadata`` (``(box, _StorageInfo)`` by flat key, in the order of the writing ranks)."""
    data_files, by_leaf = [], {}
    for rank, rank_blocks in enumerate(written):
        if rank_blocks:
            for i, block in rank_blocks.items():
                by_leaf.setdefault(i, []).append({**block, "file": len(data_files)})
            data_files.append(fmt.data_name(token, rank))
    entries, pickled = [], {}
    for i, (path, value) in enumerate(leaves):
        meta = None
        if metas[i][1] is not None:
            key, (shape, _, _, cls) = metas[i]
            if cls is not None:
                pickled[key] = [((tuple(b["start"]), tuple(b["shape"])), _StorageInfo(
                    data_files[b["file"]], b["offset"], b["nbytes"])) for b in by_leaf.get(i, [])]
            saved = sorted(by_leaf.get(i, []), key=lambda b: b["start"])
            shards.check_covered(key, shape, [(b["start"], b["shape"]) for b in saved])
            meta = fmt.tensor_meta(shape, value.dtype, saved, cls)
        entries.append(fmt.make_entry(path, meta, value))
    return fmt.commit_index(directory, fmt.make_index(data_files, entries)), pickled


@gc_paused()
def _metadata(state_dict: Any, directory: str, token: str, leaves: list, metas: list,
              writers: list[dict[tuple, int]], pickled: dict[str, list]) -> Metadata:
    """The torch ``Metadata`` of the save, which every rank builds alike from facts they
    share, without a message: which rank wrote each raw block (``writers``) and so where
    (:func:`_write_blocks` lays a rank's raw blocks out first, in leaf order); the opaque
    leaves' chunks (``pickled``, of unknown size before they were written) come with the
    commit's broadcast.

    It describes the state dict as torch flattens it: a tensor leaf's chunks are its
    blocks, in the order of the ranks that wrote them, ``storage_data`` mapping each to
    ``_StorageInfo(data file, offset, length)``: the byte range holding the block's raw
    row-major bytes (no ``torch.save`` framing; an opaque block's ``torch.save`` bytes).
    A value (which the index holds, not a data file) has no ``storage_data`` entry, and
    neither has a tensor inside a value (a tuple, say), which torch would save as one object. ``storage_meta``: the directory
    and the save's token (its data files' names).
    """
    by_rank: dict[int, list] = {}
    for i, leaf_writers in enumerate(writers):
        for box, rank in leaf_writers.items():
            if metas[i][1][3] is None:
                by_rank.setdefault(rank, []).append((i, box))
    chunks: dict[str, list] = dict(pickled)
    for rank in sorted(by_rank):
        sizes = [prod(box[1]) * leaves[i][1].dtype.itemsize for i, box in by_rank[rank]]
        for (i, box), offset, size in zip(by_rank[rank], fmt.layout(sizes), sizes):
            chunks.setdefault(metas[i][0], []).append((box, _StorageInfo(fmt.data_name(token, rank), offset, size)))
    return describe(torch_leaves(state_dict), chunks, {}, StorageMeta(checkpoint_id=directory, save_id=token))


# --- load ----------------------------------------------------------------------------------------------
def _check_target(index_entries: dict, gathered: list[list[tuple]]) -> None:
    """Every rank's targets (``gathered``) fit the index: keys, kinds, shapes, dtypes, and
    an opaque leaf's target is a subclass holding saved boxes (:mod:`.opaque`)."""
    errors, targets = [], {}
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
                cls = saved["class"] if saved.get("encoding") == fmt.TORCH_SAVE else None
                errors.append(opaque.kind_error(key, cls, meta[3]))
                if cls is not None:
                    targets.setdefault(key, []).append(meta[2])
    for key, boxes in targets.items():
        saved = index_entries[key]["tensor"]
        errors.append(opaque.layout_error(key, saved["class"], [(b["start"], b["shape"]) for b in saved["blocks"]],
                                          boxes))
    collective.raise_if([e for e in errors if e])


def _destination(t: torch.Tensor) -> tuple[torch.Tensor, np.ndarray, bool]:
    """The local tensor to fill, a byte buffer to read into, and whether the buffer is it."""
    local = shards.local_tensor(t)
    if local.device.type == "cpu" and local.is_contiguous():
        return local, local.reshape(-1).view(torch.uint8).numpy(), True
    return local, np.empty(local.numel() * local.element_size(), np.uint8), False


def _load_tensor(reader: io.Reader, index: dict, saved: dict, key: str, t: torch.Tensor, i: int,
                 boxes: list, comm: MPI.Intracomm) -> list[str]:
    """Fill this rank's part of ``t`` (leaf ``i``; ``boxes``: every rank's box of it) from
    the saved tensor, check the CRC-32s this rank is in charge of; the mismatches found."""
    if saved.get("encoding") == fmt.TORCH_SAVE:  # the target box is a saved one (_check_target)
        block = next((b for b in saved["blocks"] if (tuple(b["start"]), tuple(b["shape"])) == boxes[comm.rank]), None)
        if block is not None:
            shards.local_tensor(t).copy_(opaque.read_block(reader, index, block, key))
        return []
    stored, box = fmt.chunks(index, saved), boxes[comm.rank]
    local, buf, direct = _destination(t)
    if buf.size:
        io.read_box(reader, stored, box, buf, local.dtype)
        if not direct:
            local.copy_(torch.from_numpy(buf).view(local.dtype).reshape(local.shape))
    bad = []
    for b, block in enumerate(saved["blocks"]):
        check = (tuple(block["start"]), tuple(block["shape"]))
        if (boxes.index(check) if check in boxes else (i + b) % comm.size) != comm.rank:
            continue
        if check == box:
            raw = buf
        else:
            chunk = next((c for c in stored if c.box == check), None)
            if chunk is not None:  # a block stored as it was saved: checked in the file's map
                raw = reader.array(chunk.file, chunk.offset, chunk.nbytes)
            else:  # format version 1: the block is a box of the whole stored tensor
                raw = np.empty(prod(check[1]) * local.dtype.itemsize, np.uint8)
                io.read_box(reader, stored, check, raw, local.dtype)
        if fmt.crc32(raw) != block["crc32"]:
            bad.append(f"checksum mismatch in tensor {key!r} (block at {block['start']})")
    return bad


def _load(state_dict: Any, directory: str, comm: MPI.Intracomm) -> None:
    """Fill ``state_dict`` in place from the checkpoint ``directory``: tensors are
    copied into (each rank's part of its layout), other values replaced. Collective."""
    leaves = list(fmt.flatten(state_dict))
    index = collective.on_rank0(comm, fmt.read_index, directory)
    entries = {e["key"]: e for e in index["entries"]}
    metas = [_leaf_meta(p, v) for p, v in leaves]
    gathered = comm.allgather(metas)
    _check_target(entries, gathered)
    for (_, t), (key, _) in zip(leaves, metas):
        shards.check_loadable(key, t)

    reader, bad, error = io.Reader(directory), [], None
    try:
        for i, ((_, t), (key, meta)) in enumerate(zip(leaves, metas)):
            if meta is not None:
                boxes = [g[i][1][2] for g in gathered]
                bad += _load_tensor(reader, index, entries[key]["tensor"], key, t, i, boxes, comm)
    except Exception as err:  # noqa: BLE001  (raised on every rank below)
        error = err
    finally:
        reader.close()
    outcomes = comm.allgather((bad, error))
    collective.raise_first([e for _, e in outcomes])
    collective.raise_if([msg for rank_bad, _ in outcomes for msg in rank_bad])
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
