"""The backward of a convolution as forward convolutions, for every kind torch-mlir's own
lowering of `aten.convolution_backward` refuses (transposed, grouped).

For y = conv(x, w) (stride s, padding p, dilation d, groups g; x [N, C, *I], w [F, C/g, *K],
y [N, F, *O]) and the output's gradient dy:
    dx = conv_transpose(dy, w)  (same s, p, d, g; output_padding r = the part of I the
         forward's windows did not reach, (I + 2p - d (K - 1) - 1) mod s)
    dw[f, c, k] = sum_{n, o} dy[n, f, o] x[n, c, o s + k d - p]: a convolution of x seen as
         [C/g, g N, *I] (the batch as its channels) with dy seen as [F, N, *O] as the filter
         (groups g, stride d, padding p, dilation s), its first K outputs per image dim
    db = sum_{n, o} dy[n, f, o]
For y = conv_transpose(x, w) (w [C, F/g, *K], y[o] += x[i] w[k] at o = i s + k d - p):
    dx = conv(dy, w)  (same s, p, d, g; its first I outputs: an output padding of the
         stride or more, which a dilation allows, reaches past x)
    dw[c, f, k] = sum_{n, i} x[n, c, i] dy[n, f, i s + k d - p]: a convolution of dy seen as
         [F/g, g N, *O] with x seen as [C, N, *I] as the filter (groups g, stride d, padding
         p, dilation s), its first K outputs
    db as above.
Each is an `aten.convolution` torch-mlir lowers (a transposed one as a convolution over its
input stuffed with zeros, which the convolution family splits into phases).

torch-mlir's lowering of a grouped transposed convolution with one input channel per group
(a depthwise one, or the input gradient of a depthwise convolution) builds invalid IR; it
is decomposed here the way torch-mlir lowers the others: the input stuffed with zeros
(Z[(K - 1) d - p + i s] = x[i], one `slice_scatter` per image dim) and a convolution of
stride 1 over Z with the filter flipped and its channel dims swapped per group,
W'[g F/g + f, c, k] = w[g C/g + c, f, K - 1 - k].

A convolution whose innermost image dim is narrow (fewer than NARROW_LANES outputs: a few
masked vector lanes per register tile) and has a window of one tap, stride 1 and no padding
(a (3, 3, 1) kernel over [.., H, W, D]) reads each of its output's rows from one row of x
at the same place; with the dim before it of stride 1, the two are one image dim of W D
elements: a tap k of that dim moves by k d D elements, its padding by p D, so
    y[.., w, e] = conv(x seen as [.., W D], dilation d D, padding p D)[.., w D + e]
is one convolution of a rank lower, its output seen back as [.., W_out, D] (repeated while
it applies: a 1 x 1 convolution over a 7 x 7 image is one of 49 lanes).

torch-mlir lowers a grouped convolution of one image dim [N, C, L] as a two-dim one over
[N, C, L, 1]: its innermost dim, the register tile's lanes, is a unit dim (one lane of 16
used). A grouped convolution of one image dim, as given or merged as above, is the two-dim
convolution over [N, C, 1, L] here (window [1, K], the same values).
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _batch_as_channels(t: torch.Tensor, groups: int) -> torch.Tensor:
    """t [N, C, *S] as [C/g, g N, *S]: per group its channels as the batch, the batch as
    the group's channels."""
    n, c, *spatial = t.shape
    grouped = t.reshape(n, groups, c // groups, *spatial)
    return grouped.permute(2, 1, 0, *range(3, 3 + len(spatial))).reshape(c // groups, groups * n, *spatial)


def _channels_first(t: torch.Tensor) -> torch.Tensor:
    """t [N, C, *S] as [C, N, *S]."""
    return t.transpose(0, 1)


def _window_gradient(image, kernel, groups, stride, padding, dilation, window):
    """sum over the batch and the image of image x kernel per window offset (the module
    docstring's dw): from `image` [N, A, *I] and `kernel` [N, B, *O], the convolution of
    image seen as [A/g, g N, *I] with kernel seen as [B, N, *O] gives out[a', b, k] (a' in
    b's group); returned as [B, A/g, *K], the filter's layout for both directions."""
    rank = len(window)
    if rank == 3 and groups > 1 and image.shape[0] == 1:
        # one channel per group: torch-mlir cannot lower a 3-D depthwise convolution; a zero
        # batch beside the one adds products of zeros only
        image = torch.cat([image, torch.zeros_like(image)])
        kernel = torch.cat([kernel, torch.zeros_like(kernel)])
    out = aten.convolution.default(_batch_as_channels(image, groups), _channels_first(kernel),
                                   None, list(dilation), list(padding), list(stride), False,
                                   [0] * rank, groups)
    out = out[(slice(None), slice(None), *(slice(0, k) for k in window))]
    return out.transpose(0, 1).contiguous()


def convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation,
                         transposed, output_padding, groups, output_mask):
    """aten.convolution_backward as forward convolutions (module docstring)."""
    rank = input.dim() - 2
    stride, padding, dilation = (list(v) * (rank if len(v) == 1 else 1)
                                 for v in (stride, padding, dilation))
    window = list(weight.shape[2:])
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        if transposed:  # an output padding of a stride or more reaches past the input
            grad_input = aten.convolution.default(grad_output, weight, None, stride, padding,
                                                  dilation, False, [0] * rank, groups)
            grad_input = grad_input[(slice(None), slice(None),
                                     *(slice(0, i) for i in input.shape[2:]))]
        else:
            reach = [(i + 2 * p - d * (k - 1) - 1) % s for i, p, d, k, s in
                     zip(input.shape[2:], padding, dilation, window, stride)]
            grad_input = aten.convolution.default(grad_output, weight, None, stride, padding,
                                                  dilation, True, reach, groups)
    if output_mask[1]:
        if transposed:
            grad_weight = _window_gradient(grad_output, input, groups, stride, padding,
                                           dilation, window)
        else:
            grad_weight = _window_gradient(input, grad_output, groups, stride, padding,
                                           dilation, window)
    if output_mask[2]:
        grad_bias = grad_output.sum([0, *range(2, 2 + rank)])
    return grad_input, grad_weight, grad_bias


def _depthwise_transposed(input, weight, bias, stride, padding, dilation, transposed,
                          output_padding, groups) -> bool:
    """A transposed convolution torch-mlir's lowering gets wrong (module docstring) that the
    stuffing below takes (no padding beyond the window's reach)."""
    if not transposed or groups == 1 or weight.shape[0] != groups:
        return False
    window = weight.shape[2:]
    return all(d * (k - 1) >= p for d, k, p in zip(_per_dim(dilation, len(window)), window,
                                                   _per_dim(padding, len(window))))


def _per_dim(values, rank: int) -> list[int]:
    values = list(values)
    return values * rank if len(values) == 1 else values


# An innermost output dim narrower than this is merged with the dim before it when it can
# be (module docstring): 4 vectors of 16 f32 lanes.
NARROW_LANES = 64


def _collapsible(input, weight, stride, padding, transposed) -> bool:
    """Can the innermost image dim be merged with the one before it (module docstring)?"""
    rank = input.dim() - 2
    if transposed or rank < 2:
        return False
    stride, padding = _per_dim(stride, rank), _per_dim(padding, rank)
    inner = input.shape[-1]
    return (weight.shape[-1] == 1 and stride[-1] == 1 and padding[-1] == 0 and stride[-2] == 1
            and inner < NARROW_LANES and input.shape[-2] > 1)


def _grouped_rank_one(input, transposed, groups) -> bool:
    """A grouped convolution of one image dim, which torch-mlir would lower with a unit
    innermost dim (module docstring)?"""
    return not transposed and groups > 1 and input.dim() == 3


def _as_two_dims(input, weight, bias, stride, padding, dilation, groups):
    """The grouped convolution of one image dim as the two-dim one over [N, C, 1, L]; a
    16-bit one that is strided and padded over f32 operands, rounded once (torch 2.13's
    CPU kernel crashes on it while the joint graph is traced: the weight gradient of a
    float16 Conv1d(16, 32, 4, stride=2, padding=3, dilation=2, groups=16) on one position,
    a [1, 32, 1, 1] image, a [32, 2, 1, 1] window, stride 2, padding 3)."""
    stride, padding, dilation = (_per_dim(v, 1) for v in (stride, padding, dilation))
    if input.dtype in (torch.float16, torch.bfloat16) and any(s > 1 for s in stride) \
            and any(p > 0 for p in padding):
        wide = _as_two_dims(input.float(), weight.float(), None if bias is None else bias.float(),
                            stride, padding, dilation, groups)
        return wide.to(input.dtype)
    y = aten.convolution.default(input.unsqueeze(2), weight.unsqueeze(2), bias, [1, *stride],
                                 [0, *padding], [1, *dilation], False, [0, 0], groups)
    return y.squeeze(2)


def _collapsed(input, weight, bias, stride, padding, dilation, groups):
    """The convolution with its two innermost image dims merged (module docstring)."""
    rank = input.dim() - 2
    stride, padding, dilation = (_per_dim(v, rank) for v in (stride, padding, dilation))
    inner = input.shape[-1]
    x = input.reshape(*input.shape[:-2], input.shape[-2] * inner)
    w = weight.reshape(weight.shape[:-1])
    stride, padding = stride[:-1], padding[:-2] + [padding[-2] * inner]
    dilation = dilation[:-2] + [dilation[-2] * inner]
    if _collapsible(x, w, stride, padding, False):
        y = _collapsed(x, w, bias, stride, padding, dilation, groups)
    elif _grouped_rank_one(x, False, groups):
        y = _as_two_dims(x, w, bias, stride, padding, dilation, groups)
    else:
        y = aten.convolution.default(x, w, bias, stride, padding, dilation, False,
                                     [0] * (rank - 1), groups)
    return y.reshape(*y.shape[:-1], y.shape[-1] // inner, inner)


def _excess_padding(weight, padding, dilation, transposed) -> list[int]:
    """Per image dim, the padding of a transposed convolution beyond its window's reach,
    p - d (K - 1) where positive (0 for a forward convolution)."""
    window = weight.shape[2:]
    if not transposed:
        return [0] * len(window)
    return [max(0, p - d * (k - 1)) for p, d, k in zip(_per_dim(padding, len(window)),
                                                       _per_dim(dilation, len(window)), window)]


def convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding,
                groups):
    """aten.convolution, with the transposed convolutions torch-mlir gets wrong stuffed
    here, narrow innermost image dims merged and grouped ones of one image dim as two-dim
    ones (module docstring). A transposed
    convolution padded beyond its window's reach by e (torch-mlir would slice its stuffed
    input out of bounds) is the one padded e less, e cropped from each side."""
    excess = _excess_padding(weight, padding, dilation, transposed)
    if any(excess):
        inner = [p - e for p, e in zip(_per_dim(padding, len(excess)), excess)]
        y = aten.convolution.default(input, weight, bias, stride, inner, dilation, True,
                                     output_padding, groups)
        return y[(slice(None), slice(None),
                  *(slice(e, size - e) for e, size in zip(excess, y.shape[2:])))]
    if _collapsible(input, weight, stride, padding, transposed):
        return _collapsed(input, weight, bias, stride, padding, dilation, groups)
    if _grouped_rank_one(input, transposed, groups):
        return _as_two_dims(input, weight, bias, stride, padding, dilation, groups)
    if not _depthwise_transposed(input, weight, bias, stride, padding, dilation, transposed,
                                 output_padding, groups):
        return NotImplemented
    rank = input.dim() - 2
    stride, padding, dilation, output_padding = (_per_dim(v, rank) for v in
                                                 (stride, padding, dilation, output_padding))
    window = list(weight.shape[2:])
    stuffed = input
    for axis in reversed(range(rank)):
        i, s, p, d, k, r = (input.shape[2 + axis], stride[axis], padding[axis], dilation[axis],
                            window[axis], output_padding[axis])
        low = d * (k - 1) - p
        size = (i - 1) * s + 1 + 2 * low + r
        shape = list(stuffed.shape)
        shape[2 + axis] = size
        stuffed = stuffed.new_zeros(shape).slice_scatter(stuffed, 2 + axis, low,
                                                         low + (i - 1) * s + 1, s)
    c, f = weight.shape[:2]
    filters = weight.reshape(groups, c // groups, f, *window).transpose(1, 2)
    filters = filters.reshape(groups * f, c // groups, *window).flip(list(range(2, 2 + rank)))
    return aten.convolution.default(stuffed, filters, bias, [1] * rank, [0] * rank, dilation,
                                    False, [0] * rank, groups)


def transposed_convolution_decompositions() -> dict:
    """{aten.convolution: the stuffing of the transposed convolutions torch-mlir gets
    wrong}, for the forward graph."""
    return {aten.convolution.default: convolution}


def convolution_decompositions() -> dict:
    """{aten.convolution_backward: its decomposition, aten.convolution: the stuffing of the
    transposed convolutions torch-mlir gets wrong}, for the joint graph's tracing."""
    return {aten.convolution_backward.default: convolution_backward,
            aten.convolution.default: convolution}
