"""match_logits_contraction: the contraction the loss's row max reads (through a bias add),
in a function or a loop body; a row max over an argument is refused with the reason."""

from torch_mlir.dialects import transform

from schedules.common import match
from transform_ext.match_logits_contraction import match_logits_contraction
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

LOSS = """
func.func @main(%h: tensor<8x16xf32>, %w: tensor<40x16xf32>, %b: tensor<40xf32>) -> tensor<8xf32> {
  %zero = arith.constant 0.0 : f32
  %ninf = arith.constant 0xFF800000 : f32
  %e0 = tensor.empty() : tensor<16x40xf32>
  %wt = linalg.transpose ins(%w : tensor<40x16xf32>) outs(%e0 : tensor<16x40xf32>) permutation = [1, 0]
  %e1 = tensor.empty() : tensor<8x40xf32>
  %f1 = linalg.fill ins(%zero : f32) outs(%e1 : tensor<8x40xf32>) -> tensor<8x40xf32>
  %s = linalg.matmul ins(%h, %wt : tensor<8x16xf32>, tensor<16x40xf32>) outs(%f1 : tensor<8x40xf32>) -> tensor<8x40xf32>
  %x = linalg.generic {indexing_maps = [affine_map<(n, v) -> (n, v)>, affine_map<(n, v) -> (v)>, affine_map<(n, v) -> (n, v)>], iterator_types = ["parallel", "parallel"]} ins(%s, %b : tensor<8x40xf32>, tensor<40xf32>) outs(%e1 : tensor<8x40xf32>) {
  ^bb0(%a: f32, %c: f32, %o: f32):
    %r = arith.addf %a, %c : f32
    linalg.yield %r : f32
  } -> tensor<8x40xf32>
  %e2 = tensor.empty() : tensor<8xf32>
  %f2 = linalg.fill ins(%ninf : f32) outs(%e2 : tensor<8xf32>) -> tensor<8xf32>
  %m = linalg.generic {indexing_maps = [affine_map<(n, v) -> (n, v)>, affine_map<(n, v) -> (n)>], iterator_types = ["parallel", "reduction"]} ins(%ARG : tensor<8x40xf32>) outs(%f2 : tensor<8xf32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.maximumf %a, %o : f32
    linalg.yield %r : f32
  } -> tensor<8xf32>
  return %m : tensor<8xf32>
}
"""


def test_the_contraction_read_through_the_bias_add():
    payload = parse(LOSS.replace("%ARG", "%x"))

    def body(root):
        found = match_logits_contraction(match(root, "func.func"))
        transform.AnnotateOp(found, "found")

    apply(payload, body)
    check(str(payload), "CHECK: linalg.matmul {found}")


def test_a_loss_over_an_argument_is_refused():
    payload = parse(LOSS.replace("ins(%ARG : tensor<8x40xf32>)", "ins(%arg : tensor<8x40xf32>)")
                    .replace("%b: tensor<40xf32>)", "%b: tensor<40xf32>, %arg: tensor<8x40xf32>)"))
    message = apply_expect_failure(payload, lambda root: match_logits_contraction(
        match(root, "func.func")))
    assert "the row max does not read a contraction" in message
