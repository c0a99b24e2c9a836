"""Where torch-mlir's lowering differed from torch (lighthouse/torch_semantics.py,
lighthouse/targets/libm_calls.py): NaN through clamp and hardtanh, the index of a NaN
maximum (argmax, max(dim), max_pool), compares of constants with an int, pow(x, +-0.5),
isfinite, F.pad with negative widths, f64 log1p/expm1/erf and the inverse hyperbolics,
scatters along a negative dim, adaptive max pooling over uneven windows, and the one-line
refusals of uint8 tensors and of a forward that writes its input. Results are compared with torch bit for bit where
torch's own result is exact (NaN positions, signed zeros, indices)."""

import pytest
import torch

from lighthouse.compile import compile_kernel
from lighthouse.errors import IngressError
from tests.conftest import run_cli

KERNEL = """
import torch
import torch.nn.functional as F
def special(n, m, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, m, generator=g)
    x[:, 3] = float("nan"); x[::3, 5] = float("inf"); x[1::3, 7] = float("-inf")
    x[:, 9] = -0.0; x[:, 11] = 0.0; x[5, :] = float("nan"); x[6, :] = float("-inf")
    x[7, 20:30] = 2.0
    return x
class Model(torch.nn.Module):
    def forward(self, {args}):
        return {expr}
def get_inputs():
    g = torch.Generator().manual_seed(0)
    return [{inputs}]
def get_init_inputs():
    return []
"""


def _compile(kernel_file, expr, inputs="special(16, 37, 0)", args="x", **kw):
    return compile_kernel(kernel_file(KERNEL.format(expr=expr, inputs=inputs, args=args)), **kw)


def _assert_exact(compiled, signed_zeros=True):
    """Every result torch's: the same NaNs, infinities and signs of zero (unless
    `signed_zeros` is False: a max pooling's -0 and +0 tie), indices equal, and finite values
    within 2 ulp (torch's own sqrt and atanh are not correctly rounded)."""
    for got, want in zip(compiled.run(), compiled.expected()):
        assert got.dtype == want.dtype and got.shape == want.shape
        if not want.is_floating_point():
            assert torch.equal(got, want), (got, want)
            continue
        assert torch.equal(torch.isnan(got), torch.isnan(want)), (got, want)
        same = ~torch.isnan(want)
        finite = torch.isfinite(want)
        assert torch.equal(got[same & ~finite], want[same & ~finite]), (got, want)
        ulp = torch.finfo(want.dtype).eps
        torch.testing.assert_close(got[finite], want[finite], rtol=2 * ulp, atol=0)
        if signed_zeros:
            assert torch.equal(torch.signbit(got[same]), torch.signbit(want[same]))


CLAMPS = {
    "clamp": "x.clamp(-1.0, 1.0)",
    "clamp_min_at_zero": "x.clamp(min=0.0)",  # -0 stays -0
    "clamp_max": "x.clamp(max=-0.0)",
    "clamp_crossed": "x.clamp(min=1.0, max=-1.0)",  # lo > hi: hi everywhere but NaN
    "clamp_min": "torch.clamp_min(x, 0.25)",
    "hardtanh": "F.hardtanh(x, -2.0, 0.5)",
    "relu6": "F.relu6(x)",
    "clamp_bf16": "x.bfloat16().clamp(-1.0, 1.0)",
}


@pytest.mark.parametrize("name", sorted(CLAMPS))
def test_clamp_keeps_nan_and_signed_zero(kernel_file, name):
    """torch-mlir compared with ult / ugt: a NaN came back as the lower bound."""
    _assert_exact(_compile(kernel_file, CLAMPS[name]))


def test_clamp_of_integers_by_a_float_bound(kernel_file):
    """torch promotes to float; torch-mlir compared the i64 with cmpf and failed."""
    _assert_exact(_compile(kernel_file, "x.clamp(min=0.5), x.clamp(-3, 5)",
                           "torch.randint(-9, 9, (8, 13), generator=g)"))


