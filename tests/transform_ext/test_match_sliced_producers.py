"""match_sliced_producers: the linalg ops of the target's block that the target reads
through tensor.extract_slice (tagged with transform.annotate and FileChecked): not one read
whole inside it, nor one sliced only outside it; for a loop nested in a forall, the
producers in the forall's body; nothing (no failure) when there is none."""

from torch_mlir.dialects import transform

from schedules.common import match
from transform_ext.match_sliced_producers import match_sliced_producers
from tests.transform_ext.helpers import apply, check, parse

PAYLOAD = """
func.func @main(%x: tensor<16x8xf32>) -> (tensor<16x8xf32>, tensor<8x8xf32>) {
  %zero = arith.constant 0.0 : f32
  %c0 = arith.constant 0 : index
  %c4 = arith.constant 4 : index
  %c8 = arith.constant 8 : index
  %e = tensor.empty() : tensor<16x8xf32>
  %sliced = linalg.fill {sliced} ins(%zero : f32) outs(%e : tensor<16x8xf32>) -> tensor<16x8xf32>
  %whole = linalg.copy {whole} ins(%x : tensor<16x8xf32>) outs(%e : tensor<16x8xf32>) -> tensor<16x8xf32>
  %outside = linalg.copy {outside} ins(%x : tensor<16x8xf32>) outs(%e : tensor<16x8xf32>) -> tensor<16x8xf32>
  %cut = tensor.extract_slice %outside[0, 0] [8, 8] [1, 1] : tensor<16x8xf32> to tensor<8x8xf32>
  %r = scf.forall (%i) in (2) shared_outs(%o = %e) -> (tensor<16x8xf32>) {
    %t = tensor.extract_slice %sliced[0, 0] [8, 8] [1, 1] : tensor<16x8xf32> to tensor<8x8xf32>
    %inner = linalg.copy {inner} ins(%whole : tensor<16x8xf32>) outs(%e : tensor<16x8xf32>) -> tensor<16x8xf32>
    %l = scf.for %j = %c0 to %c8 step %c4 iter_args(%acc = %t) -> (tensor<8x8xf32>) {
      %piece = tensor.extract_slice %inner[0, %j] [8, 4] [1, 1] : tensor<16x8xf32> to tensor<8x4xf32>
      %u = tensor.insert_slice %piece into %acc[0, %j] [8, 4] [1, 1] : tensor<8x4xf32> into tensor<8x8xf32>
      scf.yield %u : tensor<8x8xf32>
    }
    scf.forall.in_parallel {
      tensor.parallel_insert_slice %l into %o[0, 0] [8, 8] [1, 1] : tensor<8x8xf32> into tensor<16x8xf32>
    }
  }
  %plain = linalg.copy {plain} ins(%x : tensor<16x8xf32>) outs(%r : tensor<16x8xf32>) -> tensor<16x8xf32>
  return %plain, %cut : tensor<16x8xf32>, tensor<8x8xf32>
}
"""


def test_matches_the_producers_read_through_slices_in_the_forall():
    module = parse(PAYLOAD)
    apply(module, lambda root: transform.AnnotateOp(
        match_sliced_producers(match(root, "scf.forall")), "producer"))
    check(module, """
        CHECK: linalg.fill {producer, sliced}
        CHECK: linalg.copy {whole} ins
        CHECK: linalg.copy {outside} ins
        CHECK: linalg.copy {inner} ins
        CHECK: linalg.copy {plain} ins
    """)


def test_matches_the_producers_of_a_loop_in_the_forall_body():
    module = parse(PAYLOAD)
    apply(module, lambda root: transform.AnnotateOp(
        match_sliced_producers(match(root, "scf.for")), "producer"))
    check(module, """
        CHECK: linalg.fill {sliced} ins
        CHECK: linalg.copy {inner, producer}
    """)


def test_matches_nothing_when_nothing_is_sliced():
    module = parse(PAYLOAD)
    before = str(module)
    apply(module, lambda root: transform.AnnotateOp(
        match_sliced_producers(match(root, "func.func")), "producer"))
    assert str(module) == before
