"""expand_integer_powers: IR (FileCheck) and numerics of kernels with integer powers
against torch (negative bases, NaN, inf, 16-bit types, forward and backward)."""

import pytest
import torch

from lighthouse.compile import compile_kernel
from schedules.common import match
from transform_ext.expand_integer_powers import expand_integer_powers
from tests.transform_ext.helpers import apply, check, parse

POWERS = """
func.func @main(%x: f32, %v: vector<8xf32>, %n: i64) -> (f32, f32, f32, f32, vector<8xf32>, f32, f32) {
  %c0 = arith.constant 0 : i64
  %c2 = arith.constant 2 : i64
  %c3 = arith.constant 3 : i64
  %cm2 = arith.constant -2 : i64
  %c7 = arith.constant 7 : i64
  %c100 = arith.constant 100 : i64
  %sv = arith.constant dense<3> : vector<8xi64>
  %p0 = math.fpowi %x, %c0 : f32, i64
  %p2 = math.fpowi %x, %c2 : f32, i64
  %p3 = math.fpowi %x, %c3 : f32, i64
  %pm2 = math.fpowi %x, %cm2 : f32, i64
  %pv = math.fpowi %v, %sv : vector<8xf32>, vector<8xi64>
  %pn = math.fpowi %x, %n : f32, i64
  %p100 = math.fpowi %x, %c100 : f32, i64
  return %p0, %p2, %p3, %pm2, %pv, %pn, %p100 : f32, f32, f32, f32, vector<8xf32>, f32, f32
}
"""


def test_constant_exponents_become_products():
    payload = parse(POWERS)
    apply(payload, lambda root: expand_integer_powers(match(root, "func.func")))
    assert "math.fpowi" not in str(payload)
    check(payload, """
        CHECK: func.func @main(%[[X:[^:]*]]: f32, %[[V:[^:]*]]: vector<8xf32>, %[[N:[^:]*]]: i64)
        CHECK: %[[ONE:.*]] = arith.constant 1.000000e+00 : f32
        CHECK: %[[SQ:.*]] = arith.mulf %[[X]], %[[X]] : f32
        CHECK: %[[SQ2:.*]] = arith.mulf %[[X]], %[[X]] : f32
        CHECK: %[[CUBE:.*]] = arith.mulf %[[X]], %[[SQ2]] : f32
        CHECK: %[[SQ3:.*]] = arith.mulf %[[X]], %[[X]] : f32
        CHECK: %[[INV:.*]] = arith.divf %{{.*}}, %[[SQ3]] : f32
        CHECK: %[[VSQ:.*]] = arith.mulf %[[V]], %[[V]] : vector<8xf32>
        CHECK: %[[VCUBE:.*]] = arith.mulf %[[V]], %[[VSQ]] : vector<8xf32>
        CHECK: %[[NF:.*]] = arith.sitofp %[[N]] : i64 to f32
        CHECK: %[[PN:.*]] = math.powf %[[X]], %[[NF]] : f32
        CHECK: %[[P100:.*]] = math.powf %[[X]], %{{.*}} : f32
        CHECK: return %[[ONE]], %[[SQ]], %[[CUBE]], %[[INV]], %[[VCUBE]], %[[PN]], %[[P100]]
    """)


def test_seven_is_four_multiplies():
    payload = parse("""
        func.func @main(%x: f32) -> f32 {
          %c7 = arith.constant 7 : i64
          %p = math.fpowi %x, %c7 : f32, i64
          return %p : f32
        }""")
    apply(payload, lambda root: expand_integer_powers(match(root, "func.func")))
    assert str(payload).count("arith.mulf") == 4


