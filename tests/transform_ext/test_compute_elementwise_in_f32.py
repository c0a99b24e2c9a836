"""compute_elementwise_in_f32: the rewritten bodies (FileCheck) and f16/bf16 chains that
give torch's eager results bit for bit, fused or not."""

import pytest
import torch

from lighthouse.compile import compile_kernel
from schedules.common import match
from tests.transform_ext.helpers import apply, check, parse
from transform_ext.compute_elementwise_in_f32 import compute_elementwise_in_f32

BODIES = """
#id = affine_map<(d0) -> (d0)>
func.func @main(%x: tensor<8xbf16>, %y: tensor<8xf16>, %z: tensor<8xf64>)
    -> (tensor<8xbf16>, tensor<8xf16>, tensor<8xbf16>, tensor<8xf32>, tensor<8xbf16>) {
  %scale = arith.constant 1.000000e-01 : f64
  %e16 = tensor.empty() : tensor<8xbf16>
  %eh = tensor.empty() : tensor<8xf16>
  %e32 = tensor.empty() : tensor<8xf32>
  %a = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel"]}
      ins(%x : tensor<8xbf16>) outs(%e16 : tensor<8xbf16>) {
  ^bb0(%in: bf16, %out: bf16):
    %s = arith.truncf %scale : f64 to bf16
    %m = arith.mulf %in, %s : bf16
    %one = arith.constant 1.0 : bf16
    %p = arith.addf %m, %one : bf16
    %q = math.exp %p : bf16
    linalg.yield %q : bf16
  } -> tensor<8xbf16>
  %b = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel"]}
      ins(%y : tensor<8xf16>) outs(%eh : tensor<8xf16>) {
  ^bb0(%in: f16, %out: f16):
    %zero = arith.constant 0.0 : f16
    %c = arith.cmpf ogt, %in, %zero : f16
    %n = arith.mulf %in, %in : f16
    %r = arith.select %c, %in, %n : f16
    linalg.yield %r : f16
  } -> tensor<8xf16>
  %e = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel"]}
      ins(%x : tensor<8xbf16>) outs(%e16 : tensor<8xbf16>) {
  ^bb0(%in: bf16, %out: bf16):
    %ninf = arith.truncf %scale : f64 to bf16
    %zero = arith.constant 0.0 : bf16
    %c = arith.cmpf ogt, %in, %zero : bf16
    %n = arith.negf %in : bf16
    %r = arith.select %c, %ninf, %n : bf16
    linalg.yield %r : bf16
  } -> tensor<8xbf16>
  %c = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel"]}
      ins(%z : tensor<8xf64>) outs(%e16 : tensor<8xbf16>) {
  ^bb0(%in: f64, %out: bf16):
    %t = arith.truncf %in : f64 to bf16
    linalg.yield %t : bf16
  } -> tensor<8xbf16>
  %d = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel"]}
      ins(%x : tensor<8xbf16>) outs(%e32 : tensor<8xf32>) {
  ^bb0(%in: bf16, %out: f32):
    %w = arith.extf %in : bf16 to f32
    linalg.yield %w : f32
  } -> tensor<8xf32>
  return %a, %b, %c, %d, %e : tensor<8xbf16>, tensor<8xf16>, tensor<8xbf16>, tensor<8xf32>,
      tensor<8xbf16>
}
"""


