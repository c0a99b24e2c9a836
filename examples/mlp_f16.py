"""Two-layer MLP in 16-bit (f16 or bf16): linear -> GELU -> linear, f32 accumulation.

The weights are parameters of DTYPE; on the XeGPU target they become kernel arguments.
`--set DTYPE=bfloat16` switches the type."""
import torch

BATCH = 256
IN_FEATURES = 256
HIDDEN = 512
OUT_FEATURES = 256
DTYPE = "float16"


class Model(torch.nn.Module):
    def __init__(self, in_features, hidden, out_features):
        super().__init__()
        self.fc1 = torch.nn.Linear(in_features, hidden)
        self.fc2 = torch.nn.Linear(hidden, out_features)
        self.to(getattr(torch, DTYPE))

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def get_inputs():
    return [torch.randn(BATCH, IN_FEATURES, dtype=getattr(torch, DTYPE))]


def get_init_inputs():
    return [IN_FEATURES, HIDDEN, OUT_FEATURES]
