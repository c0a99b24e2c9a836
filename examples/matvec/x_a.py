"""Vector-matrix product y = x @ a: a [K, M] read along its rows, x a [1, K] matrix."""
import torch

M = 2048
K = 2048
DTYPE = torch.float32


class Model(torch.nn.Module):
    def forward(self, a, x):
        return x @ a


def get_inputs():
    return [torch.randn(K, M, dtype=DTYPE), torch.randn(1, K, dtype=DTYPE)]


def get_init_inputs():
    return []
