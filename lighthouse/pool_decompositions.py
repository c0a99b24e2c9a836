"""The backward of a 1-D or 2-D average pooling as a convolution, which torch-mlir lowers (it
has no lowering of `aten.avg_pool2d_backward`; avg_pool1d differentiates through the 2-D
one).

For y = avg_pool(x) (windows K, stride s, padding p, floor mode; x [.., C, *I], y [.., C, *O])
each window's sum is divided by D: K's volume (count_include_pad), the count of its
elements inside x (otherwise), or divisor_override. Then
    dx[c, i] = sum over the windows o holding i of dy[c, o] / D[o]
             = conv_transpose(dy / D, ones [C, 1, *K], stride s, padding p, groups C)
with output_padding (I + 2p - K) mod s: the part of I the windows did not reach. Every x
element outside all windows gets 0. The counts of the count_include_pad=False form are the
same pooling of ones with padding counted, times K's volume, divided by it of ones.
ceil_mode (windows past x's end) and the 3-D pooling (torch-mlir cannot lower a transposed
3-D depthwise convolution either) are left to torch-mlir, which refuses them.

torch-mlir lowers poolings of batched inputs only: an unbatched one ([C, *I]) is pooled as
a batch of one.

An adaptive max pooling whose windows are not evenly spaced (37 -> 5: windows start at
floor(o I / O) and end at ceil((o + 1) I / O)) made torch-mlir's kernel abort at run time
("only support cases with fixed stride size"). Such a pooling gathers each window, padded
to the longest by repeating its last row and column (which changes neither the maximum nor
the first index of it), and reduces it: the value by amax (NaN propagates), the index by
argmax, or where the maximum is NaN by the last NaN in the window's row-major order, as
torch's loop moves to every NaN.
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten


def _avg_pool2d_backward(grad_output, input, kernel_size, stride, padding, ceil_mode,
                         count_include_pad, divisor_override):
    if ceil_mode:
        return NotImplemented
    rank = 2
    kernel = list(kernel_size) * (rank // len(kernel_size))
    stride = list(stride or kernel) * (rank // max(len(stride or kernel), 1))
    padding = list(padding) * (rank // len(padding))
    image = list(input.shape[-rank:])
    channels = input.shape[-rank - 1]
    batched = input.dim() == rank + 2
    dy = grad_output if batched else grad_output.unsqueeze(0)
    if divisor_override:
        dy = dy / divisor_override
    elif count_include_pad or not any(padding):
        dy = dy / math.prod(kernel)
    else:
        inside = torch.ones([1, 1, *image], dtype=dy.dtype, device=dy.device)
        counts = aten.avg_pool2d.default(inside, kernel, stride, padding, False, True, None) * math.prod(kernel)
        dy = dy / counts
    ones = torch.ones([channels, 1, *kernel], dtype=dy.dtype, device=dy.device)
    output_padding = [(i + 2 * p - k) % s for i, p, k, s in zip(image, padding, kernel, stride)]
    dx = aten.convolution.default(dy, ones, None, stride, padding, [1] * rank, True,
                                  output_padding, channels)
    return dx if batched else dx.squeeze(0)


def _batch_of_one(op, rank: int):
    def pooled(input, *args):
        if input.dim() != rank + 1:
            return NotImplemented
        return op(input.unsqueeze(0), *args).squeeze(0)
    return pooled


def unbatched_pool_decompositions() -> dict:
    """{aten.avg_pool2d / avg_pool3d / max_pool2d / max_pool3d: an unbatched input pooled as
    a batch of one}."""
    return {op: _batch_of_one(op, rank) for op, rank in (
        (aten.avg_pool2d.default, 2), (aten.avg_pool3d.default, 3),
        (aten.max_pool2d.default, 2), (aten.max_pool3d.default, 3))}


def _windows(size: int, out: int):
    """[out, K] indices of each adaptive window, the last repeated to the longest's K."""
    starts = [(o * size) // out for o in range(out)]
    ends = [-((-(o + 1) * size) // out) for o in range(out)]
    longest = max(e - s for s, e in zip(starts, ends))
    even = len({e - s for s, e in zip(starts, ends)}) == 1 and \
        len({b - a for a, b in zip(starts, starts[1:])}) <= 1
    o = torch.arange(out).unsqueeze(1)
    start = (o * size) // out
    end = -((-(o + 1) * size) // out)
    return torch.minimum(start + torch.arange(longest), end - 1), longest, even


def _adaptive_max_pool2d_uneven(input, output_size):
    height, width = input.shape[-2:]
    rows, kh, even_rows = _windows(height, output_size[0])
    cols, kw, even_cols = _windows(width, output_size[1])
    if even_rows and even_cols:
        return NotImplemented
    oh, ow = output_size
    lead = list(input.shape[:-2])
    picked = input.index_select(-2, rows.flatten()).index_select(-1, cols.flatten())
    order = list(range(len(lead))) + [len(lead) + i for i in (0, 2, 1, 3)]
    windows = picked.view(lead + [oh, kh, ow, kw]).permute(order).reshape(lead + [oh, ow, kh * kw])
    values = windows.amax(-1)
    first = windows.argmax(-1)
    last = kh * kw - 1 - windows.flip(-1).argmax(-1)
    chosen = torch.where(torch.isnan(values), last, first)
    flat = (rows.view(oh, 1, kh, 1) * width + cols.view(1, ow, 1, kw)).reshape(oh, ow, kh * kw)
    indices = torch.gather(flat.expand(lead + [oh, ow, kh * kw]), -1, chosen.unsqueeze(-1))
    return values, indices.squeeze(-1)


def _adaptive_max_pool2d_backward(grad_output, input, indices):
    flat = grad_output.new_zeros(list(input.shape[:-2]) + [input.shape[-2] * input.shape[-1]])
    dx = flat.scatter_add(-1, indices.flatten(-2), grad_output.flatten(-2))
    return dx.view(input.shape)


def adaptive_pool_decompositions() -> dict:
    """{aten.adaptive_max_pool2d: gathered windows, where they are not evenly spaced; its
    backward: a scatter_add at the indices}."""
    return {aten.adaptive_max_pool2d.default: _adaptive_max_pool2d_uneven,
            aten.adaptive_max_pool2d_backward.default: _adaptive_max_pool2d_backward}


def pool_decompositions() -> dict:
    """{aten.avg_pool2d_backward: a transposed depthwise convolution} and the unbatched
    poolings."""
    return {aten.avg_pool2d_backward.default: _avg_pool2d_backward,
            **unbatched_pool_decompositions(), **adaptive_pool_decompositions()}


__all__ = ["adaptive_pool_decompositions", "pool_decompositions",
           "unbatched_pool_decompositions"]
