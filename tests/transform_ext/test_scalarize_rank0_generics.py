"""scalarize_rank0_generics: IR (FileCheck), rejection on buffers, and the loss kernel whose
0-d gather the vectorizer broke (cross-entropy with one row, generic schedule) vs torch."""

from lighthouse.compile import compile_kernel
from schedules.common import match
from transform_ext.scalarize_rank0_generics import scalarize_rank0_generics
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

RANK0 = """
#map = affine_map<() -> ()>
func.func @main(%logits: tensor<1x19xf32>, %t: tensor<i64>, %keep: tensor<i8>) -> tensor<f32> {
  %c0 = arith.constant 0 : index
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<f32>
  linalg.generic {indexing_maps = [#map], iterator_types = []} ins(%t : tensor<i64>) {
  ^bb0(%in: i64):
    %c19 = arith.constant 19 : i64
    %ok = arith.cmpi slt, %in, %c19 : i64
    cf.assert %ok, "index must be smaller than dim size"
    linalg.yield
  }
  %r = linalg.generic {indexing_maps = [#map, #map, #map], iterator_types = []}
      ins(%keep, %t : tensor<i8>, tensor<i64>) outs(%e : tensor<f32>) {
  ^bb0(%k: i8, %ti: i64, %out: f32):
    %b = arith.trunci %k : i8 to i1
    %i = arith.index_cast %ti : i64 to index
    %x = tensor.extract %logits[%c0, %i] : tensor<1x19xf32>
    %n = arith.negf %x : f32
    %s = arith.select %b, %n, %zero : f32
    linalg.yield %s : f32
  } -> tensor<f32>
  return %r : tensor<f32>
}
"""


def test_loop_free_generics_become_scalar_code():
    payload = parse(RANK0)
    apply(payload, lambda root: scalarize_rank0_generics(match(root, "func.func")))
    check(payload, """
        CHECK: func.func @main(%[[L:[^:]*]]: tensor<1x19xf32>, %[[T:[^:]*]]: tensor<i64>, %[[K:[^:]*]]: tensor<i8>)
        CHECK-NOT: linalg.generic
        CHECK: %[[T0:.*]] = tensor.extract %[[T]][] : tensor<i64>
        CHECK: cf.assert
        CHECK: %[[K0:.*]] = tensor.extract %[[K]][] : tensor<i8>
        CHECK: %[[B:.*]] = arith.trunci %[[K0]] : i8 to i1
        CHECK: %[[X:.*]] = tensor.extract %[[L]][%{{.*}}, %{{.*}}] : tensor<1x19xf32>
        CHECK: %[[N:.*]] = arith.negf %[[X]] : f32
        CHECK: %[[S:.*]] = arith.select %[[B]], %[[N]], %{{.*}} : f32
        CHECK: %[[R:.*]] = tensor.from_elements %[[S]] : tensor<f32>
        CHECK: return %[[R]]
    """)


def test_a_loop_free_generic_on_buffers_is_refused():
    payload = parse("""
        #map = affine_map<() -> ()>
        func.func @main(%a: memref<f32>, %b: memref<f32>) {
          linalg.generic {indexing_maps = [#map, #map], iterator_types = []}
              ins(%a : memref<f32>) outs(%b : memref<f32>) {
          ^bb0(%x: f32, %y: f32):
            linalg.yield %x : f32
          }
          return
        }""")
    message = apply_expect_failure(
        payload, lambda root: scalarize_rank0_generics(match(root, "func.func")))
    assert "transform_ext.scalarize_rank0_generics: linalg.generic at" in message
    assert "buffers" in message
    assert "linalg.generic" in str(payload)


def test_one_row_cross_entropy_with_the_generic_schedule(kernel_file):
    path = kernel_file("""
        import torch
        import torch.nn.functional as F
        class Model(torch.nn.Module):
            def forward(self, x, y):
                return F.cross_entropy(x, y), F.cross_entropy(x, y, reduction="sum")
        def get_inputs():
            return [torch.randn(1, 19), torch.tensor([7])]
        def get_init_inputs():
            return []
    """)
    for backward in (False, True):
        compiled = compile_kernel(path, schedule="generic", strict=True, backward=backward)
        for r in compiled.check():
            assert r.ok, str(r)
