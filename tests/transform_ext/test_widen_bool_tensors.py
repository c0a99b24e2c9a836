"""widen_bool_tensors (and filter_by_element_type, which finds the named ops to generalize
first): IR (FileCheck), an unknown op leaving the payload alone, rejections, and a compiled
kernel with bool inputs and outputs against torch."""

import torch
from torch_mlir import ir
from torch_mlir.dialects import transform
from torch_mlir.dialects.transform import structured

from lighthouse.compile import compile_kernel
from schedules.common import any_op, match
from transform_ext.filter_by_element_type import filter_by_element_type
from transform_ext.widen_bool_tensors import widen_bool_tensors
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

BOOLS = """
#id = affine_map<(d0) -> (d0)>
func.func @main(%x: tensor<4xf32>, %m: tensor<4xi1>) -> (tensor<4xi1>, tensor<4xf32>, i1) {
  %zero = arith.constant 0.0 : f32
  %c1 = arith.constant 1 : index
  %pattern = arith.constant dense<[true, false, true, true]> : tensor<4xi1>
  %e = tensor.empty() : tensor<4xi1>
  %pos = linalg.generic {indexing_maps = [#id, #id, #id], iterator_types = ["parallel"]}
      ins(%x, %pattern : tensor<4xf32>, tensor<4xi1>) outs(%e : tensor<4xi1>) {
  ^bb0(%a: f32, %p: i1, %o: i1):
    %gt = arith.cmpf ogt, %a, %zero : f32
    %and = arith.andi %gt, %p : i1
    linalg.yield %and : i1
  } -> tensor<4xi1>
  %ef = tensor.empty() : tensor<4xf32>
  %sel = linalg.generic {indexing_maps = [#id, #id, #id], iterator_types = ["parallel"]}
      ins(%m, %x : tensor<4xi1>, tensor<4xf32>) outs(%ef : tensor<4xf32>) {
  ^bb0(%b: i1, %a: f32, %o: f32):
    %neg = arith.negf %a : f32
    %s = arith.select %b, %a, %neg : f32
    linalg.yield %s : f32
  } -> tensor<4xf32>
  %one = tensor.extract %m[%c1] : tensor<4xi1>
  return %pos, %sel, %one : tensor<4xi1>, tensor<4xf32>, i1
}
"""


def _widen(root):
    widen_bool_tensors(match(root, "func.func"))


def test_bool_tensors_are_stored_as_i8():
    payload = parse(BOOLS)
    apply(payload, _widen)
    payload.operation.verify()
    check(payload, """
        CHECK: func.func @main(%{{.*}}: tensor<4xf32>, %[[M:[a-z0-9_]+]]: tensor<4xi8>) -> (tensor<4xi8>, tensor<4xf32>, i1)
        CHECK: %[[P:.*]] = arith.constant dense<[1, 0, 1, 1]> : tensor<4xi8>
        CHECK: %[[E:.*]] = tensor.empty() : tensor<4xi8>
        CHECK: %[[POS:.*]] = linalg.generic {{.*}} ins(%{{.*}}, %[[P]] : tensor<4xf32>, tensor<4xi8>) outs(%[[E]] : tensor<4xi8>)
        CHECK-NEXT: ^bb0(%{{.*}}: f32, %[[PI:[a-z0-9_]+]]: i8, %{{.*}}: i8):
        CHECK-NEXT: %[[PB:.*]] = arith.trunci %[[PI]] : i8 to i1
        CHECK: %[[AND:.*]] = arith.andi %{{.*}}, %[[PB]] : i1
        CHECK: %[[W:.*]] = arith.extui %[[AND]] : i1 to i8
        CHECK: linalg.yield %[[W]] : i8
        CHECK: linalg.generic {{.*}} ins(%[[M]], %{{.*}} : tensor<4xi8>, tensor<4xf32>)
        CHECK-NEXT: ^bb0(%[[BI:[a-z0-9_]+]]: i8, %{{.*}}: f32, %{{.*}}: f32):
        CHECK-NEXT: %[[B:.*]] = arith.trunci %[[BI]] : i8 to i1
        CHECK: arith.select %[[B]]
        CHECK: %[[X:.*]] = tensor.extract %[[M]][%{{.*}}] : tensor<4xi8>
        CHECK-NEXT: %[[ONE:.*]] = arith.trunci %[[X]] : i8 to i1
        CHECK: return %[[POS]], %{{.*}}, %[[ONE]] : tensor<4xi8>, tensor<4xf32>, i1
    """)


