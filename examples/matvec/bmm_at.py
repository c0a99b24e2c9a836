"""Batched mat-vec of transposed views, y = torch.bmm(a.transpose(1, 2), x): a [B, K, M], x [B, K, 1]."""
import torch

B = 4
M = 2048
K = 2048
DTYPE = torch.float32


class Model(torch.nn.Module):
    def forward(self, a, x):
        return torch.bmm(a.transpose(1, 2), x)


def get_inputs():
    return [torch.randn(B, K, M, dtype=DTYPE), torch.randn(B, K, 1, dtype=DTYPE)]


def get_init_inputs():
    return []
