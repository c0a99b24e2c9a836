"""Small restructured cross-entropy payloads (N = 4 rows, C = 16 classes) for the tests of the
XeGPU loss ops, in the form schedules/cross_entropy/xegpu.py hands them over: the valid flag
and clamped target from y, the host target check, the row max, exp-sum and target gather, the
per-row losses, the count and the loss sum over the rows, the mean, and a gradient-like
[4, 16] op scaled by the count (so the count runs before the row kernel)."""

import torch

LOSS = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
#all = affine_map<(d0, d1) -> ()>
#r = affine_map<(d0) -> (d0)>
#s = affine_map<(d0) -> ()>
#e = affine_map<() -> ()>
func.func @main(%x: tensor<4x16xf32>, %y: tensor<4xi64>) -> (tensor<f32>, tensor<4x16xf32>) {
  %c16 = arith.constant 16 : index
  %ign = arith.constant -100 : i64
  %zero_i = arith.constant 0 : i64
  %ninf = arith.constant 0xFF800000 : f32
  %zero = arith.constant 0.0 : f32
  %e4 = tensor.empty() : tensor<4xf32>
  %e4b = tensor.empty() : tensor<4xi8>
  %e4i = tensor.empty() : tensor<4xi64>
  %e0 = tensor.empty() : tensor<f32>
  %e2 = tensor.empty() : tensor<4x16xf32>
  %valid = linalg.generic {indexing_maps = [#r, #r], iterator_types = ["parallel"]}
      ins(%y : tensor<4xi64>) outs(%e4b : tensor<4xi8>) {
  ^bb0(%a: i64, %o: i8):
    %v = arith.cmpi ne, %a, %ign : i64
    %w = arith.extui %v : i1 to i8
    linalg.yield %w : i8
  } -> tensor<4xi8>
  %t = linalg.generic {indexing_maps = [#r, #r, #r], iterator_types = ["parallel"]}
      ins(%valid, %y : tensor<4xi8>, tensor<4xi64>) outs(%e4i : tensor<4xi64>) {
  ^bb0(%v: i8, %a: i64, %o: i64):
    %b = arith.trunci %v : i8 to i1
    %s = arith.select %b, %a, %zero_i : i64
    linalg.yield %s : i64
  } -> tensor<4xi64>
  linalg.generic {indexing_maps = [#r], iterator_types = ["parallel"]} ins(%t : tensor<4xi64>) {
  ^bb0(%a: i64):
    %i = arith.index_cast %a : i64 to index
    %lt = arith.cmpi slt, %i, %c16 : index
    cf.assert %lt, "index must be smaller than dim size"
    %ge = arith.cmpi sge, %a, %zero_i : i64
    cf.assert %ge, "index must be larger or equal to 0"
    linalg.yield
  }
  %m0 = linalg.fill ins(%ninf : f32) outs(%e4 : tensor<4xf32>) -> tensor<4xf32>
  %m = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<4x16xf32>) outs(%m0 : tensor<4xf32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.maximumf %a, %o : f32
    linalg.yield %r : f32
  } -> tensor<4xf32>
  %l0 = linalg.fill ins(%zero : f32) outs(%e4 : tensor<4xf32>) -> tensor<4xf32>
  %l = linalg.generic {indexing_maps = [#id, #row, #row], iterator_types = ["parallel", "reduction"]}
      ins(%x, %m : tensor<4x16xf32>, tensor<4xf32>) outs(%l0 : tensor<4xf32>) {
  ^bb0(%a: f32, %b: f32, %o: f32):
    %d = arith.subf %a, %b : f32
    %ex = math.exp %d : f32
    %r = arith.addf %ex, %o : f32
    linalg.yield %r : f32
  } -> tensor<4xf32>
  %xt = linalg.generic {indexing_maps = [#r, #r], iterator_types = ["parallel"]}
      ins(%t : tensor<4xi64>) outs(%e4 : tensor<4xf32>) {
  ^bb0(%a: i64, %o: f32):
    %i = linalg.index 0 : index
    %j = arith.index_cast %a : i64 to index
    %g = tensor.extract %x[%i, %j] : tensor<4x16xf32>
    linalg.yield %g : f32
  } -> tensor<4xf32>
  %loss = linalg.generic {indexing_maps = [#r, #r, #r, #r, #r], iterator_types = ["parallel"]}
      ins(%valid, %m, %l, %xt : tensor<4xi8>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>)
      outs(%e4 : tensor<4xf32>) {
  ^bb0(%v: i8, %a: f32, %b: f32, %c: f32, %o: f32):
    %lg = math.log %b : f32
    %s = arith.addf %a, %lg : f32
    %d = arith.subf %s, %c : f32
    %bv = arith.trunci %v : i8 to i1
    %r = arith.select %bv, %d, %zero : f32
    linalg.yield %r : f32
  } -> tensor<4xf32>
  %s0 = linalg.fill ins(%zero : f32) outs(%e0 : tensor<f32>) -> tensor<f32>
  %count = linalg.generic {indexing_maps = [#r, #s], iterator_types = ["reduction"]}
      ins(%valid : tensor<4xi8>) outs(%s0 : tensor<f32>) {
  ^bb0(%v: i8, %o: f32):
    %b = arith.trunci %v : i8 to i1
    %f = arith.uitofp %b : i1 to f32
    %r = arith.addf %f, %o : f32
    linalg.yield %r : f32
  } -> tensor<f32>
  %sum = linalg.generic {indexing_maps = [#r, #s], iterator_types = ["reduction"]}
      ins(%loss : tensor<4xf32>) outs(%s0 : tensor<f32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.addf %a, %o : f32
    linalg.yield %r : f32
  } -> tensor<f32>
  %mean = linalg.generic {indexing_maps = [#e, #e, #e], iterator_types = []}
      ins(%sum, %count : tensor<f32>, tensor<f32>) outs(%e0 : tensor<f32>) {
  ^bb0(%a: f32, %b: f32, %o: f32):
    %r = arith.divf %a, %b : f32
    linalg.yield %r : f32
  } -> tensor<f32>
  %grad = linalg.generic {indexing_maps = [#id, #row, #row, #all, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x, %m, %l, %count : tensor<4x16xf32>, tensor<4xf32>, tensor<4xf32>, tensor<f32>)
      outs(%e2 : tensor<4x16xf32>) {
  ^bb0(%a: f32, %b: f32, %c: f32, %n: f32, %o: f32):
    %d = arith.subf %a, %b : f32
    %ex = math.exp %d : f32
    %p = arith.divf %ex, %c : f32
    %r = arith.divf %p, %n : f32
    linalg.yield %r : f32
  } -> tensor<4x16xf32>
  return %mean, %grad : tensor<f32>, tensor<4x16xf32>
}
"""


def loss_inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, generator=g)
    y = torch.tensor([3, -100, 15, 0])
    return x, y


def loss_reference(x, y):
    """(mean loss over the counted rows, softmax(x) / count) as LOSS computes them."""
    valid = y != -100
    logp = torch.log_softmax(x, dim=1)
    losses = -logp[torch.arange(4), torch.where(valid, y, 0)]
    count = valid.sum().float()
    return (losses * valid).sum() / count, torch.softmax(x, dim=1) / count
