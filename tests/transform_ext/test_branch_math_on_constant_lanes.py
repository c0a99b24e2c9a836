"""branch_math_on_constant_lanes: a costly math op of select(m, c, x) or min/max(x, c) runs
under scf.if (not every lane is c), its constant value in the then branch; scalars, selects
of no constant and masked reads are left alone; ELU, SELU and clamped exps compiled
end to end match torch on vectors of constant lanes, mixed lanes, NaN, infinities, signed
zeros, odd sizes, bf16 and transposed views."""

import pytest
import torch

from lighthouse.compile import compile_kernel
from schedules.common import match
from tests.transform_ext.helpers import apply, check, parse
from transform_ext.branch_math_on_constant_lanes import branch_math_on_constant_lanes

FUNCS = """
func.func @selects(%x: vector<2x8xf32>) -> (vector<2x8xf32>, vector<2x8xf32>, vector<2x8xf32>) {
  %zero = arith.constant dense<0.0> : vector<2x8xf32>
  %m = arith.cmpf olt, %zero, %x : vector<2x8xf32>
  %a = arith.select %m, %zero, %x : vector<2x8xi1>, vector<2x8xf32>
  %e = math.exp %a : vector<2x8xf32>
  %b = arith.select %m, %x, %zero : vector<2x8xi1>, vector<2x8xf32>
  %t = math.tanh %b : vector<2x8xf32>
  return %e, %t, %a : vector<2x8xf32>, vector<2x8xf32>, vector<2x8xf32>
}
func.func @extrema(%x: vector<8xf32>) -> (vector<8xf32>, vector<8xf32>) {
  %c = arith.constant dense<-1.5> : vector<8xf32>
  %a = arith.minimumf %x, %c : vector<8xf32>
  %e = math.log1p %a : vector<8xf32>
  %b = arith.maxnumf %c, %x : vector<8xf32>
  %f = math.erf %b : vector<8xf32>
  return %e, %f : vector<8xf32>, vector<8xf32>
}
func.func @untouched(%x: vector<8xf32>, %y: vector<8xf32>, %s: f32, %t: tensor<?xf32>)
    -> (vector<8xf32>, vector<8xf32>, f32, vector<8xf32>, vector<8xf32>) {
  %zero = arith.constant dense<0.0> : vector<8xf32>
  %z = arith.constant 0.0 : f32
  %i = arith.constant 0 : index
  %m = arith.cmpf olt, %zero, %x : vector<8xf32>
  %a = arith.select %m, %y, %x : vector<8xi1>, vector<8xf32>
  %e = math.exp %a : vector<8xf32>
  %sq = arith.select %m, %zero, %x : vector<8xi1>, vector<8xf32>
  %r = math.sqrt %sq : vector<8xf32>
  %sm = arith.cmpf olt, %z, %s : f32
  %sa = arith.select %sm, %z, %s : f32
  %se = math.exp %sa : f32
  %p = ub.poison : f32
  %v = vector.transfer_read %t[%i], %p : tensor<?xf32>, vector<8xf32>
  %vm = arith.minimumf %v, %zero : vector<8xf32>
  %ve = math.exp %vm : vector<8xf32>
  %w = vector.transfer_read %t[%i], %p {in_bounds = [true]} : tensor<?xf32>, vector<8xf32>
  %wm = arith.minimumf %w, %zero : vector<8xf32>
  %we = math.exp %wm : vector<8xf32>
  return %e, %r, %se, %ve, %we : vector<8xf32>, vector<8xf32>, f32, vector<8xf32>, vector<8xf32>
}
"""


def _branched():
    payload = parse(FUNCS)
    apply(payload, lambda root: branch_math_on_constant_lanes(match(root, "func.func")))
    payload.operation.verify()
    return str(payload)


def test_selects_of_a_constant_branch_on_their_mask():
    check(_branched(), """
        CHECK-LABEL: func.func @selects
        CHECK:       %[[ZERO:.*]] = arith.constant dense<0.0{{.*}}> : vector<2x8xf32>
        CHECK:       %[[M:.*]] = arith.cmpf olt
        CHECK:       %[[A:.*]] = arith.select %[[M]], %[[ZERO]], %{{.*}}
        CHECK:       %[[FLAT:.*]] = vector.shape_cast %[[M]] : vector<2x8xi1> to vector<16xi1>
        CHECK:       %[[ALL:.*]] = vector.reduction <and>, %[[FLAT]] : vector<16xi1> into i1
        CHECK:       %[[E:.*]] = scf.if %[[ALL]] -> (vector<2x8xf32>) {
        CHECK-NEXT:    %[[K:.*]] = math.exp %[[ZERO]]
        CHECK-NEXT:    scf.yield %[[K]]
        CHECK-NEXT:  } else {
        CHECK-NEXT:    %[[X:.*]] = math.exp %[[A]]
        CHECK-NEXT:    scf.yield %[[X]]
        CHECK:       %[[B:.*]] = arith.select %[[M]], %{{.*}}, %[[ZERO]]
        CHECK:       %[[ANY:.*]] = vector.reduction <or>, %{{.*}} : vector<16xi1> into i1
        CHECK:       %[[NONE:.*]] = arith.xori %[[ANY]], %{{.*}} : i1
        CHECK:       %[[T:.*]] = scf.if %[[NONE]]
        CHECK-NEXT:    math.tanh %[[ZERO]]
        CHECK:       } else {
        CHECK-NEXT:    math.tanh %[[B]]
        CHECK:       return %[[E]], %[[T]], %[[A]]
    """)


