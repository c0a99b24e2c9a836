"""A 2-D convolution, torch.nn.Conv2d (or ConvTranspose2d with TRANSPOSED), f32 [N, C, H, W]."""
import torch

N, C, H, W = 4, 32, 56, 56
F, KH, KW = 64, 3, 3
STRIDE, PADDING, DILATION, GROUPS = 1, 1, 1, 1
OUTPUT_PADDING = 0     # transposed only
TRANSPOSED = False
BIAS = True
DTYPE = torch.float32  # or a name: --set DTYPE=bfloat16


def _dtype():
    return getattr(torch, DTYPE) if isinstance(DTYPE, str) else DTYPE


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        options = dict(stride=STRIDE, padding=PADDING, dilation=DILATION, groups=GROUPS, bias=BIAS)
        if TRANSPOSED:
            self.conv = torch.nn.ConvTranspose2d(C, F, (KH, KW), output_padding=OUTPUT_PADDING,
                                                 **options)
        else:
            self.conv = torch.nn.Conv2d(C, F, (KH, KW), **options)
        self.conv.to(_dtype())

    def forward(self, x):
        return self.conv(x)


def get_inputs():
    return [torch.randn(N, C, H, W, dtype=_dtype())]


def get_init_inputs():
    return []
