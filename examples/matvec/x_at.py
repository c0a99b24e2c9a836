"""Vector-matrix product of a transposed view, y = x @ a.t(): a [M, K], x a [1, K] matrix."""
import torch

M = 2048
K = 2048
DTYPE = torch.float32


class Model(torch.nn.Module):
    def forward(self, a, x):
        return x @ a.t()


def get_inputs():
    return [torch.randn(M, K, dtype=DTYPE), torch.randn(1, K, dtype=DTYPE)]


def get_init_inputs():
    return []
