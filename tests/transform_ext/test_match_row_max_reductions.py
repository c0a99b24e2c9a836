"""match_row_max_reductions: in the first scf.forall whose body holds a max reduction (a
forall without one is passed over): the row max, the other reductions and the elementwise
chain of its input (tagged with transform.annotate and FileChecked); the rejection of a
payload without such a forall."""

from torch_mlir.dialects import transform

from transform_ext.match_row_max_reductions import match_row_max_reductions
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

PAYLOAD = """
#id = affine_map<(i, j) -> (i, j)>
#row = affine_map<(i, j) -> (i)>
func.func @main(%x: tensor<4x8xf16>) -> (tensor<4x8xf32>, tensor<4x8xf32>) {
  %e = tensor.empty() : tensor<4x8xf32>
  %first = scf.forall (%i) in (2) shared_outs(%o = %e) -> (tensor<4x8xf32>) {
    %t = tensor.extract_slice %x[0, 0] [2, 8] [1, 1] : tensor<4x8xf16> to tensor<2x8xf16>
    %ot = tensor.extract_slice %o[0, 0] [2, 8] [1, 1] : tensor<4x8xf32> to tensor<2x8xf32>
    %w = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
        ins(%t : tensor<2x8xf16>) outs(%ot : tensor<2x8xf32>) attrs = {plain} {
    ^bb0(%v: f16, %out: f32):
      %0 = arith.extf %v : f16 to f32
      linalg.yield %0 : f32
    } -> tensor<2x8xf32>
    scf.forall.in_parallel {
      tensor.parallel_insert_slice %w into %o[0, 0] [2, 8] [1, 1] : tensor<2x8xf32> into tensor<4x8xf32>
    }
  }
  %r = scf.forall (%i) in (2) shared_outs(%o = %e) -> (tensor<4x8xf32>) {
    %ninf = arith.constant 0xFF800000 : f32
    %zero = arith.constant 0.0 : f32
    %t = tensor.extract_slice %x[0, 0] [2, 8] [1, 1] : tensor<4x8xf16> to tensor<2x8xf16>
    %ot = tensor.extract_slice %o[0, 0] [2, 8] [1, 1] : tensor<4x8xf32> to tensor<2x8xf32>
    %w = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
        ins(%t : tensor<2x8xf16>) outs(%ot : tensor<2x8xf32>) attrs = {widen} {
    ^bb0(%v: f16, %out: f32):
      %0 = arith.extf %v : f16 to f32
      linalg.yield %0 : f32
    } -> tensor<2x8xf32>
    %n = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
        ins(%w : tensor<2x8xf32>) outs(%ot : tensor<2x8xf32>) attrs = {negate} {
    ^bb0(%v: f32, %out: f32):
      %0 = arith.negf %v : f32
      linalg.yield %0 : f32
    } -> tensor<2x8xf32>
    %er = tensor.empty() : tensor<2xf32>
    %fm = linalg.fill {fill_max} ins(%ninf : f32) outs(%er : tensor<2xf32>) -> tensor<2xf32>
    %m = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
        ins(%n : tensor<2x8xf32>) outs(%fm : tensor<2xf32>) attrs = {max} {
    ^bb0(%v: f32, %acc: f32):
      %0 = arith.maximumf %v, %acc : f32
      linalg.yield %0 : f32
    } -> tensor<2xf32>
    %ex = linalg.generic {indexing_maps = [#id, #row, #id], iterator_types = ["parallel", "parallel"]}
        ins(%n, %m : tensor<2x8xf32>, tensor<2xf32>) outs(%ot : tensor<2x8xf32>) attrs = {exp} {
    ^bb0(%v: f32, %mx: f32, %out: f32):
      %0 = arith.subf %v, %mx : f32
      %1 = math.exp %0 : f32
      linalg.yield %1 : f32
    } -> tensor<2x8xf32>
    %fs = linalg.fill {fill_sum} ins(%zero : f32) outs(%er : tensor<2xf32>) -> tensor<2xf32>
    %l = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
        ins(%ex : tensor<2x8xf32>) outs(%fs : tensor<2xf32>) attrs = {sum} {
    ^bb0(%v: f32, %acc: f32):
      %0 = arith.addf %v, %acc : f32
      linalg.yield %0 : f32
    } -> tensor<2xf32>
    %y = linalg.generic {indexing_maps = [#id, #row, #id], iterator_types = ["parallel", "parallel"]}
        ins(%ex, %l : tensor<2x8xf32>, tensor<2xf32>) outs(%ot : tensor<2x8xf32>) attrs = {div} {
    ^bb0(%v: f32, %s: f32, %out: f32):
      %0 = arith.divf %v, %s : f32
      linalg.yield %0 : f32
    } -> tensor<2x8xf32>
    scf.forall.in_parallel {
      tensor.parallel_insert_slice %y into %o[0, 0] [2, 8] [1, 1] : tensor<2x8xf32> into tensor<4x8xf32>
    }
  }
  return %first, %r : tensor<4x8xf32>, tensor<4x8xf32>
}
"""


def _tag(root):
    row_max, dependent, data = match_row_max_reductions(root)
    transform.AnnotateOp(row_max, "row_max")
    transform.AnnotateOp(dependent, "dependent")
    closest, farther = transform.SplitHandleOp([transform.AnyOpType.get()] * 2, data).results
    transform.AnnotateOp(closest, "closest")
    transform.AnnotateOp(farther, "farther")


def test_matches_the_row_max_its_sibling_reductions_and_its_input_chain():
    module = parse(PAYLOAD)
    apply(module, _tag)
    check(module, """
        CHECK: attrs =  {plain} {
        CHECK: attrs =  {farther, widen}
        CHECK: attrs =  {closest, negate}
        CHECK: linalg.fill {fill_max} ins
        CHECK: attrs =  {max, row_max}
        CHECK: attrs =  {exp} {
        CHECK: linalg.fill {fill_sum} ins
        CHECK: attrs =  {dependent, sum}
        CHECK: attrs =  {div} {
    """)


def test_rejects_a_payload_without_a_row_max_forall():
    module = parse(PAYLOAD.replace("arith.maximumf", "arith.addf"))
    message = apply_expect_failure(module, _tag)
    assert "transform_ext.match_row_max_reductions: builtin.module" in message
    assert "no scf.forall with a max reduction in its body" in message
