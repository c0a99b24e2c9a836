"""The polynomial exp/log/log1p/expm1/tanh/erf and the asinh/acosh/atanh of the CPU target: few-ulp accuracy against torch (f32),
special values, and that they replace the libm calls in vectorized code; the flushing
variant of the one exp expansion (transform_ext.expand_fast_exp): its ulp error and its
edges; the coefficients are tools/fit_math_polynomials.py's."""

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import lighthouse.targets.cpu as cpu
import transform_ext.expand_math as expand_math
import transform_ext.exp_expansion as exp_expansion
from lighthouse.compile import compile_kernel
from schedules.common import match
from tests.transform_ext.helpers import apply, parse
from tests.transform_ext.numeric import run_module
from transform_ext.expand_fast_exp import expand_fast_exp

FUNCS = {"exp": torch.exp, "log": torch.log, "log1p": torch.log1p, "expm1": torch.expm1,
         "tanh": torch.tanh, "erf": torch.erf, "asinh": torch.asinh, "acosh": torch.acosh,
         "atanh": torch.atanh}


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
    spacing = torch.from_numpy(np.spacing(want.float().abs().numpy())).double()
    return ((got.double() - want).abs() / spacing.clamp_min(1e-45))


def _points(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if name == "exp":
        x = torch.cat([torch.linspace(-103.0, 88.5, 20000), torch.randn(4000, generator=g) * 3])
    elif name == "log":
        x = torch.cat([torch.logspace(-37, 38, 20000), torch.rand(4000, generator=g) * 2,
                       torch.tensor([1e-40, 3e-42, 1.0, 2.0, 0.5])])
    elif name == "log1p":
        x = torch.cat([torch.logspace(-37, 38, 20000), -torch.logspace(-37, -0.0001, 8000),
                       torch.randn(4000, generator=g) * 1e-3, torch.rand(4000, generator=g) * 20,
                       torch.tensor([5.9e-8, 6e-8, -5.9e-8, 1e-7, -0.5, -0.9999999])])
    elif name == "expm1":
        x = torch.cat([torch.linspace(-20, 88.5, 20000), torch.logspace(-37, -0.3, 8000),
                       -torch.logspace(-37, -0.3, 8000), torch.randn(4000, generator=g) * 1e-3,
                       torch.tensor([0.3499, 0.35, 0.3501, -0.35, -0.3501, 1e-8, -1e-8])])
    elif name in ("asinh", "atanh"):
        top = 38 if name == "asinh" else -1e-7
        x = torch.cat([torch.logspace(-37, top, 20000), torch.randn(4000, generator=g) * 1e-3,
                       torch.rand(4000, generator=g) * (20 if name == "asinh" else 1)])
        x = torch.cat([x, -x, torch.tensor([4095.9, 4096.0, 4096.1, 0.9999999, 0.5])])
    elif name == "acosh":
        x = torch.cat([1 + torch.logspace(-7, 0, 8000), torch.logspace(0, 38, 20000),
                       1 + torch.rand(4000, generator=g) * 20,
                       torch.tensor([1.0, 1.0000001, 4095.9, 4096.0, 4096.1])])
    elif name == "tanh":
        x = torch.cat([torch.linspace(-12, 12, 20000), torch.randn(4000, generator=g) * 1e-3,
                       torch.tensor([0.6249, 0.625, 0.6251, -0.625])])
    else:
        x = torch.cat([torch.linspace(-5, 5, 20000), torch.randn(4000, generator=g) * 1e-3,
                       torch.tensor([0.874, 0.875, 0.876, 3.99, 4.0, 4.01, -0.875])])
    return x.float()


@pytest.fixture(params=[True, False], ids=["ldexp", "two_scalings"])
def scaling(request, monkeypatch):
    """exp's 2^k by llvm.ldexp (the AVX-512 hosts' choice) or by two exponent-bit scalings,
    whatever the host."""
    ldexp = request.param
    monkeypatch.setattr(cpu, "expand_math_in",
                        lambda root, **_: expand_math.expand_math_in(root, ldexp=ldexp))
    return ldexp


@pytest.mark.parametrize("name,max_ulp", [("exp", 1.5), ("log", 3), ("log1p", 4), ("expm1", 4),
                                           ("tanh", 2), ("erf", 3), ("asinh", 5),
                                           ("acosh", 5), ("atanh", 5)])
def test_accuracy_in_ulp(kernel_file, scaling, name, max_ulp):
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
def test_special_values_match_torch(kernel_file, scaling, name):
    x = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-30, -1e-30,
                      200.0, -200.0, 89.0, -105.0, 1e38, -1.0, 1.0, 0.5, -0.5, 1.5, -1.5])
    got = compile_kernel(_kernel(kernel_file, name, x.numel())).run(x)[0]
    want = FUNCS[name](x)
    assert torch.equal(torch.isnan(got), torch.isnan(want)), (got, want)
    same = ~torch.isnan(want)
    inf = torch.isinf(want)
    assert torch.equal(got[inf], want[inf]), (got, want)
    torch.testing.assert_close(got[same & ~inf], want[same & ~inf], rtol=2e-7, atol=1e-38)


FLUSH_BELOW = -125.5 * math.log(2.0)  # -86.988: e^x < 2^-125.5 is flushed to 0
FLT_MAX = 3.4028234663852886e38


