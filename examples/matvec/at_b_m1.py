"""A row times a matrix through transposed views, y = a.t() @ b (matmul with m = 1): a [K, 1], b [K, N]."""
import torch

N = 2048
K = 2048
DTYPE = torch.float32


class Model(torch.nn.Module):
    def forward(self, a, b):
        return a.t() @ b


def get_inputs():
    return [torch.randn(K, 1, dtype=DTYPE), torch.randn(K, N, dtype=DTYPE)]


def get_init_inputs():
    return []
