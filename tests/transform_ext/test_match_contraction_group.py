"""match_contraction_group: the ops of a function's next contraction kernel (each result
tagged with transform.annotate and FileChecked): the root, the epilogue before it (latest
first), the widened bias (side), the contraction, its fill and the widening prologue of A
and B; of two kernels, the one whose root comes first, not the first contraction; the
rejection of a function without a contraction."""

from torch_mlir.dialects import transform

from schedules.common import match
from transform_ext.match_contraction_group import match_contraction_group
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

ROLES = ("root", "epilogue", "side", "contraction", "fill", "prologue")

KERNEL = """
#id = affine_map<(i, j) -> (i, j)>
#col = affine_map<(i, j) -> (j)>
func.func @main(%a: tensor<4x8xf16>, %b: tensor<8x16xf16>, %bias: tensor<16xf16>,
                %x: tensor<4x16xf32>, %y: tensor<16x16xf32>) -> (tensor<4x16xf32>, tensor<4x16xf32>) {
  %zero = arith.constant 0.0 : f32
  %ea = tensor.empty() : tensor<4x8xf32>
  %aw = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%a : tensor<4x8xf16>) outs(%ea : tensor<4x8xf32>) attrs = {widen_a} {
  ^bb0(%v: f16, %o: f32):
    %0 = arith.extf %v : f16 to f32
    linalg.yield %0 : f32
  } -> tensor<4x8xf32>
  %eb = tensor.empty() : tensor<8x16xf32>
  %bw = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%b : tensor<8x16xf16>) outs(%eb : tensor<8x16xf32>) attrs = {widen_b} {
  ^bb0(%v: f16, %o: f32):
    %0 = arith.extf %v : f16 to f32
    linalg.yield %0 : f32
  } -> tensor<8x16xf32>
  %e = tensor.empty() : tensor<4x16xf32>
  %f = linalg.fill {fill_c} ins(%zero : f32) outs(%e : tensor<4x16xf32>) -> tensor<4x16xf32>
  %c = linalg.matmul {c} ins(%aw, %bw : tensor<4x8xf32>, tensor<8x16xf32>) outs(%f : tensor<4x16xf32>) -> tensor<4x16xf32>
  %biasw = linalg.generic {indexing_maps = [#col, #id], iterator_types = ["parallel", "parallel"]}
      ins(%bias : tensor<16xf16>) outs(%e : tensor<4x16xf32>) attrs = {bias} {
  ^bb0(%v: f16, %o: f32):
    %0 = arith.extf %v : f16 to f32
    linalg.yield %0 : f32
  } -> tensor<4x16xf32>
  %add = linalg.generic {indexing_maps = [#id, #id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%c, %biasw : tensor<4x16xf32>, tensor<4x16xf32>) outs(%e : tensor<4x16xf32>) attrs = {add} {
  ^bb0(%v: f32, %w: f32, %o: f32):
    %0 = arith.addf %v, %w : f32
    linalg.yield %0 : f32
  } -> tensor<4x16xf32>
  %relu = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%add : tensor<4x16xf32>) outs(%e : tensor<4x16xf32>) attrs = {relu} {
  ^bb0(%v: f32, %o: f32):
    %0 = arith.maximumf %v, %zero : f32
    linalg.yield %0 : f32
  } -> tensor<4x16xf32>
  %d = linalg.matmul {d} ins(%x, %y : tensor<4x16xf32>, tensor<16x16xf32>) outs(%e : tensor<4x16xf32>) -> tensor<4x16xf32>
  return %relu, %d : tensor<4x16xf32>, tensor<4x16xf32>
}
"""


def _tag(root):
    for handle, role in zip(match_contraction_group(match(root, "func.func")), ROLES):
        transform.AnnotateOp(handle, role)


def test_matches_the_kernel_whose_root_comes_first():
    payload = parse(KERNEL)
    apply(payload, _tag)
    check(payload, """
        CHECK: attrs =  {prologue, widen_a}
        CHECK: attrs =  {prologue, widen_b}
        CHECK: linalg.fill {fill, fill_c}
        CHECK: linalg.matmul {c, contraction}
        CHECK: attrs =  {bias, side}
        CHECK: attrs =  {add, epilogue}
        CHECK: attrs =  {relu, root}
        CHECK: linalg.matmul {d} ins
    """)


def test_a_later_contraction_with_an_earlier_root_comes_first():
    """The second contraction, with no epilogue, is its own root, before the first's relu
    when the relu moves after it."""
    text = KERNEL
    relu_at = text.index("  %relu = ")
    relu_end = text.index("  %d = ")
    relu = text[relu_at:relu_end]
    text = text[:relu_at] + text[relu_end:].replace("  return", relu + "  return")
    payload = parse(text)
    apply(payload, _tag)
    check(payload, """
        CHECK: linalg.matmul {c} ins
        CHECK: linalg.matmul {contraction, d, root}
        CHECK: attrs =  {relu} {
    """)


def test_the_epilogue_lists_the_latest_op_first():
    double = """%twice = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%add : tensor<4x16xf32>) outs(%e : tensor<4x16xf32>) attrs = {twice} {
  ^bb0(%v: f32, %o: f32):
    %0 = arith.addf %v, %v : f32
    linalg.yield %0 : f32
  } -> tensor<4x16xf32>
  %relu = """
    text = KERNEL.replace("  %relu = ", "  " + double, 1).replace("ins(%add : tensor<4x16xf32>) outs(%e : "
                                                                   "tensor<4x16xf32>) attrs = {relu}",
                                                                   "ins(%twice : tensor<4x16xf32>) outs(%e : "
                                                                   "tensor<4x16xf32>) attrs = {relu}")
    payload = parse(text)

    def tag(root):
        _, epilogue, *_ = match_contraction_group(match(root, "func.func"))
        latest, earlier = transform.SplitHandleOp([transform.AnyOpType.get()] * 2, epilogue).results
        transform.AnnotateOp(latest, "latest")
        transform.AnnotateOp(earlier, "earlier")

    apply(payload, tag)
    check(payload, """
        CHECK: attrs =  {add, earlier}
        CHECK: attrs =  {latest, twice}
        CHECK: attrs =  {relu} {
    """)


def test_rejects_a_function_without_a_contraction():
    text = """
    func.func @main(%x: tensor<4xf32>) -> tensor<4xf32> {
      %e = tensor.empty() : tensor<4xf32>
      %c = linalg.copy ins(%x : tensor<4xf32>) outs(%e : tensor<4xf32>) -> tensor<4xf32>
      return %c : tensor<4xf32>
    }
    """
    message = apply_expect_failure(parse(text), _tag)
    assert "transform_ext.match_contraction_group: func.func" in message
    assert "no contraction among the linalg ops of its body" in message
