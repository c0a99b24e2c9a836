"""Square matmul C = A @ B, f32 (N x N x N)."""
import torch

N = 256
DTYPE = torch.float32


class Model(torch.nn.Module):
    def forward(self, a, b):
        return a @ b


def get_inputs():
    return [torch.randn(N, N, dtype=DTYPE), torch.randn(N, N, dtype=DTYPE)]


def get_init_inputs():
    return []
