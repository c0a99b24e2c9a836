"""Cross-entropy loss over class logits, F.cross_entropy, f32 logits [N, C], mean reduction."""
import torch
import torch.nn.functional as F

N, C = 128, 8192
DTYPE = torch.float32  # or a name: --set DTYPE=bfloat16
IGNORE_INDEX = -100


class Model(torch.nn.Module):
    def forward(self, logits, target):
        return F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX)


def get_inputs():
    target = torch.randint(0, C, (N,))
    target[::7] = IGNORE_INDEX
    dtype = getattr(torch, DTYPE) if isinstance(DTYPE, str) else DTYPE
    return [torch.randn(N, C, dtype=dtype), target]


def get_init_inputs():
    return []