def _assert_backward_matches(kernel_file, expr, inputs="special(16, 37, 0)"):
    """The loss `expr` (of x and a weight w over x's 37 columns) and its gradients in x and w,
    checked against torch's."""
    source = KERNEL.replace("def forward(self, {args}):", """def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-2, 2, 37))
    def forward(self, {args}):""")
    path = kernel_file(source.format(expr=expr, inputs=inputs, args="x"))
    reports = compile_kernel(path, backward=True).check()
    assert len(reports) == 3
    for report in reports:
        assert report.ok, str(report)


def test_clamp_backward_with_nan(kernel_file):
    """The gradient of hardtanh(x w) through NaN, inf and the bounds (torch-mlir's passed
    a NaN x's through)."""
    _assert_backward_matches(kernel_file, "F.hardtanh(x * self.w, -1.0, 1.0).nan_to_num().sum()")


ARG_REDUCTIONS = {
    "argmax_rows": "x.argmax(-1)",
    "argmin_rows": "x.argmin(-1)",
    "argmax_cols": "x.argmax(0)",
    "max_dim": "torch.max(x, 1)[0], torch.max(x, 1)[1]",
    "min_dim_keepdim": "torch.min(x, 0, keepdim=True)[1]",
    "argmax_bf16": "x.bfloat16().argmax(-1)",
    "argmax_f64": "x.double().argmax(-1)",
}


@pytest.mark.parametrize("name", sorted(ARG_REDUCTIONS))
def test_arg_reduction_takes_the_first_nan(kernel_file, name):
    """torch's argmax is the first NaN of a row holding one (rows of NaN, of -inf and ties
    too); torch-mlir's ogt never moved to a NaN."""
    _assert_exact(_compile(kernel_file, ARG_REDUCTIONS[name]))


def test_arg_reduction_without_nan_is_unchanged(kernel_file):
    """Ties keep the first index (the rewrite keeps ogt's strictness)."""
    _assert_exact(_compile(kernel_file, "x.argmax(-1), x.argmin(0)",
                           "torch.randint(0, 3, (16, 37), generator=g).float()"))


@pytest.mark.parametrize("expr", [
    "F.max_pool2d(x.view(2, 2, 4, 37)[..., :36], 2, 2, return_indices=True)",
    "F.max_pool2d(x.view(1, 4, 4, 37), 3, 2, padding=1, return_indices=True)",
    "F.max_pool1d(x.view(2, 8, 37), 4, 3, return_indices=True)",
    "F.adaptive_max_pool2d(x.view(2, 2, 4, 37), (2, 5), return_indices=True)",
    "F.adaptive_max_pool2d(x.view(2, 8, 37), (3, 6), return_indices=True)",
    "F.adaptive_max_pool1d(x, 5, return_indices=True)",
    "F.adaptive_max_pool2d(x.view(1, 4, 4, 37), (4, 37), return_indices=True)",
])
def test_max_pool_index_of_a_nan_window(kernel_file, expr):
    """torch's pooling index is the last NaN of a window holding one; torch-mlir searched
    for x == max, which no NaN passes (the index stayed -1). Adaptive windows that are not
    evenly spaced (37 -> 5, 8 -> 3) aborted the process at run time."""
    _assert_exact(_compile(kernel_file, expr), signed_zeros=False)


def test_uneven_adaptive_max_pool_backward(kernel_file):
    _assert_backward_matches(kernel_file,
                             "F.adaptive_max_pool2d((x * self.w).view(2, 8, 37), (3, 5)).sum()",
                             "torch.randn(16, 37, generator=g)")


@pytest.mark.parametrize("expr", [
    "x.scatter(-1, i, y)", "x.scatter(-1, i, 2.0)", "x.scatter_reduce(-1, i, y, 'amax')",
    "x.scatter_add(-1, i, y)", "x[:3].scatter_add(-2, i[:3, :4] % 3, y[:3, :4])",
])
def test_scatter_along_a_negative_dim(kernel_file, expr):
    """torch-mlir's lowering ran out of memory or crashed the process."""
    _assert_exact(_compile(kernel_file, expr, args="x, y, i", inputs=(
        "torch.randn(4, 10, generator=g), torch.randn(4, 6, generator=g), "
        "torch.randint(0, 10, (4, 6), generator=g)")))


def test_float_eq_of_itself(kernel_file):
    """torch-mlir folded eq(x, x) to true, which a NaN is not (x == x is the usual "not NaN"
    mask)."""
    _assert_exact(_compile(kernel_file, "x == x, x.eq(x.clone()), torch.where(x == x, x, 0.0), "
                           "x.long() == x.long()"))


