"""branch_math_on_small_lanes: a vector erf (tanh) runs only its small-argument polynomial
when every lane is below its bound (FileCheck on the rewritten IR); scalars and masked reads
are left alone; GELU and tanh compiled end to end match torch on small, mixed and large
lanes, values at the bounds, NaN, signed zeros, odd sizes, f16 and bf16 (torch's GELU of
+inf is NaN, ours inf: not compared)."""

import math

import pytest
import torch

from lighthouse.compile import compile_kernel
from schedules.common import match
from tests.transform_ext.helpers import apply, check, parse
from tests.transform_ext.test_branch_math_on_constant_lanes import _compile
from transform_ext.branch_math_on_small_lanes import branch_math_on_small_lanes

FUNCS = """
func.func @erf(%x: vector<2x8xf32>) -> vector<2x8xf32> {
  %e = math.erf %x : vector<2x8xf32>
  return %e : vector<2x8xf32>
}
func.func @tanh_bf16(%x: vector<8xbf16>) -> vector<8xbf16> {
  %t = math.tanh %x : vector<8xbf16>
  return %t : vector<8xbf16>
}
func.func @untouched(%x: vector<8xf32>, %s: f32, %t: tensor<?xf32>) -> (vector<8xf32>, f32, vector<8xf32>) {
  %q = math.exp %x : vector<8xf32>
  %se = math.erf %s : f32
  %i = arith.constant 0 : index
  %p = ub.poison : f32
  %v = vector.transfer_read %t[%i], %p : tensor<?xf32>, vector<8xf32>
  %ve = math.erf %v : vector<8xf32>
  return %q, %se, %ve : vector<8xf32>, f32, vector<8xf32>
}
"""


def _branched():
    payload = parse(FUNCS)
    apply(payload, lambda root: branch_math_on_small_lanes(match(root, "func.func")))
    payload.operation.verify()
    return str(payload)


def test_an_erf_branches_on_every_lane_below_its_bound():
    check(_branched(), """
        CHECK-LABEL: func.func @erf
        CHECK-SAME:  (%[[X:.*]]: vector<2x8xf32>)
        CHECK:       %[[A:.*]] = math.absf %[[X]]
        CHECK:       %[[BOUND:.*]] = arith.constant dense<8.750000e-01> : vector<2x8xf32>
        CHECK:       %[[IN:.*]] = arith.cmpf olt, %[[A]], %[[BOUND]]
        CHECK:       %[[FLAT:.*]] = vector.shape_cast %[[IN]] : vector<2x8xi1> to vector<16xi1>
        CHECK:       %[[ALL:.*]] = vector.reduction <and>, %[[FLAT]] : vector<16xi1> into i1
        CHECK:       %[[E:.*]] = scf.if %[[ALL]] -> (vector<2x8xf32>) {
        CHECK:         %[[X2:.*]] = arith.mulf %[[X]], %[[X]]
        CHECK-COUNT-5: math.fma %{{.*}}, %[[X2]]
        CHECK:         %[[P:.*]] = math.fma %{{.*}}, %[[X2]]
        CHECK-NEXT:    %[[S:.*]] = arith.mulf %[[X]], %[[P]]
        CHECK-NEXT:    scf.yield %[[S]]
        CHECK-NEXT:  } else {
        CHECK-NEXT:    %[[L:.*]] = math.erf %[[X]]
        CHECK-NEXT:    scf.yield %[[L]]
        CHECK:       return %[[E]]
    """)


def test_a_bf16_tanh_computes_its_polynomial_in_f32():
    check(_branched(), """
        CHECK-LABEL: func.func @tanh_bf16
        CHECK-SAME:  (%[[X:.*]]: vector<8xbf16>)
        CHECK:       %[[W:.*]] = arith.extf %[[X]] : vector<8xbf16> to vector<8xf32>
        CHECK:       arith.cmpf olt, %{{.*}}, %{{.*}} : vector<8xf32>
        CHECK:       scf.if %{{.*}} -> (vector<8xbf16>) {
        CHECK:         math.fma
        CHECK:         %[[R:.*]] = arith.truncf %{{.*}} : vector<8xf32> to vector<8xbf16>
        CHECK-NEXT:    scf.yield %[[R]]
        CHECK-NEXT:  } else {
        CHECK-NEXT:    math.tanh %[[X]] : vector<8xbf16>
    """)


def test_other_math_scalars_and_masked_reads_are_left_alone():
    text = _branched()
    untouched = text[text.index("func.func @untouched"):]
    assert "scf.if" not in untouched and untouched.count("math.erf") == 2


KERNELS = {"gelu": "torch.nn.functional.gelu(x)", "tanh": "torch.tanh(x) * 2"}


def _inputs(kind, shape=(16, 96), dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    if kind == "small":      # every GELU erf argument x / sqrt(2) below 0.875
        x = torch.rand(*shape, generator=g) * 0.6 - 0.3
    elif kind == "unit":     # KernelBench 26's torch.rand
        x = torch.rand(*shape, generator=g)
    else:
        x = torch.randn(*shape, generator=g) * (3 if kind == "mixed" else 1)
    if kind == "bounds":     # at and beside the bounds, and specials, among large lanes
        flat = x.view(-1)
        for i, v in enumerate([0.875 * math.sqrt(2), -0.875 * math.sqrt(2), 0.625, -0.625,
                               math.nextafter(0.625, 0), float("nan"), -0.0, 0.0]):
            flat[7 * i] = v
    return x.to(dtype)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("kind", ["small", "unit", "mixed", "bounds"])
def test_gelu_and_tanh_match_torch(kernel_file, tmp_path, kernel, kind):
    x = _inputs(kind)
    for report in _compile(kernel_file, tmp_path, KERNELS[kernel], x).check():
        assert report.ok, str(report)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_narrow_gelu_matches_torch(kernel_file, tmp_path, dtype):
    for kind in ("small", "mixed"):
        x = _inputs(kind, (5, 1537), dtype)
        for report in _compile(kernel_file, tmp_path, KERNELS["gelu"], x).check():
            assert report.ok, str(report)


def test_the_compiled_gelu_branches_before_its_long_polynomial(kernel_file, tmp_path):
    c = _compile(kernel_file, tmp_path, KERNELS["gelu"], _inputs("unit"), stop_after="vectorize")
    check(str(c.module), """
        CHECK:     arith.cmpf olt, %{{.*}}, %{{.*}} : vector<{{.*}}xf32>
        CHECK:     vector.reduction <and>
        CHECK:     scf.if
        CHECK:       math.fma
        CHECK:     } else {
        CHECK:       math.erf
    """)
