"""Row log-softmax over the last dim, f32 [N, C]: x - max - log(sum(exp(x - max)))."""
import torch

N = 256
C = 1024


class Model(torch.nn.Module):
    def forward(self, x):
        return torch.log_softmax(x, dim=-1)


def get_inputs():
    return [torch.randn(N, C)]


def get_init_inputs():
    return []
