"""trace_to_argument: the function argument behind a chain of elementwise ops (through a
reshape of one row), and the refusal when a reduction is on the way."""

from torch_mlir import ir
from torch_mlir.dialects import transform

from schedules.common import match
from transform_ext.trace_to_argument import trace_to_argument, traced_argument
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

CHAIN = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
func.func @main(%x: tensor<4x8xbf16>, %r: tensor<1x8xf32>) -> (tensor<4xf32>, tensor<8xf32>) {
  %e = tensor.empty() : tensor<4x8xf32>
  %wide = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x : tensor<4x8xbf16>) outs(%e : tensor<4x8xf32>) {
  ^bb0(%a: bf16, %o: f32):
    %w = arith.extf %a : bf16 to f32
    linalg.yield %w : f32
  } -> tensor<4x8xf32>
  %ninf = arith.constant 0xFF800000 : f32
  %e1 = tensor.empty() : tensor<4xf32>
  %m0 = linalg.fill ins(%ninf : f32) outs(%e1 : tensor<4xf32>) -> tensor<4xf32>
  %m = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%wide : tensor<4x8xf32>) outs(%m0 : tensor<4xf32>) {
  ^bb0(%a: f32, %o: f32):
    %v = arith.maximumf %a, %o : f32
    linalg.yield %v : f32
  } -> tensor<4xf32>
  %row = tensor.collapse_shape %r [[0, 1]] : tensor<1x8xf32> into tensor<8xf32>
  %e2 = tensor.empty() : tensor<8xf32>
  %n = linalg.generic {indexing_maps = [affine_map<(d0) -> (d0)>, affine_map<(d0) -> (d0)>],
                       iterator_types = ["parallel"]} ins(%row : tensor<8xf32>) outs(%e2 : tensor<8xf32>) {
  ^bb0(%a: f32, %o: f32):
    %v = arith.negf %a : f32
    linalg.yield %v : f32
  } -> tensor<8xf32>
  return %m, %n : tensor<4xf32>, tensor<8xf32>
}
"""


def _generics(payload):
    func = next(op.operation for op in payload.body.operations)
    return [op.operation for op in func.regions[0].blocks[0].operations
            if op.operation.name == "linalg.generic"]


def test_traces_through_an_elementwise_cast_to_the_argument():
    payload = parse(CHAIN)
    with payload.context:
        wide, m, n = _generics(payload)
        x = traced_argument(m, 0)
    assert isinstance(x, ir.BlockArgument) and x.arg_number == 0


def test_stops_at_a_reshape_of_an_argument():
    """The value the ops read is the collapsed row: mark its defining op and look."""
    payload = parse(CHAIN)

    def body(root):
        negation = transform.SplitHandleOp([transform.AnyOpType.get()] * 3,
                                           match(root, "linalg.generic")).results[2]
        row = trace_to_argument(negation, 0)
        transform.AnnotateOp(transform.GetDefiningOp(transform.AnyOpType.get(), row).result,
                             "traced")

    apply(payload, body)
    check(str(payload), """
        CHECK: tensor.collapse_shape %arg1 {{.*}} {traced}
    """)


REDUCTION_ON_THE_WAY = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
#r = affine_map<(d0) -> (d0)>
func.func @main(%x: tensor<4x8xf32>) -> tensor<4xf32> {
  %ninf = arith.constant 0xFF800000 : f32
  %e1 = tensor.empty() : tensor<4xf32>
  %m0 = linalg.fill ins(%ninf : f32) outs(%e1 : tensor<4xf32>) -> tensor<4xf32>
  %m = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<4x8xf32>) outs(%m0 : tensor<4xf32>) {
  ^bb0(%a: f32, %o: f32):
    %v = arith.maximumf %a, %o : f32
    linalg.yield %v : f32
  } -> tensor<4xf32>
  %n = linalg.generic {indexing_maps = [#r, #r], iterator_types = ["parallel"]}
      ins(%m : tensor<4xf32>) outs(%e1 : tensor<4xf32>) {
  ^bb0(%a: f32, %o: f32):
    %v = arith.negf %a : f32
    linalg.yield %v : f32
  } -> tensor<4xf32>
  return %n : tensor<4xf32>
}
"""


def test_a_reduction_on_the_way_is_refused():
    """The negation of the row max: the max is no elementwise op."""
    payload = parse(REDUCTION_ON_THE_WAY)
    message = apply_expect_failure(payload, lambda root: trace_to_argument(
        transform.SplitHandleOp([transform.AnyOpType.get()] * 2,
                                match(root, "linalg.generic")).results[1], 0))
    assert "transform_ext.trace_to_argument: linalg.generic at" in message
    assert "operand 0 is computed by linalg.generic, not elementwise from a block argument" in message