def _fast_exp(x: torch.Tensor, short: bool = False) -> torch.Tensor:
    """e^x by transform_ext.expand_fast_exp (the flushing variant, `short` or not) in a
    linalg body."""
    n = x.numel()
    payload = parse(f"""
        func.func @main(%x: tensor<{n}xf32>) -> tensor<{n}xf32> {{
          %e = tensor.empty() : tensor<{n}xf32>
          %r = linalg.generic {{indexing_maps = [affine_map<(d0) -> (d0)>, affine_map<(d0) -> (d0)>],
                               iterator_types = ["parallel"]}}
              ins(%x : tensor<{n}xf32>) outs(%e : tensor<{n}xf32>) {{
          ^bb0(%a: f32, %o: f32):
            %y = math.exp %a : f32
            linalg.yield %y : f32
          }} -> tensor<{n}xf32>
          return %r : tensor<{n}xf32>
        }}""")
    apply(payload, lambda root: expand_fast_exp(match(root, "func.func"), short=short))
    assert "math.exp" not in str(payload)
    return run_module(payload, [x])[0]


def test_flush_variant_accuracy_in_ulp():
    """At most 1.5 ulp (about one) on every normal result above the flush threshold."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.linspace(-86.98, 88.72, 20000), torch.randn(4000, generator=g) * 3,
                   -torch.rand(4000, generator=g) * 20]).float()
    got = _fast_exp(x)
    want = torch.exp(x.double())
    err = _ulp_error(got, want)
    assert err.max().item() <= 1.5, (err.max().item(), x[err.argmax()].item())


def test_short_flush_variant_accuracy_in_ulp():
    """`short` (softmax weights): at most 2.5 ulp for x in [-20, 0], 6 ulp on every normal
    result above the flush threshold; and not within one ulp everywhere (it is the shorter
    form: one constant for ln2, P of degree 4)."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.linspace(-86.98, 88.72, 20000), torch.randn(4000, generator=g) * 3,
                   -torch.rand(4000, generator=g) * 20, torch.linspace(-20, 0, 20000)]).float()
    got = _fast_exp(x, short=True)
    err = _ulp_error(got, torch.exp(x.double()))
    near = (x >= -20) & (x <= 0)
    assert err[near].max().item() <= 2.5, (err[near].max().item(), x[near][err[near].argmax()].item())
    assert err.max().item() <= 6.0, (err.max().item(), x[err.argmax()].item())
    assert err.max().item() > 1.5


@pytest.mark.parametrize("short", [False, True])
def test_flush_variant_edges(short):
    """NaN -> NaN; -inf and everything below 2^-125.5 -> 0; -0 and +0 -> 1; +inf and past
    ln(FLT_MAX) = 88.7228 -> +inf, 88.7228 itself finite."""
    x = torch.tensor([float("nan"), -float("inf"), -1e30, -104.0, -87.5, -87.0, -86.99,
                      -86.98, -0.0, 0.0, 88.72, 88.7228, 88.7229, 88.73, 88.75, 89.0, 1e30,
                      float("inf")])
    got = _fast_exp(x, short)
    want = torch.exp(x.double())
    assert torch.isnan(got[0])
    assert (got[x < FLUSH_BELOW] == 0).all() and not torch.signbit(got[x < FLUSH_BELOW]).any()
    kept = (x >= FLUSH_BELOW) & (want < FLT_MAX)
    assert (got[kept] > 0).all() and _ulp_error(got[kept], want[kept]).max() <= (6.0 if short else 1.5)
    assert (got[x == 0] == 1.0).all()
    over = x >= 88.7229
    assert torch.equal(got[over], torch.full_like(got[over], float("inf")))
    assert math.isfinite(got[x == 88.7228].item())


def _fit_tool():
    path = Path(__file__).resolve().parents[2] / "tools" / "fit_math_polynomials.py"
    spec = importlib.util.spec_from_file_location("fit_math_polynomials", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("fit,literal", [
    ("tanh_small", expand_math.TANH_SMALL), ("erf_small", expand_math.ERF_SMALL),
    ("erfc_poly", expand_math.ERFC_POLY), ("exp_poly", exp_expansion.EXP_POLY),
    ("exp_poly_short", exp_expansion.EXP_POLY_SHORT)])
def test_coefficients_are_the_fit_tools(fit, literal):
    """Every coefficient in the code is what tools/fit_math_polynomials.py computes (to the
    last bits a different LAPACK or CPU kernel may change, seen at 7e-12 relative on an
    AVX-512 host; the f32 constants round them anyway)."""
    coef, _ = getattr(_fit_tool(), fit)()
    assert len(coef) == len(literal)
    np.testing.assert_allclose(np.array(literal), coef, rtol=1e-9, atol=0)


def test_erfc_interval_is_the_fit_tools():
    tool = _fit_tool()
    assert (expand_math.ERFC_MID, expand_math.ERFC_HALF) == (tool.ERFC_MID, tool.ERFC_HALF)


def test_softplus_is_vectorized_and_matches_torch(kernel_file):
    """softplus = log1p(exp(x)) below its threshold: both expanded, no libm call left."""
    path = kernel_file("""
        import torch
        class Model(torch.nn.Module):
            def forward(self, x):
                return torch.nn.functional.softplus(x, beta=2.0, threshold=15.0)
        def get_inputs():
            return [torch.zeros(4099)]
        def get_init_inputs():
            return []
    """)
    compiled = compile_kernel(path)
    assert "llvm.call @log1pf" not in str(compiled.module)
    assert "llvm.call @expf" not in str(compiled.module)
    x = torch.cat([torch.linspace(-60, 60, 4000), torch.tensor([7.49, 7.5, 7.51, -0.0, 0.0]),
                   torch.randn(94) * 1e-4])
    got = compiled.run(x)[0]
    torch.testing.assert_close(got, torch.nn.functional.softplus(x, beta=2.0, threshold=15.0),
                               rtol=5e-7, atol=1e-38)