@pytest.mark.parametrize("expr", [
    "torch.ones_like(x * 2) < 0, torch.ones_like(x * 2) > 0, torch.ones_like(x * 2) <= 0",
    "(lambda t: (t < 1, t < 3, t > 1, t >= 2, t == 2, t != 2))(torch.full_like(x * 2, 2.0))",
    "torch.where(torch.ones_like(x * 2) < 0, torch.ones_like(x).abs().log(), torch.tensor(-7.0)) - x",
    "(lambda t: (t.to(torch.bfloat16) < 1, t.double() >= 2))(torch.full_like(x, 2.0))",
])
def test_constant_compared_with_an_int(kernel_file, expr):
    """torch-mlir folded the compare of a constant float tensor with an int scalar wrongly
    (ones_like(y) < 0 all true, full_like(y, 2.0) == 2 all false); a float tensor is now
    compared with the scalar as a float."""
    _assert_exact(_compile(kernel_file, expr))


def test_logcumsumexp_backward_keeps_its_sign(kernel_file):
    """The gradient of logcumsumexp splits the incoming gradient into its positive and
    negative parts with where(g > 0, ...) and where(g < 0, ...); with g = ones both
    compares were folded the other way round, and the gradient came out negated."""
    compiled = _compile(kernel_file, "torch.logcumsumexp(x, 1)",
                        "torch.randn(8, 5, generator=g) * 10", backward=True)
    for report in compiled.check():
        assert report.ok, str(report)


@pytest.mark.parametrize("expr", [
    "torch.bucketize(x, b), torch.bucketize(x, b, right=True, out_int32=True)",
    "torch.searchsorted(b, x), torch.searchsorted(b, x, side='right')",
    "torch.searchsorted(x.nan_to_num().sort(-1).values, x.flip(-1))",
    "torch.dist(x.nan_to_num(), x.nan_to_num().flip(0)), torch.dist(x, x * 2, 3)",
])
def test_search_and_dist(kernel_file, expr):
    """No lowering in torch-mlir; NaN and +-inf values, values equal to a boundary."""
    _assert_exact(_compile(kernel_file, expr, args="x, b", inputs=(
        "special(16, 37, 0), torch.tensor([-1.0, 0.0, 2.0, 2.0, float('inf')])")))


@pytest.mark.parametrize("expr", [
    "y = x.clone(); y[x > 0] = -1.0; return y",
    "y = x.clone(); y[x[:, 0] > 0] = v; return y",
    "y = x.clone(); y[x < 0] = torch.tensor([7.0]); return y",
    "return x.index_put((x < -1,), torch.tensor(5.0), accumulate=True)",
])
def test_assignment_through_a_mask(kernel_file, expr):
    """x[mask] = v: torch-mlir's scatter at data-dependent positions left tm_tensor ops."""
    source = KERNEL.replace("        return {expr}", "        {expr}")
    path = kernel_file(source.format(expr=expr, args="x, v", inputs=(
        "torch.randn(6, 5, generator=g), torch.randn(5, generator=g)")))
    _assert_exact(compile_kernel(path))


@pytest.mark.parametrize("expr,inputs", [
    ("y = x * 2; y[x > 0] = -1.0; return y.sum()", "torch.randn(6, 5, generator=g)"),
    # a mask token (BERT, MAE): the gradient of the token sums x's gradient over the
    # masked rows, a read of data-dependent shape that the import now sums as a where
    ("y = x * self.w[:5]; y[y[:, :, 0] > 0] = self.w[5, 0]; return (y * y).sum()",
     "torch.randn(5, 6, 4, generator=g)"),
])
def test_assignment_through_a_mask_backward(kernel_file, expr, inputs):
    source = KERNEL.replace("        return {expr}", "        {expr}")
    if "self.w" in expr:
        source = source.replace("def forward(self, {args}):", """def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-2, 2, 36).view(9, 1, 4))
    def forward(self, {args}):""")
    path = kernel_file(source.format(expr=expr, args="x", inputs=inputs))
    reports = compile_kernel(path, backward=True).check()
    assert len(reports) == (3 if "self.w" in expr else 2)
    assert all(r.ok for r in reports), reports


