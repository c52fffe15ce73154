"""How ``Shard`` cuts a dim, in the forms torch's ``Shard`` helpers return (frameworks call
them: transformers' weight loading, torch's ``_utils`` and tests): sizes and offsets of
``torch.chunk``'s pieces, and the padded pieces torch's collectives send."""
from __future__ import annotations

import torch

__all__ = ["shard_size_and_offset", "shard_size_on_dim", "split_tensor"]


def shard_size_and_offset(size: int, num_chunks: int, rank: int) -> tuple[int, int]:
    """``torch.chunk``'s piece ``rank`` of ``num_chunks`` of a dim of ``size``: its size and
    offset (an offset past the end is clamped to ``size``, as torch's)."""
    if size % num_chunks == 0:
        full = size // num_chunks
        return full, full * rank
    full = (size + num_chunks - 1) // num_chunks
    start = full * rank
    return max(0, min(size, start + full) - start), min(size, start)


def shard_size_on_dim(size: int, num_chunks: int, rank: int, return_offset: bool = False) -> tuple[int, int]:
    """torch <= 2.7's ``Shard._local_shard_size_on_dim``: as :func:`shard_size_and_offset`,
    but an offset of -1 unless ``return_offset``, and ``size`` as the offset of an empty
    piece past the end."""
    if size % num_chunks == 0:
        full = size // num_chunks
        return full, full * rank if return_offset else -1
    full = (size + num_chunks - 1) // num_chunks
    start = full * rank
    if size < start:
        return 0, size if return_offset else -1
    return min(size, start + full) - start, start if return_offset else -1


def split_tensor(tensor: torch.Tensor, dim: int, num_chunks: int, with_padding: bool,
                 contiguous: bool) -> tuple[list[torch.Tensor], list[int]]:
    """torch's ``Shard._split_tensor``: the pieces (``num_chunks`` of them, empty ones
    added) and, when padding, each piece padded at its end to the largest one's size, with
    the pads (empty list without padding)."""
    if dim > tensor.ndim:
        raise AssertionError(f"Sharding dim {dim} greater than tensor ndim {tensor.ndim}")
    pieces = list(torch.chunk(tensor, num_chunks, dim=dim))
    if len(pieces) < num_chunks:
        empty = list(pieces[0].shape)
        empty[dim] = 0
        pieces.extend(pieces[0].new_zeros(empty) for _ in range(num_chunks - len(pieces)))
    full = (tensor.size(dim) + num_chunks - 1) // num_chunks
    out, pads = [], []
    for piece in pieces:
        if with_padding:
            pad = full - piece.size(dim)
            pads.append(pad)
            if pad:
                widths = [0, 0] * (piece.ndim - dim)
                widths[-1] = pad
                piece = torch.nn.functional.pad(piece, widths)
        out.append(piece.contiguous() if contiguous else piece)
    return out, pads
