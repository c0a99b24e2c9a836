"""annotate_fastmath: IR (FileCheck), numerics before/after on the CPU and against torch,
rejections (message and unchanged payload)."""

import pytest
import torch

from schedules.common import match
from transform_ext.annotate_fastmath import annotate_fastmath, parse_flags
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

SOFTMAX = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
func.func @main(%x: tensor<4x8xf32>) -> tensor<4x8xf32> {
  %ninf = arith.constant 0xFF800000 : f32
  %zero = arith.constant 0.0 : f32
  %re = tensor.empty() : tensor<4xf32>
  %mi = linalg.fill ins(%ninf : f32) outs(%re : tensor<4xf32>) -> tensor<4xf32>
  %m = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<4x8xf32>) outs(%mi : tensor<4xf32>) {
  ^bb0(%in: f32, %acc: f32):
    %0 = arith.maximumf %in, %acc : f32
    linalg.yield %0 : f32
  } -> tensor<4xf32>
  %e0 = tensor.empty() : tensor<4x8xf32>
  %e = linalg.generic {indexing_maps = [#id, #row, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x, %m : tensor<4x8xf32>, tensor<4xf32>) outs(%e0 : tensor<4x8xf32>) {
  ^bb0(%in: f32, %mx: f32, %out: f32):
    %0 = arith.subf %in, %mx fastmath<contract> : f32
    %1 = math.exp %0 : f32
    linalg.yield %1 : f32
  } -> tensor<4x8xf32>
  %si = linalg.fill ins(%zero : f32) outs(%re : tensor<4xf32>) -> tensor<4xf32>
  %s = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%e : tensor<4x8xf32>) outs(%si : tensor<4xf32>) {
  ^bb0(%in: f32, %acc: f32):
    %0 = arith.addf %in, %acc : f32
    linalg.yield %0 : f32
  } -> tensor<4xf32>
  %y = linalg.generic {indexing_maps = [#id, #row, #id], iterator_types = ["parallel", "parallel"]}
      ins(%e, %s : tensor<4x8xf32>, tensor<4xf32>) outs(%e0 : tensor<4x8xf32>) {
  ^bb0(%in: f32, %sum: f32, %out: f32):
    %0 = arith.divf %in, %sum : f32
    linalg.yield %0 : f32
  } -> tensor<4x8xf32>
  return %y : tensor<4x8xf32>
}
"""


def test_adds_flags_to_arith_and_math_ops():
    payload = parse(SOFTMAX)
    apply(payload, lambda root: annotate_fastmath(match(root, "func.func"), "afn"))
    check(payload, """
        CHECK: arith.maximumf %{{.*}}, %{{.*}} fastmath<afn> : f32
        CHECK: arith.subf %{{.*}}, %{{.*}} fastmath<contract,afn> : f32
        CHECK: math.exp %{{.*}} fastmath<afn> : f32
        CHECK: arith.addf %{{.*}}, %{{.*}} fastmath<afn> : f32
        CHECK: arith.divf %{{.*}}, %{{.*}} fastmath<afn> : f32
    """)


def test_only_ops_under_the_target():
    payload = parse(SOFTMAX)
    apply(payload, lambda root: annotate_fastmath(
        match(root, "linalg.generic"), ["reassoc", "nsz"]))
    check(payload, """
        CHECK-NOT: arith.constant {{.*}}fastmath
        CHECK: arith.maximumf %{{.*}}, %{{.*}} fastmath<reassoc,nsz> : f32
        CHECK: arith.subf %{{.*}}, %{{.*}} fastmath<reassoc,nsz,contract> : f32
    """)


def test_same_result_before_after_and_torch_with_masked_entries():
    torch.manual_seed(0)
    x = torch.randn(4, 8) * 10
    x[1, 3] = float("-inf")
    x[2, :7] = float("-inf")
    before = run_module(parse(SOFTMAX), [x])
    payload = parse(SOFTMAX)
    apply(payload, lambda root: annotate_fastmath(match(root, "func.func"), "afn,contract"))
    after = run_module(payload, [x])
    torch.testing.assert_close(after[0], before[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(after[0], torch.softmax(x, dim=1))


@pytest.mark.parametrize("flags, reason", [
    ("ninf", "ninf on an op that reads the constant -inf"),
    ("fast", "ninf on an op that reads the constant -inf"),
])
def test_rejects_ninf_where_infinities_are_read(flags, reason):
    payload = parse(SOFTMAX)
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: annotate_fastmath(match(root, "func.func"), flags))
    assert "transform_ext.annotate_fastmath: arith.maximumf" in message
    assert reason in message
    assert str(payload) == before


def test_rejects_nnan_on_an_op_reading_nan():
    payload = parse("""
        func.func @main(%x: f32) -> i1 {
          %nan = arith.constant 0x7FC00000 : f32
          %0 = arith.cmpf uno, %x, %nan : f32
          return %0 : i1
        }
    """)
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: annotate_fastmath(match(root, "func.func"), "nnan"))
    assert "transform_ext.annotate_fastmath: arith.cmpf" in message
    assert "nnan on an op that reads a NaN constant" in message
    assert str(payload) == before


def test_flags_are_validated_when_building():
    assert parse_flags("afn, contract") == ["contract", "afn"]
    assert parse_flags("fast") == ["reassoc", "nnan", "ninf", "nsz", "arcp", "contract", "afn"]
    with pytest.raises(ValueError, match="unknown fastmath flag 'fastest'"):
        parse_flags("fastest")
