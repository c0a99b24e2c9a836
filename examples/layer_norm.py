"""LayerNorm over the last dim with learned weight and bias, f32 [N, D]."""
import torch

N = 256
D = 1024


class Model(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        return self.norm(x)


def get_inputs():
    return [torch.randn(N, D)]


def get_init_inputs():
    return [D]
