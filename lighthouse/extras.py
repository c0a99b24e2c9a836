"""torch references of the results a schedule appends to the model's own (`--check` compares
them too).

lse (attention, LIGHTHOUSE return_lse=True): per query row, log sum_j exp(s_ij) of the
scores s = scale * q k^T with the causal and given masks applied (-inf where masked; -inf on
a fully masked row), in the dtype of q, shaped like the attention output without its last
dim. It is recomputed from the arguments of the model's one
`F.scaled_dot_product_attention` call, or, for attention written by hand, from the input of
its one softmax (lse = logsumexp(input, dim)), both recorded while torch runs the forward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .errors import CheckFailed

_SOFTMAX = (torch.softmax, torch.Tensor.softmax, F.softmax)


def sdpa_log_sum_exp(query, key, value=None, attn_mask=None, dropout_p=0.0, is_causal=False,
                     scale=None, enable_gqa=False):
    """The lse of `F.scaled_dot_product_attention` with these arguments (f32 math)."""
    q, k = query.float(), key.float()
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    rows, cols = scores.shape[-2:]
    if is_causal:
        keep = torch.ones(rows, cols, dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.float()
    return torch.logsumexp(scores, dim=-1).to(query.dtype)


class _RecordAttention(TorchFunctionMode):
    """Records the lse of each SDPA call and of each softmax's input while torch runs."""

    def __init__(self):
        super().__init__()
        self.sdpa: list[torch.Tensor] = []
        self.softmax: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.sdpa.append(sdpa_log_sum_exp(*args, **kwargs))
        elif func in _SOFTMAX:
            x = args[0]
            dim = kwargs.get("dim", args[1] if len(args) > 1 else -1)
            self.softmax.append(torch.logsumexp(x.float(), dim=dim).to(x.dtype))
        return func(*args, **kwargs)


def attention_log_sum_exp(model: torch.nn.Module, inputs: tuple) -> torch.Tensor:
    """The lse of the model's one attention (see the module docstring)."""
    recorder = _RecordAttention()
    with torch.no_grad(), recorder:
        model(*inputs)
    found = recorder.sdpa or recorder.softmax
    if len(found) != 1:
        raise CheckFailed(f"the lse result has no torch reference: the forward has "
                          f"{len(recorder.sdpa)} scaled_dot_product_attention and "
                          f"{len(recorder.softmax)} softmax calls (wants one attention)")
    return found[0]


REFERENCES = {"lse": attention_log_sum_exp}
