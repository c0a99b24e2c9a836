"""fill_slices_of_fills and drop_overwritten_fills on the parts of a split op: each part's
start becomes a fill of its own (a slice of the fill, and a slice past a disjoint insert into
it), a slice overlapping an insert stays; a fill whose every element the parts' inserts
overwrite goes, one they cover only in part (or along two dims) stays (FileCheck, and the
same numbers as before the rewrite); a target that is not a function is refused."""

import torch

from schedules.common import match
from transform_ext.drop_overwritten_fills import drop_overwritten_fills
from transform_ext.fill_slices_of_fills import fill_slices_of_fills
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

# y[:, :6] = x[:, :6] + 1 and y[:, 6:] = x[:, 6:] + 1, each part added onto its slice of a
# fill of 2, then z = a slice of x inserted into a filled tensor at columns 2:5 and the
# columns 4:8 of it read (overlapping the insert: not a slice of the fill)
SPLIT = """
#id = affine_map<(d0, d1) -> (d0, d1)>
func.func @main(%x: tensor<4x8xf32>) -> (tensor<4x8xf32>, tensor<4x4xf32>) {
  %two = arith.constant 2.0 : f32
  %e = tensor.empty() : tensor<4x8xf32>
  %f = linalg.fill ins(%two : f32) outs(%e : tensor<4x8xf32>) -> tensor<4x8xf32>
  %x0 = tensor.extract_slice %x[0, 0] [4, 6] [1, 1] : tensor<4x8xf32> to tensor<4x6xf32>
  %s0 = tensor.extract_slice %f[0, 0] [4, 6] [1, 1] : tensor<4x8xf32> to tensor<4x6xf32>
  %p0 = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x0 : tensor<4x6xf32>) outs(%s0 : tensor<4x6xf32>) {
  ^bb0(%a: f32, %acc: f32):
    %r = arith.addf %a, %acc : f32
    linalg.yield %r : f32
  } -> tensor<4x6xf32>
  %i0 = tensor.insert_slice %p0 into %f[0, 0] [4, 6] [1, 1] : tensor<4x6xf32> into tensor<4x8xf32>
  %x1 = tensor.extract_slice %x[0, 6] [4, 2] [1, 1] : tensor<4x8xf32> to tensor<4x2xf32>
  %s1 = tensor.extract_slice %i0[0, 6] [4, 2] [1, 1] : tensor<4x8xf32> to tensor<4x2xf32>
  %p1 = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x1 : tensor<4x2xf32>) outs(%s1 : tensor<4x2xf32>) {
  ^bb0(%a: f32, %acc: f32):
    %r = arith.addf %a, %acc : f32
    linalg.yield %r : f32
  } -> tensor<4x2xf32>
  %i1 = tensor.insert_slice %p1 into %i0[0, 6] [4, 2] [1, 1] : tensor<4x2xf32> into tensor<4x8xf32>
  %e2 = tensor.empty() : tensor<4x8xf32>
  %g = linalg.fill ins(%two : f32) outs(%e2 : tensor<4x8xf32>) -> tensor<4x8xf32>
  %x2 = tensor.extract_slice %x[0, 0] [4, 3] [1, 1] : tensor<4x8xf32> to tensor<4x3xf32>
  %j = tensor.insert_slice %x2 into %g[0, 2] [4, 3] [1, 1] : tensor<4x3xf32> into tensor<4x8xf32>
  %z = tensor.extract_slice %j[0, 4] [4, 4] [1, 1] : tensor<4x8xf32> to tensor<4x4xf32>
  return %i1, %z : tensor<4x8xf32>, tensor<4x4xf32>
}
"""


def _reference(x):
    z = torch.full((4, 8), 2.0)
    z[:, 2:5] = x[:, :3]
    return x + 2, z[:, 4:]


