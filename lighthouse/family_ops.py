"""The torch-level forms AOTAutograd traces for lighthouse, so that a family sees a whole
kernel where torch would hand it pieces.

`TracingModes()` is entered while AOTAutograd traces a graph (lighthouse.api):
- `F.cross_entropy` with class-index targets becomes the op `lighthouse::cross_entropy`
  (one anchor, lighthouse.partition). When the logits need a gradient, its forward computes
  the loss and the gradient of the loss seeded by ones, d logits = (softmax - onehot) w ...
  (the cross-entropy family's fused forward+backward kernel, one read of the logits), and
  its backward only scales it: d logits * g (g broadcast over the class dim for
  reduction="none"). Without a gradient it computes the loss alone. torch's own
  decomposition would save the [N, C] log-probabilities and split the loss over two graphs
  that the family could not fuse.
- `F.scaled_dot_product_attention` of 3-D inputs is traced as 4-D (ingress.SdpaIn4d), so
  torch takes its flash op (an attention anchor), and with a float mask that needs a
  gradient as `lighthouse::attention_masked` (flash_decompositions.SdpaMaskGradient: an
  anchor whose backward also gives the mask's gradient);
- f16/bf16 group norms are traced in f32 (ingress._GroupNormInF32), as torch computes them.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .partition import register_anchor

_REDUCTIONS = ("none", "mean", "sum")


@torch.library.custom_op("lighthouse::cross_entropy", mutates_args=())
def _cross_entropy_op(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
                      reduction: str, ignore_index: int, label_smoothing: float,
                      with_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, d loss / d logits seeded by ones) with F.cross_entropy's semantics; the
    gradient is an empty tensor unless `with_grad`."""
    return _cross_entropy_eager(logits, target, weight, reduction, ignore_index,
                                label_smoothing, with_grad)


def cross_entropy_with_grad(logits, target, weight, reduction, ignore_index, label_smoothing,
                            with_grad):
    """The op's value in torch: the loss and, with `with_grad`, its gradient seeded by ones
    (the joint graph the cross-entropy family fuses, as `--backward` imports it)."""
    def loss_of(x):
        return F.cross_entropy(x, target, weight, ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=label_smoothing)

    if not with_grad:
        return loss_of(logits), logits.new_empty((0,))
    loss, vjp = torch.func.vjp(loss_of, logits)
    (grad,) = vjp(torch.ones_like(loss))
    return loss, grad


def _cross_entropy_eager(logits, target, weight, reduction, ignore_index, label_smoothing,
                         with_grad):
    """The op run by torch on real tensors. It may run below autograd (under AOTAutograd's
    runtime), so the gradient is written out, in f32: with p = softmax(x), eps the smoothing,
    C the classes and y valid (not ignore_index),
        d x = (1 - eps) w_y (p - onehot(y)) + (eps / C) (sum_c w_c p - w),
    0 on ignored rows, divided by sum_valid w_y under reduction="mean"."""
    loss = F.cross_entropy(logits.detach(), target, weight, ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=label_smoothing)
    if not with_grad:
        return loss, logits.new_empty((0,))
    class_dim = 1 if logits.dim() > 1 else 0
    x = logits.detach().float().movedim(class_dim, -1)
    classes = x.shape[-1]
    valid = target != ignore_index
    y = torch.where(valid, target, 0)
    w = weight.float() if weight is not None else x.new_ones(classes)
    p = torch.softmax(x, -1)
    w_y = torch.where(valid, w[y], 0.0).unsqueeze(-1)
    onehot = F.one_hot(y, classes).to(x.dtype)
    grad = (1 - label_smoothing) * w_y * (p - onehot) \
        + (label_smoothing / classes) * (w.sum() * p - w)
    if reduction == "mean":
        grad = grad / w_y.sum()
    grad = torch.where(valid.unsqueeze(-1), grad, 0.0)
    return loss, grad.movedim(-1, class_dim).to(logits.dtype)


@_cross_entropy_op.register_fake
def _(logits, target, weight, reduction, ignore_index, label_smoothing, with_grad):
    shape = target.shape if reduction == "none" else ()
    grad = torch.empty_like(logits) if with_grad else logits.new_empty((0,))
    return logits.new_empty(shape), grad


def _setup_context(ctx, inputs, output):
    ctx.class_dim = 1 if inputs[0].dim() > 1 else 0
    ctx.per_row = inputs[3] == "none" and inputs[0].dim() > 1
    ctx.save_for_backward(output[1])


def _backward(ctx, grad_loss, _grad_of_grad):
    (grad,) = ctx.saved_tensors
    if grad.numel() == 0 and grad.dim() == 1 and grad_loss is not None:
        raise RuntimeError("lighthouse::cross_entropy was traced without its gradient")
    scale = grad_loss.unsqueeze(ctx.class_dim) if ctx.per_row else grad_loss
    return (grad * scale).to(grad.dtype), None, None, None, None, None, None


_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)
register_anchor(torch.ops.lighthouse.cross_entropy.default, "cross_entropy")


def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                  reduction="mean", label_smoothing=0.0):
    """F.cross_entropy through `lighthouse::cross_entropy` where the op takes the call:
    class-index targets, float logits, no legacy size_average/reduce; else F.cross_entropy."""
    if size_average is not None or reduce is not None or reduction not in _REDUCTIONS \
            or not isinstance(input, torch.Tensor) or not input.is_floating_point() \
            or not isinstance(target, torch.Tensor) or target.is_floating_point() \
            or input.dim() == 0 or (weight is not None and not isinstance(weight, torch.Tensor)):
        return F.cross_entropy(input, target, weight, size_average, ignore_index, reduce,
                               reduction, label_smoothing)
    with_grad = torch.is_grad_enabled() and input.requires_grad
    loss, _ = torch.ops.lighthouse.cross_entropy(input, target, weight, reduction,
                                                 int(ignore_index), float(label_smoothing),
                                                 with_grad)
    return loss


class _FamilyForms(torch.overrides.TorchFunctionMode):
    """F.cross_entropy as `cross_entropy` above, while a graph is traced (not while its parts
    are decomposed: `suspended`)."""

    suspended = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy and not _FamilyForms.suspended:
            return cross_entropy(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def torch_forms():
    """F.cross_entropy as itself inside (the compilers AOTAutograd calls while tracing
    decompose the op back into it)."""
    before, _FamilyForms.suspended = _FamilyForms.suspended, True
    try:
        yield
    finally:
        _FamilyForms.suspended = before


@contextlib.contextmanager
def TracingModes():
    """The modes AOTAutograd traces under (module docstring)."""
    from .flash_decompositions import SdpaIn4d, SdpaMaskGradient
    from .ingress import _GroupNormInF32

    with _FamilyForms(), SdpaMaskGradient(), SdpaIn4d(), _GroupNormInF32():
        yield
