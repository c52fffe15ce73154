"""Attention of one query block on one key/value block, with the log-sum-exp of each row.

Ring attention computes a rank's output block by block and merges the partial results
by their log-sum-exp (:func:`merge`); its backward gives each block the *global* output
and log-sum-exp, so that every block's gradient is exact. The kernels:

* ``cpu_flash``: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward
  (grouped heads and additive masks natively);
* ``cuda_flash`` / ``cuda_efficient``: the CUDA flash and memory-efficient kernels
  (grouped heads expanded, masks on the efficient kernel only);
* ``math``: matmuls and an explicit softmax in float32 (float64 for float64), for what
  the kernels refuse (a value head dim unlike the query's, a backend the user disabled).

The backend is what ``scaled_dot_product_attention`` itself would pick for the local blocks
(``torch._fused_sdp_choice``), so ``torch.nn.attention.sdpa_kernel`` applies as usual.
Log-sum-exps are float32 (float64 for float64 inputs); a row that sees no key in a block
has log-sum-exp ``-inf`` there and contributes nothing to the merge. The saved global
log-sum-exp of a row that sees no key at all is 0, the kernels' own convention, which
makes its output and gradients 0 as in plain ``scaled_dot_product_attention``.
"""
from __future__ import annotations

from typing import Literal

import torch
from torch.nn.attention import SDPBackend

Backend = Literal["cpu_flash", "cuda_flash", "cuda_efficient", "math"]

_aten = torch.ops.aten


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial outputs, log-sum-exps and gradients are accumulated in."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def choose_backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                   is_causal: bool, scale: float, enable_gqa: bool) -> Backend:
    """The kernel ``scaled_dot_product_attention`` would use for these blocks."""
    choice = torch._fused_sdp_choice(query, key, value, attn_mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa)
    if query.is_cuda:
        if query.shape[-1] % 8 or value.shape[-1] % 8:  # sdpa pads such head dims for these kernels; we do not
            return "math"
        if choice == int(SDPBackend.FLASH_ATTENTION) and attn_mask is None:
            return "cuda_flash"
        if choice in (int(SDPBackend.EFFICIENT_ATTENTION), int(SDPBackend.CUDNN_ATTENTION)):
            return "cuda_efficient"
        return "math"
    return "cpu_flash" if choice == int(SDPBackend.FLASH_ATTENTION) else "math"


def mask_dtype(backend: Backend, dtype: torch.dtype) -> torch.dtype:
    """The dtype a block's additive mask must have for ``backend`` on ``dtype`` inputs."""
    return accumulation_dtype(dtype) if backend == "math" else dtype


