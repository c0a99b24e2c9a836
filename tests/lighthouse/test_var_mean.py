"""var_mean in one pass (lighthouse.ingress: f64 sums of x and x^2, merged into one sweep by
the generic schedule): layer, group and instance norms and var_mean itself against torch,
and the structure of a layer norm (x read once for its statistics, once to normalize)."""

import pytest
import torch

from lighthouse.compile import compile_kernel
from tests.transform_ext.helpers import check

KERNEL = """
import torch
import torch.nn.functional as F
class Model(torch.nn.Module):
    def forward(self, {args}):
        return {expr}
def get_inputs():
    g = torch.Generator().manual_seed(0)
    return {inputs}
def get_init_inputs():
    return []
"""


def _compile(kernel_file, expr, inputs, args="x", **kw):
    source = KERNEL.format(expr=expr, inputs=inputs, args=args)
    return compile_kernel(kernel_file(source), strict=True, **kw)


CASES = {
    # norms over several dims, odd sizes, weights and biases
    "layer_norm_3d": ("F.layer_norm(x, (5, 7, 11), w, b)",
                      "[torch.randn(3, 5, 7, 11, generator=g), torch.randn(5, 7, 11, generator=g), "
                      "torch.randn(5, 7, 11, generator=g)]", "x, w, b"),
    # a large offset: s2 - s1 mean cancels 6 digits, the f64 sums keep var to 1e-10
    "layer_norm_offset": ("F.layer_norm(x * 0.5 + 1000.0, (37,))",
                          "[torch.randn(6, 37, generator=g)]", "x"),
    "group_norm": ("F.group_norm(x, 3, w, b)",
                   "[torch.randn(2, 6, 5, 7, generator=g), torch.randn(6, generator=g), "
                   "torch.randn(6, generator=g)]", "x, w, b"),
    "instance_norm": ("F.instance_norm(x)", "[torch.rand(2, 3, 9, 13, generator=g)]", "x"),
    # var_mean itself: a reduced dim that is not innermost, both corrections, keepdim, a
    # second use of both results
    "var_mean_middle_dim": ("torch.var_mean(x, 1)", "[torch.randn(4, 33, 7, generator=g)]", "x"),
    "var_mean_keepdim_biased": ("torch.var_mean(x, (0, 2), correction=0, keepdim=True)",
                                "[torch.randn(4, 33, 7, generator=g)]", "x"),
    "var_mean_second_use": ("(lambda v, m: (v, m, x - m[:, None] / v[:, None]))"
                            "(*torch.var_mean(x, 1))", "[torch.randn(9, 65, generator=g)]", "x"),
    "var_mean_transposed": ("torch.var_mean(x.t(), 1)", "[torch.randn(40, 12, generator=g)]", "x"),
    # an inf in a row: that row's statistics and outputs are NaN, as torch's (max(NaN, 0)
    # must stay NaN), the other rows finite
    "layer_norm_inf": ("F.layer_norm(x, (19,))",
                       "[torch.randn(5, 19, generator=g).index_put_((torch.tensor(2), "
                       "torch.tensor(4)), torch.tensor(float('inf')))]", "x"),
    # one-element dims: a variance over one element (0, or NaN with correction 1, as torch)
    "layer_norm_one_element": ("F.layer_norm(x, (1,))", "[torch.randn(4, 1, generator=g)]", "x"),
    "var_one_element": ("torch.var_mean(x, 1)", "[torch.randn(4, 1, generator=g)]", "x"),
    # narrow floats: statistics in f32/f64, the result rounded once
    "layer_norm_bf16": ("F.layer_norm(x, (5, 33))",
                        "[torch.randn(3, 5, 33, generator=g).to(torch.bfloat16)]", "x"),
    "group_norm_f16": ("F.group_norm(x, 2)",
                       "[torch.randn(2, 4, 3, 17, generator=g).to(torch.float16)]", "x"),
}


@pytest.mark.parametrize("name", CASES)
def test_norms_match_torch(kernel_file, name):
    expr, inputs, args = CASES[name]
    reports = _compile(kernel_file, expr, inputs, args).check()
    assert reports
    for report in reports:
        assert report.ok, str(report)


def test_layer_norm_reads_x_once_for_its_statistics(kernel_file):
    """One op computes both f64 sums in one sweep over x (no f64 copy of x); the normalize
    is the only other reader of x."""
    compiled = _compile(kernel_file, "F.layer_norm(x, (8, 64))",
                        "[torch.randn(16, 8, 64, generator=g)]", stop_after="fuse")
    text = str(compiled.module)
    check(text, """
        CHECK-LABEL: func.func @main(%arg0: tensor<16x8x64xf32>)
        CHECK: scf.forall
        CHECK: %[[X:.*]] = tensor.extract_slice %arg0
        CHECK: %{{.*}}:2 = linalg.generic {{.*}} iterator_types = ["parallel", "reduction", "reduction"]
        CHECK-SAME: ins(%[[X]] : tensor<2x8x64xf32>) outs({{.*}} : tensor<2xf64>, tensor<2xf64>)
        CHECK: arith.extf
        CHECK: arith.addf
        CHECK: arith.mulf
        CHECK: arith.addf
        CHECK: linalg.generic {{.*}} iterator_types = ["parallel", "parallel", "parallel"]
        CHECK-SAME: ins(%[[X]],
        CHECK-NOT: linalg.generic
    """)
    assert "8x64xf64" not in text


def test_a_sum_of_squares_widened_to_f64_compiles(kernel_file):
    """sum(x.double() ** 2) of f32 x: the vectorized contraction of f32 operands into an f64
    accumulator is widened before it is lowered (it reached LLVM unlowered)."""
    reports = _compile(kernel_file, "(x.double() * x.double()).sum(1)",
                       "[torch.randn(6, 70, generator=g)]").check()
    assert reports and all(r.ok for r in reports)
