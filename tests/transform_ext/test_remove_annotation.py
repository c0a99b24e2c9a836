"""remove_annotation: IR (FileCheck) after transform.annotate and its removal, rejection of
a name that is not dialect-prefixed."""

from torch_mlir import ir
from torch_mlir.dialects import transform

from schedules.common import match
from transform_ext.remove_annotation import remove_annotation
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

PAYLOAD = """
func.func @main(%x: tensor<4xf32>) -> tensor<4xf32> {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<4xf32>
  %f = linalg.fill ins(%zero : f32) outs(%e : tensor<4xf32>) -> tensor<4xf32>
  %r = linalg.generic {indexing_maps = [affine_map<(d0) -> (d0)>, affine_map<(d0) -> (d0)>],
                       iterator_types = ["parallel"]} ins(%x : tensor<4xf32>) outs(%f : tensor<4xf32>) {
  ^bb0(%a: f32, %o: f32):
    %s = arith.addf %a, %o : f32
    linalg.yield %s : f32
  } -> tensor<4xf32>
  return %r : tensor<4xf32>
}
"""


def test_removes_the_attribute_from_every_nested_op():
    payload = parse(PAYLOAD)
    before = str(payload)

    def body(root):
        role = transform.ParamConstantOp(transform.AnyParamType.get(), ir.StringAttr.get("x")).param
        transform.AnnotateOp(match(root, ["linalg.fill", "linalg.generic", "arith.addf"]), "lh.role",
                             param=role)
        transform.AnnotateOp(match(root, "linalg.fill"), "lh.keep")
        remove_annotation(match(root, "func.func"), "lh.role")

    apply(payload, body)
    check(payload, """
        CHECK-NOT: lh.role
        CHECK: linalg.fill {lh.keep}
        CHECK-NOT: lh.role
    """)
    assert str(payload).replace(" {lh.keep}", "") == before


def test_rejects_an_attribute_name_without_a_dialect_prefix():
    payload = parse(PAYLOAD)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: remove_annotation(match(root, "linalg.generic"),
                                                                            "indexing_maps"))
    assert "transform_ext.remove_annotation: linalg.generic" in message
    assert "'indexing_maps' is not a dialect-prefixed (discardable) attribute name" in message
    assert str(payload) == before