def test_narrow_bodies_compute_in_f32_and_round_once_at_the_yield():
    """Rounding ops compute in f32 and the yield rounds once; a scalar stays f32; conversions
    and bodies of exact ops only (a masked_fill's select) are left as they are."""
    payload = parse(BODIES)
    apply(payload, lambda root: compute_elementwise_in_f32(match(root, "func.func")))
    check(payload, """
        CHECK: ^bb0(%[[IN:.*]]: bf16, %{{.*}}: bf16):
        CHECK-NEXT: %[[X:.*]] = arith.extf %[[IN]] : bf16 to f32
        CHECK-NEXT: %[[S:.*]] = arith.truncf %{{.*}} : f64 to f32
        CHECK-NEXT: %[[M:.*]] = arith.mulf %[[X]], %[[S]] : f32
        CHECK: %[[P:.*]] = arith.addf %[[M]], %{{.*}} : f32
        CHECK-NEXT: %[[Q:.*]] = math.exp %[[P]] : f32
        CHECK-NEXT: %[[R:.*]] = arith.truncf %[[Q]] : f32 to bf16
        CHECK-NEXT: linalg.yield %[[R]] : bf16
        CHECK: ^bb0(%[[H:.*]]: f16, %{{.*}}: f16):
        CHECK-NEXT: %[[HW:.*]] = arith.extf %[[H]] : f16 to f32
        CHECK: arith.cmpf ogt, %[[H]], %{{.*}} : f16
        CHECK: %[[SQ:.*]] = arith.mulf %[[HW]], %[[HW]] : f32
        CHECK: %[[SEL:.*]] = arith.select %{{.*}}, %[[HW]], %[[SQ]] : f32
        CHECK-NEXT: %[[HR:.*]] = arith.truncf %[[SEL]] : f32 to f16
        CHECK-NEXT: linalg.yield %[[HR]] : f16
        CHECK: ^bb0(%[[B:.*]]: bf16, %{{.*}}: bf16):
        CHECK-NEXT: %[[NINF:.*]] = arith.truncf %{{.*}} : f64 to bf16
        CHECK: %[[CMP:.*]] = arith.cmpf ogt, %[[B]], %{{.*}} : bf16
        CHECK-NEXT: %[[NEG:.*]] = arith.negf %[[B]] : bf16
        CHECK-NEXT: %[[EX:.*]] = arith.select %[[CMP]], %[[NINF]], %[[NEG]] : bf16
        CHECK-NEXT: linalg.yield %[[EX]] : bf16
        CHECK: ^bb0(%[[Z:.*]]: f64, %{{.*}}: bf16):
        CHECK-NEXT: %[[T:.*]] = arith.truncf %[[Z]] : f64 to bf16
        CHECK-NEXT: linalg.yield %[[T]] : bf16
        CHECK: ^bb0(%[[E:.*]]: bf16, %{{.*}}: f32):
        CHECK-NEXT: %[[EW:.*]] = arith.extf %[[E]] : bf16 to f32
        CHECK-NEXT: linalg.yield %[[EW]] : f32
    """)


CHAINS = """
import torch
import torch.nn.functional as F
DTYPE = torch.bfloat16
class Model(torch.nn.Module):
    def forward(self, x, y):
        return (x * 3.0 + 1.0, x * 0.1 + y / 0.3, torch.sqrt((x * y).abs() + 1.0),
                torch.sigmoid(x) * x, torch.tanh(x) + 1, torch.exp(x) - 1,
                torch.where(x > 0, x, x * 0.01), torch.clamp(x, -1, 1) * 0.7,
                x ** 2 + x ** 3, x.pow(-2), x.mean(-1, keepdim=True) + x, x.sum(-1) / 3,
                F.silu(x) * y, F.hardswish(x), torch.addcmul(x, x, y, value=0.5))
def get_inputs():
    torch.manual_seed(0)
    return [(torch.randn(64, 37) * 3).to(DTYPE), torch.randn(1, 37).to(DTYPE)]
def get_init_inputs():
    return []
"""

LAYER_NORM_CHAIN = """
import torch
import torch.nn.functional as F
DTYPE = torch.bfloat16
class Model(torch.nn.Module):
    def forward(self, x, y):
        # a layer norm over three elements turns an ulp of its input into 0.1 of its output
        return F.layer_norm(torch.sqrt((x * y).abs() + 1.0), (3,)), torch.softmax(x * 2, -1) * 2
def get_inputs():
    torch.manual_seed(0)
    return [torch.randn(64, 3).to(DTYPE), torch.randn(1, 3).to(DTYPE)]
def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("source", [CHAINS, LAYER_NORM_CHAIN], ids=["chains", "layer_norm"])
def test_fused_narrow_chains_round_after_every_op_like_torch(kernel_file, source, dtype):
    """Each f16/bf16 op of a fused chain rounds its result as torch's eager op does (in f32
    with Python scalars as f32, integer powers and means included): torch's bits."""
    compiled = compile_kernel(kernel_file(source), overrides={"DTYPE": dtype})
    for got, want in zip(compiled.run(), compiled.expected(), strict=True):
        assert torch.equal(got, want), (got.double() - want.double()).abs().max().item()