def test_each_part_starts_from_a_fill_of_its_own():
    payload = parse(SPLIT)
    apply(payload, lambda root: fill_slices_of_fills(match(root, "func.func")))
    text = str(payload)
    check(text, """
        CHECK: %[[EMPTY:.*]] = tensor.empty() : tensor<4x8xf32>
        CHECK-NEXT: %[[F:.*]] = linalg.fill ins(%{{.*}} : f32) outs(%[[EMPTY]] : tensor<4x8xf32>)
        CHECK: %[[E0:.*]] = tensor.extract_slice %[[EMPTY]][0, 0] [4, 6] [1, 1] : tensor<4x8xf32> to tensor<4x6xf32>
        CHECK-NEXT: %[[S0:.*]] = linalg.fill ins(%{{.*}} : f32) outs(%[[E0]] : tensor<4x6xf32>)
        CHECK: outs(%[[S0]] : tensor<4x6xf32>)
        CHECK: %[[I0:.*]] = tensor.insert_slice %{{.*}} into %[[F]][0, 0] [4, 6]
        CHECK: %[[E1:.*]] = tensor.extract_slice %[[EMPTY]][0, 6] [4, 2] [1, 1] : tensor<4x8xf32> to tensor<4x2xf32>
        CHECK-NEXT: %[[S1:.*]] = linalg.fill ins(%{{.*}} : f32) outs(%[[E1]] : tensor<4x2xf32>)
        CHECK: outs(%[[S1]] : tensor<4x2xf32>)
        CHECK: %[[J:.*]] = tensor.insert_slice %{{.*}}[0, 2] [4, 3]
        CHECK-NEXT: tensor.extract_slice %[[J]][0, 4] [4, 4]
    """)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    for got, want in zip(run_module(payload, [x]), _reference(x)):
        torch.testing.assert_close(got, want)


def test_a_fill_the_parts_overwrite_goes():
    payload = parse(SPLIT)
    apply(payload, lambda root: fill_slices_of_fills(match(root, "func.func")))
    apply(payload, lambda root: drop_overwritten_fills(match(root, "func.func")))
    text = str(payload)
    check(text, """
        CHECK: %[[E:.*]] = tensor.empty() : tensor<4x8xf32>
        CHECK: tensor.insert_slice %{{.*}} into %[[E]][0, 0] [4, 6]
        CHECK: %[[G:.*]] = linalg.fill ins(%{{.*}} : f32) outs(%{{.*}} : tensor<4x8xf32>)
        CHECK: tensor.insert_slice %{{.*}} into %[[G]][0, 2] [4, 3]
    """)
    # the two parts' fills and the partly overwritten %g stay; the whole %f goes
    assert text.count("linalg.fill") == 3
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for got, want in zip(run_module(payload, [x]), _reference(x)):
        torch.testing.assert_close(got, want)


def test_inserts_along_two_dims_do_not_count_as_covering():
    payload = parse("""
    func.func @main(%a: tensor<2x4xf32>, %b: tensor<2x4xf32>) -> tensor<4x8xf32> {
      %zero = arith.constant 0.0 : f32
      %e = tensor.empty() : tensor<4x8xf32>
      %f = linalg.fill ins(%zero : f32) outs(%e : tensor<4x8xf32>) -> tensor<4x8xf32>
      %i0 = tensor.insert_slice %a into %f[0, 0] [2, 4] [1, 1] : tensor<2x4xf32> into tensor<4x8xf32>
      %i1 = tensor.insert_slice %b into %i0[2, 4] [2, 4] [1, 1] : tensor<2x4xf32> into tensor<4x8xf32>
      return %i1 : tensor<4x8xf32>
    }
    """)
    apply(payload, lambda root: drop_overwritten_fills(match(root, "func.func")))
    assert "linalg.fill" in str(payload)


def test_reject_a_target_that_is_not_a_function():
    for op in (fill_slices_of_fills, drop_overwritten_fills):
        payload = parse(SPLIT)
        message = apply_expect_failure(payload, lambda root: op(match(root, "linalg.fill")))
        assert "linalg.fill" in message and "not a func.func" in message
