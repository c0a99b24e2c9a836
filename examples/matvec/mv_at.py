"""Mat-vec of a transposed view, y = torch.mv(a.t(), x): a [K, M] read in place, x [K]."""
import torch

M = 2048
K = 2048
DTYPE = torch.float32


class Model(torch.nn.Module):
    def forward(self, a, x):
        return torch.mv(a.t(), x)


def get_inputs():
    return [torch.randn(K, M, dtype=DTYPE), torch.randn(K, dtype=DTYPE)]


def get_init_inputs():
    return []
