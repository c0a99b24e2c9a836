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


def pool_decompositions() -> dict:
    """{aten.avg_pool2d_backward: a transposed depthwise convolution} and the unbatched
    poolings."""
    return {aten.avg_pool2d_backward.default: _avg_pool2d_backward,
            **unbatched_pool_decompositions()}


__all__ = ["pool_decompositions", "unbatched_pool_decompositions"]
