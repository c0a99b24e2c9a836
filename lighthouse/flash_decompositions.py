"""Decompositions of torch's CPU flash-attention ops into the graph the attention family takes.

Traced with torch's flash backend allowed, `F.scaled_dot_product_attention` under autograd
becomes `aten._scaled_dot_product_flash_attention_for_cpu` (the forward: output and per-row
log-sum-exp) and, in the backward, `..._for_cpu_backward` (torch takes its math backend
instead for float masks that need a gradient and for inputs of rank 3). Both are
decomposed here, in the FlashAttention-2 form:

    forward:   O = softmax(S) V with the math backend's graph (S = (Q c^1/2)(K^T c^1/2)
               [+ mask], fully masked rows 0), lse = log sum_j exp(S_ij)
    backward:  S = c Q K^T [+ mask],  lse = log sum_j exp(S_ij),
               P = exp(S - lse) (0 where lse = -inf),  D = rowsum(dO * O),
               dV = P^T dO,  dP = dO V^T,  dS = P (dP - D),  dQ = c dS K,  dK = c dS^T Q

Masks are added to the scores (a bool mask as 0 / -inf, as torch does). The backward
recomputes lse from S instead of reading the forward's: the forward's graph stays the one the
forward schedule fuses (its lse is unread and folds away), and
transform_ext.fuse_attention_backward computes lse in a first loop over the key tiles. f16/bf16
inputs are computed in f32 and the gradients rounded once. Grouped-query attention (K and V
with fewer heads) reads each kv head once per query head of its group; dK and dV sum over it.
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten


def _scale(query: torch.Tensor, scale: float | None) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])


def _masked_scores(scores: torch.Tensor, is_causal: bool, attn_mask) -> torch.Tensor:
    """Scores with torch's mask semantics, each mask added: causal keeps key <= query
    (top-left aligned), a bool mask keeps True (0 / -inf), a float mask is added."""
    if is_causal:
        rows, cols = scores.shape[-2:]
        keep = torch.ones(rows, cols, dtype=torch.bool, device=scores.device).tril(diagonal=0)
        scores = scores + torch.where(keep, 0.0, float("-inf")).to(scores.dtype)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.where(attn_mask, 0.0, float("-inf"))
        scores = scores + attn_mask.to(scores.dtype)
    return scores


def flash_forward(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                  scale=None):
    """aten._scaled_dot_product_flash_attention_for_cpu: (O, lse [B, H, L] f32)."""
    if dropout_p != 0.0:
        return NotImplemented
    gqa = query.shape[-3] != key.shape[-3]
    out = aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, 0.0, is_causal, None, scale=scale, enable_gqa=gqa)[0]
    c = _scale(query, scale)
    key = _repeat_kv_heads(key, query.shape[-3])
    scores = torch.matmul(query.float(), key.float().transpose(-2, -1)) * c
    lse = torch.logsumexp(_masked_scores(scores, is_causal, attn_mask), -1)
    return out, lse


def flash_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                   attn_mask=None, scale=None):
    """aten._scaled_dot_product_flash_attention_for_cpu_backward: (dQ, dK, dV), lse
    recomputed from the scores (see the module docstring)."""
    return _flash_backward(grad_out, query, key, value, out, None, dropout_p, is_causal,
                           attn_mask=attn_mask, scale=scale)


def flash_backward_given_lse(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal,
                             *, attn_mask=None, scale=None):
    """The same, reading the forward's lse ([..., L] f32) instead of recomputing it: for a
    forward that computed it (lighthouse.decompose: an f32 attention's kernel returns it)."""
    return _flash_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal,
                           attn_mask=attn_mask, scale=scale)


def _flash_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                    attn_mask=None, scale=None):
    if dropout_p != 0.0:
        return NotImplemented
    dtype = query.dtype
    heads, kv_heads = query.shape[-3], key.shape[-3]
    q = query.float()
    k, v = (_repeat_kv_heads(t, heads).float() for t in (key, value))
    do, o = grad_out.float(), out.float()
    c = _scale(query, scale)
    scores = _masked_scores(torch.matmul(q, k.transpose(-2, -1)) * c, is_causal, attn_mask)
    if logsumexp is None:
        lse = torch.logsumexp(scores, -1, keepdim=True)
    else:
        lse = logsumexp.float().unsqueeze(-1)
    p = torch.where(lse == float("-inf"), 0.0, torch.exp(scores - lse))
    dv = torch.matmul(p.transpose(-2, -1), do)
    dp = torch.matmul(do, v.transpose(-2, -1))
    d = (do * o).sum(-1, keepdim=True)
    ds = p * (dp - d)
    dq = torch.matmul(ds, k) * c
    dk = torch.matmul(ds.transpose(-2, -1), q) * c
    dk, dv = (_sum_kv_groups(t, kv_heads) for t in (dk, dv))
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)


def _repeat_kv_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., Hkv, S, E] -> [..., heads, S, E], query head h reading kv head h // (heads / Hkv)
    (grouped-query attention; the tensor itself when the heads agree)."""
    kv = t.shape[-3]
    if kv == heads:
        return t
    grouped = t.unsqueeze(-3).expand(*t.shape[:-2], heads // kv, *t.shape[-2:])
    return grouped.reshape(*t.shape[:-3], heads, *t.shape[-2:])


def _sum_kv_groups(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of `_repeat_kv_heads`: [..., H, S, E] summed over each kv head's group."""
    heads = t.shape[-3]
    if heads == kv_heads:
        return t
    return t.reshape(*t.shape[:-3], kv_heads, heads // kv_heads, *t.shape[-2:]).sum(-3)


class SdpaIn4d(torch.overrides.TorchFunctionMode):
    """`F.scaled_dot_product_attention` of [batch, L, E] inputs traced as the same call on
    [1, batch, L, E] (exact): torch takes its flash backend for 4-D inputs only, and the
    math backend's backward keeps the L x S probabilities."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention and len(args) >= 3 \
                and all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in args[:3]):
            args = [t.unsqueeze(0) for t in args[:3]] + list(args[3:])
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            if isinstance(mask, torch.Tensor) and mask.dim() == 3:
                if "attn_mask" in kwargs:
                    kwargs = {**kwargs, "attn_mask": mask.unsqueeze(0)}
                else:
                    args[3] = mask.unsqueeze(0)
            return func(*args, **kwargs).squeeze(0)
        return func(*args, **kwargs)


def flash_decompositions() -> dict:
    return {aten._scaled_dot_product_flash_attention_for_cpu.default: flash_forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default: flash_backward}
