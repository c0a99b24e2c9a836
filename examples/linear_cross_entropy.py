"""The LM head and its loss: F.cross_entropy(F.linear(h, W[, b]), y[, weight=w]), h [N, D]
hidden states, W [V, D] the head's weight (an input, so --backward returns its gradient),
b [V] its bias (BIAS, an input too), w [V] class weights (CLASS_WEIGHTS, a buffer), mean
reduction, some targets ignored."""
import torch
import torch.nn.functional as F

N, D, V = 512, 256, 4096
DTYPE = torch.float32  # or a name: --set DTYPE=bfloat16
IGNORE_INDEX = -100
BIAS = False           # --set BIAS=True: F.linear(h, W, b)
CLASS_WEIGHTS = False  # --set CLASS_WEIGHTS=True: weight=w


def _dtype():
    return getattr(torch, DTYPE) if isinstance(DTYPE, str) else DTYPE


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        weights = (torch.rand(V, generator=g) + 0.5).to(_dtype()) if CLASS_WEIGHTS else None
        self.register_buffer("class_weights", weights)

    def forward(self, h, weight, *bias_and_target):
        *bias, target = bias_and_target
        return F.cross_entropy(F.linear(h, weight, *bias), target, weight=self.class_weights,
                               ignore_index=IGNORE_INDEX)


def get_inputs():
    dtype = _dtype()
    target = torch.randint(0, V, (N,))
    target[::7] = IGNORE_INDEX
    h = torch.randn(N, D, dtype=dtype)
    weight = (torch.randn(V, D) / D ** 0.5).to(dtype)
    bias = [(torch.randn(V) / 2).to(dtype)] if BIAS else []
    return [h, weight, *bias, target]


def get_init_inputs():
    return []
