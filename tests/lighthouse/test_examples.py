"""Every example compiles, runs on the CPU and matches torch (forward, and backward where
the issue asks for it), at sizes small enough for CI."""

import pytest

from lighthouse.compile import compile_kernel
from tests.conftest import EXAMPLES

SMALL = {
    "matmul": {"N": 96},
    "mlp": {"BATCH": 16, "IN_FEATURES": 64, "HIDDEN": 128, "OUT_FEATURES": 48},
    "softmax": {"N": 24, "C": 300},
    "layer_norm": {"N": 24, "D": 200},
    "attention": {"B": 1, "H": 2, "S": 80, "D": 32},
    "cross_entropy": {"N": 40, "C": 1000},
    "linear_cross_entropy": {"N": 40, "D": 32, "V": 300},
    "transpose": {"B": 2, "N": 40, "M": 72},
}
BACKWARD = ["mlp", "softmax", "layer_norm", "attention", "cross_entropy", "linear_cross_entropy"]


def _assert_matches(compiled):
    reports = compiled.check()
    assert reports, "no results compared"
    for r in reports:
        assert r.ok, str(r)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_example_forward(name):
    _assert_matches(compile_kernel(EXAMPLES / f"{name}.py", overrides=SMALL[name]))


@pytest.mark.parametrize("name", BACKWARD)
def test_example_backward(name):
    compiled = compile_kernel(EXAMPLES / f"{name}.py", overrides=SMALL[name], backward=True)
    assert any(n.startswith("d_") for n in compiled.imported.result_names)
    _assert_matches(compiled)


def test_examples_default_sizes_are_module_globals():
    from lighthouse.kernel import load_kernel

    assert load_kernel(EXAMPLES / "matmul.py", {"N": 8}).inputs[0].shape == (8, 8)
    k = load_kernel(EXAMPLES / "attention.py", {"B": 2, "H": 3, "S": 5, "D": 4})
    assert k.inputs[0].shape == (2, 3, 5, 4)
    k = load_kernel(EXAMPLES / "cross_entropy.py", {"N": 6, "C": 7})
    assert k.inputs[0].shape == (6, 7) and k.inputs[1].shape == (6,)


def test_bf16_parameters_are_frozen_and_match(kernel_file):
    path = kernel_file("""
        import torch
        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(32, 48).bfloat16()
            def forward(self, x):
                return torch.nn.functional.gelu(self.fc(x))
        def get_inputs():
            return [torch.randn(8, 32).bfloat16()]
        def get_init_inputs():
            return []
    """)
    _assert_matches(compile_kernel(path))
