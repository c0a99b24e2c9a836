"""Decompositions of torch's CPU flash-attention ops into the graph the attention family takes.

Traced with torch's flash backend allowed, `F.scaled_dot_product_attention` under autograd
becomes `aten._scaled_dot_product_flash_attention_for_cpu` (the forward: output and per-row
log-sum-exp) and, in the backward, `..._for_cpu_backward` (torch takes its math backend
instead for float masks that need a gradient and for inputs of rank 3). Both are
decomposed here, in the FlashAttention-2 form:

    forward:   O = softmax(S) V with the math backend's graph (S = (Q c^1/2)(K^T c^1/2)
               [+ mask], fully masked rows 0), lse = log sum_j exp(S_ij)
    backward:  S = c Q K^T [+ mask],  lse = log sum_j exp(S_ij),
               P = exp(S - lse) (0 where lse = -inf),
               D = rowsum(dO * O) (rowsum(P * dP) for f16/bf16 with a mask gradient,
               as torch's math backend: O is rounded),
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

from .partition import register_anchor

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
                    attn_mask=None, scale=None, mask_grad=False):
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
    # D_i = sum_j P_ij dP_ij = dO_i . O_i. torch's flash backward takes the dot product with
    # the rounded O; its math backend (the masks with a gradient) sums P dP, and so do we
    # there: with O rounded to f16/bf16, dS = P (dP - D) is off by far more where dP and D
    # nearly cancel
    exact_d = mask_grad and dtype != torch.float32
    d = (p * dp if exact_d else do * o).sum(-1, keepdim=True)
    ds = p * (dp - d)
    dq = torch.matmul(ds, k) * c
    dk = torch.matmul(ds.transpose(-2, -1), q) * c
    dk, dv = (_sum_kv_groups(t, kv_heads) for t in (dk, dv))
    if mask_grad:  # the mask is added to the scores: its gradient is dS, summed where broadcast
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), \
            _sum_to(ds, attn_mask.shape).to(attn_mask.dtype)
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)


def _sum_to(t: torch.Tensor, shape) -> torch.Tensor:
    """`t` summed over the dims a tensor of `shape` is broadcast along to `t`'s shape."""
    lead = t.dim() - len(shape)
    dims = list(range(lead)) + [lead + i for i, n in enumerate(shape)
                                if n == 1 and t.shape[lead + i] != 1]
    return t.sum(dims, keepdim=True).reshape(shape) if dims else t


@torch.library.custom_op("lighthouse::attention_masked", mutates_args=())
def attention_masked(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attn_mask: torch.Tensor, is_causal: bool, scale: float | None,
                     enable_gqa: bool) -> torch.Tensor:
    """F.scaled_dot_product_attention with an additive float mask that needs a gradient:
    torch's own would take its math backend and keep the L x S probabilities; this op
    decomposes into the flash forward (O), and its backward (AttentionMasked) into
    `attention_masked_backward` (dQ, dK, dV and the mask's gradient)."""
    # contiguous, as the fake below: torch lays the output out like a transposed query,
    # and a reshape traced against the fake's strides would view the real one wrongly
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa).contiguous()


@attention_masked.register_fake
def _(query, key, value, attn_mask, is_causal, scale, enable_gqa):
    return query.new_empty(*query.shape[:-1], value.shape[-1])


@torch.library.custom_op("lighthouse::attention_masked_backward", mutates_args=())
def attention_masked_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, out: torch.Tensor, attn_mask: torch.Tensor,
                              is_causal: bool, scale: float | None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV, d mask) of `attention_masked`, in the FlashAttention-2 form."""
    return tuple(t.clone() for t in _flash_backward(
        grad_out, query, key, value, out, None, 0.0, is_causal, attn_mask=attn_mask,
        scale=scale, mask_grad=True))


@attention_masked_backward.register_fake
def _(grad_out, query, key, value, out, attn_mask, is_causal, scale):
    return (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value),
            torch.empty_like(attn_mask))


class AttentionMasked(torch.autograd.Function):
    """`lighthouse::attention_masked` with its backward `lighthouse::attention_masked_backward`
    (a Function with setup_context: torch.func.vjp, as `--backward` traces, and AOTAutograd
    both take it)."""

    @staticmethod
    def forward(query, key, value, attn_mask, is_causal, scale, enable_gqa):
        return torch.ops.lighthouse.attention_masked(query, key, value, attn_mask, is_causal,
                                                     scale, enable_gqa)

    @staticmethod
    def setup_context(ctx, inputs, output):
        query, key, value, attn_mask, is_causal, scale, _ = inputs
        ctx.is_causal, ctx.scale = is_causal, scale
        ctx.save_for_backward(query, key, value, attn_mask, output)

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, attn_mask, out = ctx.saved_tensors
        dq, dk, dv, dmask = torch.ops.lighthouse.attention_masked_backward(
            grad_out, query, key, value, out, attn_mask, ctx.is_causal, ctx.scale)
        return dq, dk, dv, dmask, None, None, None


register_anchor(torch.ops.lighthouse.attention_masked.default, "attention")
register_anchor(torch.ops.lighthouse.attention_masked_backward.default, "attention_backward")


def _attention_masked_forward(query, key, value, attn_mask, is_causal, scale, enable_gqa):
    return flash_forward(query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0]


def _attention_masked_backward(grad_out, query, key, value, out, attn_mask, is_causal, scale):
    return _flash_backward(grad_out, query, key, value, out, None, 0.0, is_causal,
                           attn_mask=attn_mask, scale=scale, mask_grad=True)


class SdpaMaskGradient(torch.overrides.TorchFunctionMode):
    """`F.scaled_dot_product_attention` with a float mask that needs a gradient traced as
    `lighthouse::attention_masked` (see there), so its backward is the fused one with the
    mask's gradient; other calls as they are."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                     "enable_gqa")
            bound = {**dict(zip(names, args)), **kwargs}
            mask = bound.get("attn_mask")
            if isinstance(mask, torch.Tensor) and mask.is_floating_point() \
                    and mask.requires_grad and not bound.get("dropout_p"):
                return AttentionMasked.apply(
                    bound["query"], bound["key"], bound["value"], mask,
                    bool(bound.get("is_causal", False)), bound.get("scale"),
                    bool(bound.get("enable_gqa", False)))
        return func(*args, **kwargs)


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
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default: flash_backward,
            torch.ops.lighthouse.attention_masked.default: _attention_masked_forward,
            torch.ops.lighthouse.attention_masked_backward.default: _attention_masked_backward}
