"""Scaled dot-product attention, F.scaled_dot_product_attention, f32 [B, H, S, D]."""
import torch
import torch.nn.functional as F

B, H, S, D = 1, 4, 256, 64
DTYPE = torch.float32  # or a name: --set DTYPE=bfloat16
IS_CAUSAL = False


class Model(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=IS_CAUSAL)


def get_inputs():
    dtype = getattr(torch, DTYPE) if isinstance(DTYPE, str) else DTYPE
    return [torch.randn(B, H, S, D, dtype=dtype) for _ in range(3)]


def get_init_inputs():
    return []