KERNEL = """
import math
import torch
DTYPE = torch.float32
class Model(torch.nn.Module):
    def forward(self, x):
        gelu = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
        rms = x * torch.rsqrt((x ** 2).mean(-1, keepdim=True) + 1e-6)
        return gelu, rms, x ** 0, x ** -1, x.pow(-2), x ** 5, torch.pow(x, 2) + x.pow(1)
def get_inputs():
    x = torch.randn(6, 40) * 3
    x[0, 0], x[0, 1], x[0, 2], x[0, 3] = float("nan"), float("inf"), -float("inf"), 0.0
    return [x.to(DTYPE)]
def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_powers_match_torch(kernel_file, dtype):
    path = kernel_file(KERNEL)
    compiled = compile_kernel(path, overrides={"DTYPE": dtype})
    for r in compiled.check():
        assert r.ok, str(r)


def test_powers_backward_match_torch(kernel_file):
    path = kernel_file(KERNEL.replace("x[0, 0], x[0, 1], x[0, 2], x[0, 3] = "
                                      "float(\"nan\"), float(\"inf\"), -float(\"inf\"), 0.0",
                                      "x[0, 0] = 0.5"))
    compiled = compile_kernel(path, backward=True)
    for r in compiled.check():
        assert r.ok, str(r)


NARROW_POWERS = """
import torch
DTYPE = torch.float16
class Model(torch.nn.Module):
    def forward(self, x):
        return x ** 2, x.pow(3), x ** 4, x ** 5, x ** -1, x ** -2, torch.pow(x, 3.0) - x
def get_inputs():
    torch.manual_seed(0)
    return [(torch.randn(16, 67) * 30).to(DTYPE)]
def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_narrow_powers_are_torchs_bits(kernel_file, dtype):
    """f16/bf16 powers round as torch's kernels: once from f32 (bf16 x^3 and x^-2: after
    each bf16 multiply), also when fused with the ops around them."""
    compiled = compile_kernel(kernel_file(NARROW_POWERS), overrides={"DTYPE": dtype})
    for got, want in zip(compiled.run(), compiled.expected(), strict=True):
        assert torch.equal(got, want), (got.double() - want.double()).abs().max().item()


def test_a_half_precision_power_is_raised_in_f32():
    payload = parse("""
        func.func @f(%x: f16, %y: bf16) -> (f16, bf16, bf16) {
          %c3 = arith.constant 3 : i64
          %c4 = arith.constant 4 : i64
          %a = math.fpowi %x, %c3 : f16, i64
          %b = math.fpowi %y, %c4 : bf16, i64
          %c = math.fpowi %y, %c3 : bf16, i64
          return %a, %b, %c : f16, bf16, bf16
        }
    """)
    apply(payload, lambda root: expand_integer_powers(match(root, "func.func")))
    check(payload, """
        CHECK: %[[X:.*]] = arith.extf %arg0 : f16 to f32
        CHECK: %[[X2:.*]] = arith.mulf %[[X]], %[[X]] : f32
        CHECK: %[[X3:.*]] = arith.mulf %[[X]], %[[X2]] : f32
        CHECK: %[[A:.*]] = arith.truncf %[[X3]] : f32 to f16
        CHECK: %[[Y:.*]] = arith.extf %arg1 : bf16 to f32
        CHECK: %[[Y2:.*]] = arith.mulf %[[Y]], %[[Y]] : f32
        CHECK: %[[Y4:.*]] = arith.mulf %[[Y2]], %[[Y2]] : f32
        CHECK: %[[B:.*]] = arith.truncf %[[Y4]] : f32 to bf16
        CHECK: %[[Z:.*]] = arith.extf %arg1 : bf16 to f32
        CHECK: %[[Z2:.*]] = arith.mulf %[[Z]], %[[Z]] : f32
        CHECK: %[[Z2R:.*]] = arith.truncf %[[Z2]] : f32 to bf16
        CHECK: %[[Z2W:.*]] = arith.extf %[[Z2R]] : bf16 to f32
        CHECK: %[[Z3:.*]] = arith.mulf %[[Z]], %[[Z2W]] : f32
        CHECK: %[[C:.*]] = arith.truncf %[[Z3]] : f32 to bf16
        CHECK: return %[[A]], %[[B]], %[[C]]
    """)
