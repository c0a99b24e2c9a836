"""A transposed copy of the last two dims, x.transpose(-2, -1).contiguous(), [B, N, M] -> [B, M, N]."""
import torch

B, N, M = 2, 256, 384
DTYPE = torch.float32  # or a name: --set DTYPE=bfloat16


class Model(torch.nn.Module):
    def forward(self, x):
        return x.transpose(-2, -1).contiguous()


def get_inputs():
    dtype = getattr(torch, DTYPE) if isinstance(DTYPE, str) else DTYPE
    return [torch.randn(B, N, M).to(dtype)]


def get_init_inputs():
    return []
