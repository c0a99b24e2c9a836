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
- `F.cross_entropy(F.linear(h, W, b), y)` (an LM head and its loss: nn.Linear's output,
  through reshapes keeping its class dim last, read by the loss over 2-D logits) becomes
  `lighthouse::linear_cross_entropy` (the linear cross-entropy family: no [N, V] logits).
  With a gradient it needs a scalar loss (mean or sum): its forward computes the loss and
  dh, dW, db seeded by ones, its backward scales them by the incoming scalar.
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
from torch.utils.weak import WeakTensorKeyDictionary

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


@torch.library.custom_op("lighthouse::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy_op(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                             target: torch.Tensor, weight: torch.Tensor | None, reduction: str,
                             ignore_index: int, label_smoothing: float, with_grad: bool
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, dh, dW, db) of F.cross_entropy(F.linear(h, W, b), target, ...) with h [N, D],
    W [V, D]; the gradients seeded by ones, empty tensors unless `with_grad` (db also
    without a bias)."""
    logits = F.linear(h.detach(), w.detach(), None if b is None else b.detach())
    loss, grad = _cross_entropy_eager(logits, target, weight, reduction, ignore_index,
                                      label_smoothing, with_grad)
    if not with_grad:
        return loss, *(h.new_empty((0,)) for _ in range(3))
    db = grad.sum(0).to(b.dtype) if b is not None else h.new_empty((0,))
    return loss, grad @ w.detach(), (grad.t() @ h.detach()).to(w.dtype), db


def linear_cross_entropy_with_grad(h, w, b, target, weight, reduction, ignore_index,
                                   label_smoothing, with_grad):
    """The op's value in torch: the loss and, with `with_grad`, dh, dW, db seeded by ones
    (the joint graph the linear cross-entropy family fuses, as `--backward` imports it)."""
    def loss_of(h, w, *bias):
        return F.cross_entropy(F.linear(h, w, *bias), target, weight, ignore_index=ignore_index,
                               reduction=reduction, label_smoothing=label_smoothing)

    bias = () if b is None else (b,)
    if not with_grad:
        return loss_of(h, w, *bias), *(h.new_empty((0,)) for _ in range(3))
    loss, vjp = torch.func.vjp(loss_of, h, w, *bias)
    grads = vjp(torch.ones_like(loss))
    return loss, grads[0], grads[1], grads[2] if bias else h.new_empty((0,))


@_linear_cross_entropy_op.register_fake
def _(h, w, b, target, weight, reduction, ignore_index, label_smoothing, with_grad):
    shape = target.shape if reduction == "none" else ()
    if not with_grad:
        return h.new_empty(shape), *(h.new_empty((0,)) for _ in range(3))
    db = torch.empty_like(b) if b is not None else h.new_empty((0,))
    return h.new_empty(shape), torch.empty_like(h), torch.empty_like(w), db


def _linear_setup_context(ctx, inputs, output):
    ctx.has_bias = inputs[2] is not None
    ctx.save_for_backward(*output[1:])


def _linear_backward(ctx, grad_loss, *_grads_of_grads):
    dh, dw, db = ctx.saved_tensors
    if dh.numel() == 0 and dh.dim() == 1 and grad_loss is not None:
        raise RuntimeError("lighthouse::linear_cross_entropy was traced without its gradient")
    return ((dh * grad_loss).to(dh.dtype), (dw * grad_loss).to(dw.dtype),
            (db * grad_loss).to(db.dtype) if ctx.has_bias else None,
            None, None, None, None, None, None)


_linear_cross_entropy_op.register_autograd(_linear_backward,
                                           setup_context=_linear_setup_context)
register_anchor(torch.ops.lighthouse.linear_cross_entropy.default, "linear_cross_entropy")

_RESHAPES = (torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.flatten,
             torch.flatten)


class _FamilyForms(torch.overrides.TorchFunctionMode):
    """F.cross_entropy as `cross_entropy` above, or as the linear cross-entropy when it reads
    a linear layer's output (`_linears`: each F.linear result, and its reshapes keeping the
    last dim, to the layer's (h, W, b)), while a graph is traced (not while its parts are
    decomposed: `suspended`)."""

    suspended = False

    def __init__(self):
        super().__init__()
        self._linears = WeakTensorKeyDictionary()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _FamilyForms.suspended:
            return func(*args, **kwargs)
        if func is F.cross_entropy:
            return self._cross_entropy(*args, **kwargs)
        out = func(*args, **kwargs)
        if func is F.linear:
            h, w, *rest = (*args, *kwargs.values())
            self._linears[out] = (h, w, rest[0] if rest else None)
        elif func in _RESHAPES and isinstance(args[0], torch.Tensor) \
                and args[0] in self._linears and isinstance(out, torch.Tensor) \
                and out.dim() >= 1 and out.shape[-1] == args[0].shape[-1]:
            self._linears[out] = self._linears[args[0]]
        return out

    def _cross_entropy(self, input, target, weight=None, size_average=None, ignore_index=-100,
                       reduce=None, reduction="mean", label_smoothing=0.0):
        linear = self._linears.get(input) if isinstance(input, torch.Tensor) else None
        if linear is None or input.dim() != 2 or size_average is not None \
                or reduce is not None or reduction not in _REDUCTIONS \
                or not isinstance(target, torch.Tensor) or target.is_floating_point() \
                or (weight is not None and not isinstance(weight, torch.Tensor)):
            return cross_entropy(input, target, weight, size_average, ignore_index, reduce,
                                 reduction, label_smoothing)
        h, w, b = linear
        with_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (h, w, b))
        if with_grad and reduction == "none":
            return cross_entropy(input, target, weight, size_average, ignore_index, reduce,
                                 reduction, label_smoothing)
        loss, *_ = torch.ops.lighthouse.linear_cross_entropy(
            h.reshape(-1, h.shape[-1]), w, b, target, weight, reduction, int(ignore_index),
            float(label_smoothing), with_grad)
        return loss


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
