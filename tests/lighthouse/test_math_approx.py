"""The polynomial exp/log/tanh/erf of the CPU target: few-ulp accuracy against torch (f32),
special values, and that they replace the libm calls in vectorized code."""

import math

import pytest
import torch

from lighthouse.compile import compile_kernel

FUNCS = {"exp": torch.exp, "log": torch.log, "tanh": torch.tanh, "erf": torch.erf}


def _kernel(kernel_file, name, n):
    return kernel_file(f"""
        import torch
        N = {n}
        class Model(torch.nn.Module):
            def forward(self, x):
                return torch.{name}(x)
        def get_inputs():
            return [torch.zeros(N)]
        def get_init_inputs():
            return []
    """)


def _ulp_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of the f32 spacing at `want` (want computed in f64)."""
    spacing = torch.from_numpy(__import__("numpy").spacing(want.float().abs().numpy())).double()
    return ((got.double() - want).abs() / spacing.clamp_min(1e-45))


def _points(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if name == "exp":
        x = torch.cat([torch.linspace(-103.0, 88.5, 20000), torch.randn(4000, generator=g) * 3])
    elif name == "log":
        x = torch.cat([torch.logspace(-37, 38, 20000), torch.rand(4000, generator=g) * 2,
                       torch.tensor([1e-40, 3e-42, 1.0, 2.0, 0.5])])
    elif name == "tanh":
        x = torch.cat([torch.linspace(-12, 12, 20000), torch.randn(4000, generator=g) * 1e-3,
                       torch.tensor([0.6249, 0.625, 0.6251, -0.625])])
    else:
        x = torch.cat([torch.linspace(-5, 5, 20000), torch.randn(4000, generator=g) * 1e-3,
                       torch.tensor([0.874, 0.875, 0.876, 3.99, 4.0, 4.01, -0.875])])
    return x.float()


@pytest.mark.parametrize("name,max_ulp", [("exp", 3), ("log", 3), ("tanh", 4), ("erf", 4)])
def test_accuracy_in_ulp(kernel_file, name, max_ulp):
    x = _points(name)
    compiled = compile_kernel(_kernel(kernel_file, name, x.numel()))
    assert f"llvm.call @{name}f" not in str(compiled.module)  # expanded, not libm
    got = compiled.run(x)[0]
    want = FUNCS[name](x.double())
    finite = torch.isfinite(want) & (want.abs() > 1.2e-38)   # normal f32 results
    err = _ulp_error(got[finite], want[finite])
    assert err.max().item() <= max_ulp, (name, err.max().item(), x[finite][err.argmax()].item())
    denormal = torch.isfinite(want) & ~finite
    if denormal.any():  # tiny results: absolute error within a couple of denormal steps
        assert (got[denormal].double() - want[denormal]).abs().max().item() <= 4 * 1.4e-45


@pytest.mark.parametrize("name", sorted(FUNCS))
def test_special_values_match_torch(kernel_file, name):
    x = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-30, -1e-30,
                      200.0, -200.0, 89.0, -105.0, 1e38, -1.0, 1.0])
    got = compile_kernel(_kernel(kernel_file, name, x.numel())).run(x)[0]
    want = FUNCS[name](x)
    assert torch.equal(torch.isnan(got), torch.isnan(want)), (got, want)
    same = ~torch.isnan(want)
    inf = torch.isinf(want)
    assert torch.equal(got[inf], want[inf]), (got, want)
    torch.testing.assert_close(got[same & ~inf], want[same & ~inf], rtol=2e-7, atol=1e-38)
