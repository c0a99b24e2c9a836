"""Matmul C = A @ B with 16-bit inputs (f16 or bf16) and f32 accumulation: M x K @ K x N.

The payload of the XeGPU target's DPAS kernels (`--target xegpu`); it also runs on the CPU.
`--set DTYPE=bfloat16` switches the input type."""
import torch

M, N, K = 256, 256, 256
DTYPE = "float16"


class Model(torch.nn.Module):
    def forward(self, a, b):
        return a @ b


def get_inputs():
    dtype = getattr(torch, DTYPE)
    return [torch.randn(M, K, dtype=dtype), torch.randn(K, N, dtype=dtype)]


def get_init_inputs():
    return []
