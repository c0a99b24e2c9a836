"""Mat-vec of a transposed view, y = a.t() @ x: a [K, M] read in place, x a [K, 1] matrix."""
import torch

M = 2048
K = 2048
DTYPE = torch.float32


class Model(torch.nn.Module):
    def forward(self, a, x):
        return a.t() @ x


def get_inputs():
    return [torch.randn(K, M, dtype=DTYPE), torch.randn(K, 1, dtype=DTYPE)]


def get_init_inputs():
    return []