def test_an_op_it_does_not_know_leaves_the_payload_alone():
    payload = parse("""
        func.func @main(%a: tensor<4xi1>, %b: tensor<4xi1>) -> tensor<4xi1> {
          %c = arith.andi %a, %b : tensor<4xi1>
          return %c : tensor<4xi1>
        }
    """)
    before = str(payload)
    apply(payload, _widen)
    assert str(payload) == before


def test_rejects_a_named_op_on_bool_tensors_then_generalized_it_widens():
    text = """
        func.func @main(%a: tensor<4xi1>) -> tensor<4xi1> {
          %e = tensor.empty() : tensor<4xi1>
          %c = linalg.copy ins(%a : tensor<4xi1>) outs(%e : tensor<4xi1>) -> tensor<4xi1>
          return %c : tensor<4xi1>
        }
    """
    payload = parse(text)
    before = str(payload)
    message = apply_expect_failure(payload, _widen)
    assert "transform_ext.widen_bool_tensors: linalg.copy" in message
    assert "generalize it first" in message
    assert str(payload) == before

    def generalize_then_widen(root):
        funcs = match(root, "func.func")
        linalg_ops = structured.MatchOp(any_op(), funcs,
                                        interface=structured.MatchInterfaceEnum.LinalgOp).result
        structured.GeneralizeOp(filter_by_element_type(linalg_ops, ir.IntegerType.get_signless(1)))
        widen_bool_tensors(funcs)

    apply(payload, generalize_then_widen)
    check(payload, """
        CHECK: func.func @main(%{{.*}}: tensor<4xi8>) -> tensor<4xi8>
        CHECK: linalg.generic
        CHECK: arith.trunci
        CHECK: arith.extui
    """)


def test_rejects_a_target_that_is_not_a_function():
    payload = parse(BOOLS)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: widen_bool_tensors(match(root, "linalg.generic")))
    assert "transform_ext.widen_bool_tensors: linalg.generic" in message
    assert "not a func.func" in message
    assert str(payload) == before


def test_filter_by_element_type_selects_ops_on_tensors_of_that_type():
    payload = parse(BOOLS)

    def body(root):
        ops = match(root, ["linalg.generic", "arith.constant", "tensor.extract"])
        transform.AnnotateOp(filter_by_element_type(ops, ir.IntegerType.get_signless(1)), "bools")
        transform.AnnotateOp(filter_by_element_type(ops, ir.F32Type.get()), "floats")

    apply(payload, body)
    check(payload, """
        CHECK: arith.constant 0.000000e+00 : f32
        CHECK-NEXT: arith.constant 1 : index
        CHECK-NEXT: arith.constant {bools} dense<[true, false, true, true]>
        CHECK: linalg.generic {{.*}} attrs =  {bools, floats}
        CHECK: linalg.generic {{.*}} attrs =  {bools, floats}
        CHECK: tensor.extract %{{.*}} {bools}
    """)


def test_a_kernel_on_bools_matches_torch(kernel_file):
    path = kernel_file("""
        import torch
        class Model(torch.nn.Module):
            def forward(self, x, m):
                return (x > 0) & m, torch.where(m, x, -x)
        def get_inputs():
            torch.manual_seed(0)
            return [torch.randn(8, 33), torch.rand(8, 33) > 0.5]
        def get_init_inputs():
            return []
    """)
    compiled = compile_kernel(path)
    for report in compiled.check():
        assert report.ok, str(report)
    x, m = torch.randn(8, 33), torch.rand(8, 33) > 0.5
    both, picked = compiled.run(x, m)
    assert both.dtype == torch.bool and torch.equal(both, (x > 0) & m)
    assert torch.equal(picked, torch.where(m, x, -x))
