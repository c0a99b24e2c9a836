"""A matrix times a column through a transposed view, y = a @ b.t() (matmul with n = 1): a [M, K], b [1, K]."""
import torch

M = 2048
K = 2048
DTYPE = torch.float32


class Model(torch.nn.Module):
    def forward(self, a, b):
        return a @ b.t()


def get_inputs():
    return [torch.randn(M, K, dtype=DTYPE), torch.randn(1, K, dtype=DTYPE)]


def get_init_inputs():
    return []