def block_forward(backend: Backend, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  mask: torch.Tensor | None, is_causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output, log-sum-exp)`` of ``query`` attending to ``key``/``value`` ([B, H, S, D]
    each, fewer key/value heads when grouped); ``mask`` is additive, ``is_causal`` top-left."""
    if backend == "math":
        return _math_forward(query, key, value, mask, is_causal, scale)
    if backend == "cpu_flash":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, attn_mask=mask, scale=scale)
    else:
        groups = query.shape[1] // key.shape[1]
        key, value = _expand_heads(key, groups), _expand_heads(value, groups)
        if backend == "cuda_flash":
            out, lse, *_ = _aten._scaled_dot_product_flash_attention(query, key, value, 0.0, is_causal, False,
                                                                     scale=scale)
        else:
            out, lse, *_ = _aten._scaled_dot_product_efficient_attention(
                query, key, value, _aligned_bias(mask, query, key), True, 0.0, is_causal, scale=scale)
            lse = lse[..., :query.shape[2]]  # padded to a multiple of 32 rows
    if mask is not None:  # the kernels give 0, not -inf, for a row the mask hides entirely
        lse = lse.masked_fill(torch.isneginf(mask).all(-1).expand(lse.shape), float("-inf"))
    return out, lse


def block_backward(backend: Backend, grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor | None,
                   is_causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients wrt ``query``, ``key``, ``value`` of one block, given the global ``out``
    and finite global ``lse`` of the query rows (see the module docstring)."""
    if backend == "math":
        return _math_backward(grad_out, query, key, value, out, lse, mask, is_causal, scale)
    if backend == "cpu_flash":
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale)
    groups = query.shape[1] // key.shape[1]
    key, value = _expand_heads(key, groups), _expand_heads(value, groups)
    # dropout is off: the random generator state the kernels take is never read
    seed = torch.zeros(2, dtype=torch.uint64, device=query.device)
    offset = torch.zeros((), dtype=torch.uint64, device=query.device)
    if backend == "cuda_flash":  # dense inputs: no cumulative sequence lengths (None, as forward gives)
        grads = _aten._scaled_dot_product_flash_attention_backward(
            grad_out, query, key, value, out, lse, None, None, query.shape[2], key.shape[2], 0.0, is_causal,
            seed, offset, scale=scale)
    else:
        padded = -(-query.shape[2] // 32) * 32
        lse = torch.nn.functional.pad(lse, (0, padded - lse.shape[-1])).contiguous()
        grads = _aten._scaled_dot_product_efficient_attention_backward(
            grad_out, query, key, value, _aligned_bias(mask, query, key), out, lse, seed, offset, 0.0,
            [True, True, True, False], is_causal, scale=scale)
    grad_query, grad_key, grad_value = grads[:3]
    return grad_query, _fold_heads(grad_key, groups), _fold_heads(grad_value, groups)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's ``(block_out, block_lse)`` into the running ``(out, lse)`` in place
    (accumulation dtype); rows with ``-inf`` on both sides stay 0 and ``-inf``."""
    merged = torch.logaddexp(lse, block_lse)
    base = merged.masked_fill(torch.isneginf(merged), 0.0)
    out.mul_(torch.exp(lse - base).unsqueeze(-1))
    out.add_(block_out * torch.exp(block_lse - base).unsqueeze(-1))
    lse.copy_(merged)


def _aligned_bias(mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """``mask`` expanded to [B, H, Sq, Skv] with rows 16-element aligned, as the CUDA
    memory-efficient kernel requires of its bias (what sdpa does before calling it)."""
    if mask is None:
        return None
    length = mask.shape[-1]
    padded = torch.nn.functional.pad(mask, (0, -length % 16))[..., :length]
    return padded.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])


def _expand_heads(tensor: torch.Tensor, groups: int) -> torch.Tensor:
    """Key/value heads repeated for each of the ``groups`` query heads that share them."""
    if groups == 1:
        return tensor
    batch, heads, length, dim = tensor.shape
    return tensor.unsqueeze(2).expand(batch, heads, groups, length, dim).reshape(batch, heads * groups, length, dim)


def _fold_heads(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of :func:`_expand_heads`: the sum over each group of query heads."""
    if groups == 1:
        return grad
    batch, heads, length, dim = grad.shape
    return grad.view(batch, heads // groups, groups, length, dim).sum(2)


def _scores(query, key, mask, is_causal, scale) -> torch.Tensor:
    """Scaled, masked ``query @ key^T`` in the accumulation dtype (key heads expanded)."""
    dtype = accumulation_dtype(query.dtype)
    scores = torch.matmul(query.to(dtype), key.to(dtype).transpose(-2, -1)).mul_(scale)
    if mask is not None:
        scores.add_(mask)
    if is_causal:
        visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        scores.masked_fill_(~visible, float("-inf"))
    return scores


def _math_forward(query, key, value, mask, is_causal, scale) -> tuple[torch.Tensor, torch.Tensor]:
    groups = query.shape[1] // key.shape[1]
    scores = _scores(query, _expand_heads(key, groups), mask, is_causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1))
    return torch.matmul(probs, _expand_heads(value, groups).to(probs.dtype)), lse


def _math_backward(grad_out, query, key, value, out, lse, mask, is_causal, scale):
    groups = query.shape[1] // key.shape[1]
    key, value = _expand_heads(key, groups), _expand_heads(value, groups)
    probs = torch.exp(_scores(query, key, mask, is_causal, scale) - lse.unsqueeze(-1))
    dtype = probs.dtype
    grad_out = grad_out.to(dtype)
    grad_value = torch.matmul(probs.transpose(-2, -1), grad_out)
    grad_probs = torch.matmul(grad_out, value.to(dtype).transpose(-2, -1))
    grad_scores = probs.mul_(grad_probs.sub_((grad_out * out.to(dtype)).sum(-1, keepdim=True)))
    grad_query = torch.matmul(grad_scores, key.to(dtype)).mul_(scale)
    grad_key = torch.matmul(grad_scores.transpose(-2, -1), query.to(dtype)).mul_(scale)
    return grad_query, _fold_heads(grad_key, groups), _fold_heads(grad_value, groups)
