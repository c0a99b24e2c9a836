"""Two-layer MLP: linear -> GELU -> linear (weights are parameters)."""
import torch

BATCH = 64
IN_FEATURES = 256
HIDDEN = 512
OUT_FEATURES = 256


class Model(torch.nn.Module):
    def __init__(self, in_features, hidden, out_features):
        super().__init__()
        self.fc1 = torch.nn.Linear(in_features, hidden)
        self.fc2 = torch.nn.Linear(hidden, out_features)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def get_inputs():
    return [torch.randn(BATCH, IN_FEATURES)]


def get_init_inputs():
    return [IN_FEATURES, HIDDEN, OUT_FEATURES]