def test_pow_half_is_sqrt(kernel_file):
    """pow(-inf, 0.5) is NaN and pow(-0, 0.5) is -0 in torch (sqrt), inf and +0 in C's pow."""
    _assert_exact(_compile(kernel_file, "x ** 0.5, x ** -0.5, torch.pow(x.double(), 0.5)"))


def test_isfinite(kernel_file):
    """torch-mlir has no lowering of isfinite."""
    _assert_exact(_compile(kernel_file, "torch.isfinite(x), torch.isfinite(x.bfloat16()), "
                           "torch.isfinite(x.nan_to_num().long())"))


@pytest.mark.parametrize("pad", [(-2, -3), (1, -1, -2, 2), (-1, 0, 0, 0, 1, -1), (-20, -17)])
def test_pad_with_negative_widths_crops(kernel_file, pad):
    """F.pad crops the sides with a negative width (all of a dim: zero-size)."""
    _assert_exact(_compile(kernel_file, f"F.pad(x.view(2, 8, 37), {pad}, value=-1.5)"))


def test_f64_math_exact(kernel_file):
    """f64 log1p, expm1 (LLVM's log(1 + x) and exp(x) - 1 kept no digit at 1e-9), erf and
    the inverse hyperbolics (no LLVM lowering) are the C library's, as torch's."""
    compiled = _compile(
        kernel_file, "torch.log1p(x), torch.expm1(x), torch.erf(x), torch.asinh(x), "
        "torch.atanh(x * 1e8), torch.acosh(1 + x.abs()), torch.log1p(x * 1e9)",
        "torch.randn(4, 33, generator=g, dtype=torch.float64) * 1e-9")
    assert "llvm.call @log1p" in str(compiled.module)
    _assert_exact(compiled)


def test_f32_expm1_of_small_arguments(kernel_file):
    """exp(x) - 1 returned 0 for |x| < 6e-8; expm1 keeps its relative accuracy."""
    compiled = _compile(kernel_file, "torch.expm1(x)",
                        "torch.randn(4, 33, generator=g) * 1e-7")
    got, want = compiled.run()[0], compiled.expected()[0]
    torch.testing.assert_close(got, want, rtol=3e-7, atol=0)


@pytest.mark.parametrize("expr,inputs,what", [
    ("a // 3", "torch.randint(0, 256, (8, 13), generator=g, dtype=torch.uint8)", "input a is"),
    ("(a * 100).to(torch.uint8).float()", "torch.randn(8, 13, generator=g)", "makes"),
])
def test_uint8_refused_in_one_line(kernel_file, expr, inputs, what):
    """The floor division crashed torch-mlir's lowering (a segfault); the conversion gave a
    wrong answer."""
    path = kernel_file(KERNEL.format(expr=expr, inputs=inputs, args="a"))
    with pytest.raises(IngressError, match=f"{what} a uint8 tensor"):
        compile_kernel(path)
    done = run_cli(str(path))
    assert done.returncode != 0 and "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "uint8" in errors[0], done.stderr


@pytest.mark.parametrize("expr", ["torch.nonzero(x > 0)", "x.masked_select(x > 0)",
                                  "F.gaussian_nll_loss(x, x * 2, x.abs() + 0.1)"])
def test_data_dependent_graphs_refused_in_one_line(kernel_file, expr):
    """A data-dependent shape, or a branch on a tensor's value (gaussian_nll_loss checks
    its variances): one line on stderr (torch printed the partial graph before it)."""
    path = kernel_file(KERNEL.format(expr=expr, inputs="torch.randn(4, 5)", args="x"))
    with pytest.raises(IngressError, match="the graph depends on the tensors' values"):
        compile_kernel(path)
    done = run_cli(str(path))
    assert done.returncode != 0
    assert [line for line in done.stderr.splitlines() if line.strip()] == \
        [line for line in done.stderr.splitlines() if line.startswith("error:")], done.stderr


def test_input_written_in_place_refused(kernel_file):
    path = kernel_file(KERNEL.format(expr="x.add_(1) * 2", inputs="torch.randn(4, 5)", args="x"))
    with pytest.raises(IngressError, match="writes its input x in place"):
        compile_kernel(path)
