"""The LM head and its loss: F.cross_entropy(F.linear(h, W), y), h [N, D] hidden states, W
[V, D] the head's weight (an input, so --backward returns its gradient), mean reduction,
some targets ignored."""
import torch
import torch.nn.functional as F

N, D, V = 512, 256, 4096
DTYPE = torch.float32  # or a name: --set DTYPE=bfloat16
IGNORE_INDEX = -100


class Model(torch.nn.Module):
    def forward(self, h, weight, target):
        return F.cross_entropy(F.linear(h, weight), target, ignore_index=IGNORE_INDEX)


def get_inputs():
    dtype = getattr(torch, DTYPE) if isinstance(DTYPE, str) else DTYPE
    target = torch.randint(0, V, (N,))
    target[::7] = IGNORE_INDEX
    h = torch.randn(N, D, dtype=dtype)
    weight = (torch.randn(V, D) / D ** 0.5).to(dtype)
    return [h, weight, target]


def get_init_inputs():
    return []
