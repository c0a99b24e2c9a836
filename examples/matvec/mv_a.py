"""Mat-vec y = torch.mv(a, x): a [M, K], x [K]."""
import torch

M = 2048
K = 2048
DTYPE = torch.float32


class Model(torch.nn.Module):
    def forward(self, a, x):
        return torch.mv(a, x)


def get_inputs():
    return [torch.randn(M, K, dtype=DTYPE), torch.randn(K, dtype=DTYPE)]


def get_init_inputs():
    return []
