"""Mat-vec y = a @ x (KernelBench level 1 problem 4's form): a [M, K], x a [K, 1] matrix."""
import torch

M = 2048
K = 2048
DTYPE = torch.float32


class Model(torch.nn.Module):
    def forward(self, a, x):
        return a @ x


def get_inputs():
    return [torch.randn(M, K, dtype=DTYPE), torch.randn(K, 1, dtype=DTYPE)]


def get_init_inputs():
    return []
