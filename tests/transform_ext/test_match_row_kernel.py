"""match_row_kernel: the first row root of a function outside its contraction kernels and
its producer chain, latest first (tagged with transform.annotate and FileChecked); the
rejection of a function whose only linalg ops form a contraction kernel."""

from torch_mlir.dialects import transform

from schedules.common import match
from transform_ext.match_row_kernel import match_row_kernel
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

UNARY = """%{name} = linalg.generic {{indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}}
      ins(%{src} : tensor<4x8xf32>) outs(%e : tensor<4x8xf32>) attrs = {{{name}}} {{
  ^bb0(%v: f32, %o: f32):
    %0 = {fn} %v : f32
    linalg.yield %0 : f32
  }} -> tensor<4x8xf32>
"""
MATMUL = """
  %zero = arith.constant 0.0 : f32
  %f = linalg.fill {fill} ins(%zero : f32) outs(%ee : tensor<4x4xf32>) -> tensor<4x4xf32>
  %mm = linalg.matmul {mm} ins(%x, %y : tensor<4x8xf32>, tensor<8x4xf32>) outs(%f : tensor<4x4xf32>) -> tensor<4x4xf32>
"""


def payload(body: str, results: str, types: str) -> str:
    return f"""
#id = affine_map<(i, j) -> (i, j)>
func.func @main(%x: tensor<4x8xf32>, %y: tensor<8x4xf32>) -> ({types}) {{
  %e = tensor.empty() : tensor<4x8xf32>
  %ee = tensor.empty() : tensor<4x4xf32>
  {body}
  return {results} : {types}
}}
"""


def rows() -> str:
    body = (MATMUL + UNARY.format(name="a", src="x", fn="math.exp")
            + UNARY.format(name="b", src="a", fn="arith.negf")
            + UNARY.format(name="root", src="b", fn="math.absf")
            + UNARY.format(name="later", src="x", fn="math.sqrt"))
    return payload(body, "%mm, %root, %later", "tensor<4x4xf32>, tensor<4x8xf32>, tensor<4x8xf32>")


def test_matches_the_first_row_root_and_its_chain_outside_the_contraction():
    module = parse(rows())

    def tag(root):
        row_root, chain = match_row_kernel(match(root, "func.func"))
        transform.AnnotateOp(row_root, "row_root")
        latest, earlier = transform.SplitHandleOp([transform.AnyOpType.get()] * 2, chain).results
        transform.AnnotateOp(latest, "latest")
        transform.AnnotateOp(earlier, "earlier")

    apply(module, tag)
    check(module, """
        CHECK: linalg.fill {fill} ins
        CHECK: linalg.matmul {mm} ins
        CHECK: attrs =  {a, earlier}
        CHECK: attrs =  {b, latest}
        CHECK: attrs =  {root, row_root}
        CHECK: attrs =  {later} {
    """)


def test_rejects_a_function_with_only_a_contraction_kernel():
    module = parse(payload(MATMUL, "%mm", "tensor<4x4xf32>"))
    message = apply_expect_failure(module, lambda root: match_row_kernel(match(root, "func.func")))
    assert "transform_ext.match_row_kernel: func.func" in message
    assert "no linalg op outside the contraction kernels that no other reads" in message