def test_extrema_with_a_constant_branch_on_a_compare():
    check(_branched(), """
        CHECK-LABEL: func.func @extrema
        CHECK:       %[[C:.*]] = arith.constant dense<-1.5{{.*}}> : vector<8xf32>
        CHECK:       %[[GE:.*]] = arith.cmpf oge, %[[X:.*]], %[[C]]
        CHECK-NEXT:  %[[A:.*]] = arith.minimumf %[[X]], %[[C]]
        CHECK:       vector.reduction <and>, %[[GE]]
        CHECK:       scf.if
        CHECK-NEXT:    math.log1p %[[C]]
        CHECK:       } else {
        CHECK-NEXT:    math.log1p %[[A]]
        CHECK:       %[[LE:.*]] = arith.cmpf ule, %[[X]], %[[C]]
        CHECK-NEXT:  %[[B:.*]] = arith.maxnumf %[[C]], %[[X]]
        CHECK:       vector.reduction <and>, %[[LE]]
        CHECK:       scf.if
        CHECK-NEXT:    math.erf %[[C]]
        CHECK:       } else {
        CHECK-NEXT:    math.erf %[[B]]
    """)


def test_no_constant_cheap_ops_scalars_and_masked_reads_are_left_alone():
    branched = _branched()
    untouched = branched[branched.index("@untouched"):]
    # only the exp of the in-bounds read branches: the select of two variables, the sqrt
    # (not costly), the scalar exp and the exp of a read whose lanes past the tensor's end
    # are poison stay as they were
    assert untouched.count("scf.if") == 1
    check(untouched, """
        CHECK:     %[[W:.*]] = vector.transfer_read {{.*}} {in_bounds = [true]}
        CHECK:     %[[WM:.*]] = arith.minimumf %[[W]]
        CHECK:     scf.if
        CHECK:     math.exp %[[WM]]
    """)


KERNEL = """
import torch
class Model(torch.nn.Module):
    def forward(self, x):
        return {expr}
def get_inputs():
    return [torch.load({path!r})]
def get_init_inputs():
    return []
"""


def _inputs(shape, kind, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    if kind == "non_negative":
        x = x.abs()
    elif kind == "non_positive":
        x = -x.abs()
    elif kind == "one_negative_lane":  # vectors of positive lanes with one lane below 0
        x = x.abs()
        x.view(-1)[5::37] *= -1
    elif kind == "specials":
        x = x.abs()
        flat = x.view(-1)
        flat[3], flat[40], flat[77], flat[100], flat[150] = (float("nan"), float("inf"),
                                                              float("-inf"), -0.0, 0.0)
    return x.to(dtype)


def _compile(kernel_file, tmp_path, expr, x, **kw):
    path = tmp_path / "x.pt"
    torch.save(x, path)
    return compile_kernel(kernel_file(KERNEL.format(expr=expr, path=str(path))), threads=1, **kw)


def _check(kernel_file, tmp_path, expr, x):
    for report in _compile(kernel_file, tmp_path, expr, x).check():
        assert report.ok, str(report)


ACTIVATIONS = ["torch.nn.functional.elu(x)", "torch.selu(x)",
               "torch.nn.functional.celu(x, alpha=0.5)",
               "torch.exp(torch.clamp(x, max=0.0)) + x.exp()"]


@pytest.mark.parametrize("expr", ACTIVATIONS)
@pytest.mark.parametrize("kind", ["non_negative", "non_positive", "mixed", "one_negative_lane",
                                  "specials"])
def test_activations_match_torch(kernel_file, tmp_path, expr, kind):
    _check(kernel_file, tmp_path, expr, _inputs((16, 96), kind))


@pytest.mark.parametrize("shape", [(7, 45), (5, 1537), (3, 0)])
def test_odd_and_empty_sizes(kernel_file, tmp_path, shape):
    _check(kernel_file, tmp_path, ACTIVATIONS[0], _inputs(shape, "one_negative_lane"))


def test_bf16_and_a_transposed_view(kernel_file, tmp_path):
    _check(kernel_file, tmp_path, "torch.selu(x)", _inputs((96, 40), "one_negative_lane", torch.bfloat16))
    _check(kernel_file, tmp_path, "torch.nn.functional.elu(x.t()) * 2", _inputs((96, 40), "one_negative_lane"))


def test_the_compiled_elu_skips_its_exp_on_non_negative_vectors(kernel_file, tmp_path):
    c = _compile(kernel_file, tmp_path, ACTIVATIONS[0], _inputs((16, 96), "mixed"),
                 stop_after="vectorize")
    check(str(c.module), """
        CHECK:     %[[M:.*]] = arith.cmpf olt, %[[ZERO:.*]], %[[X:.*]] : vector<1x{{[0-9]+}}xf32>
        CHECK:     %[[A:.*]] = arith.select %[[M]], %[[ZERO]], %[[X]]
        CHECK:     vector.reduction <and>
        CHECK:     scf.if
        CHECK:       math.exp %[[ZERO]]
        CHECK:     } else {
        CHECK:       math.exp %[[A]]
    """)
