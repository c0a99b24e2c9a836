"""clamp_window_loops: the tap loops around a one-tap convolution tile over a zero-padded
image run over the taps that read the image only; an image without padding along a dim, or
a tile the op cannot place, keeps its loops."""

import torch
from torch_mlir import ir
from torch_mlir.dialects.transform import structured

from schedules.common import match
from transform_ext.clamp_window_loops import clamp_window_loops
from tests.transform_ext.helpers import apply, check, parse
from tests.transform_ext.numeric import run_module

# y = conv(pad(x, rows 2 + 2, columns 1 + 1), w): x [1, 2, 3, 6], w [3, 2, 3, 3]
PADDED = """
func.func @main(%x: tensor<1x2x3x6xf32>, %w: tensor<3x2x3x3xf32>) -> tensor<1x3x5x6xf32> {
  %zero = arith.constant 0.0 : f32
  %p = tensor.pad %x low[0, 0, 2, 1] high[0, 0, 2, 1] {
  ^bb0(%i: index, %j: index, %k: index, %l: index):
    tensor.yield %zero : f32
  } : tensor<1x2x3x6xf32> to tensor<1x2x7x8xf32>
  %e = tensor.empty() : tensor<1x3x5x6xf32>
  %y0 = linalg.fill ins(%zero : f32) outs(%e : tensor<1x3x5x6xf32>) -> tensor<1x3x5x6xf32>
  %y = linalg.conv_2d_nchw_fchw {dilations = dense<1> : vector<2xi64>, strides = dense<1> : vector<2xi64>}
      ins(%p, %w : tensor<1x2x7x8xf32>, tensor<3x2x3x3xf32>) outs(%y0 : tensor<1x3x5x6xf32>) -> tensor<1x3x5x6xf32>
  return %y : tensor<1x3x5x6xf32>
}
"""


def _tile_and_clamp(root):
    conv = structured.GeneralizeOp(match(root, "linalg.conv_2d_nchw_fchw")).transformed
    # one output row (all its columns) per step, then the channels and taps one by one
    rows = structured.TileUsingForOp(conv, sizes=[1, 1, 1, 0, 0, 0, 0]).tiled_linalg_op
    taps = structured.TileUsingForOp(rows, sizes=[0, 0, 0, 0, 1, 1, 1]).tiled_linalg_op
    clamp_window_loops(taps)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, 3, 6, generator=g), torch.randn(3, 2, 3, 3, generator=g)]


def test_the_row_taps_stop_at_the_image_and_the_columns_keep_their_loop():
    payload = parse(PADDED)
    apply(payload, _tile_and_clamp)
    payload.operation.verify()
    # rows: x lies at [2, 5) of the padded image, the output row r reads r + kh: kh in
    # [max(0, 2 - r), min(3, 5 - r)); columns are padded too but are the tile's lanes (6
    # of them, not one), so their loop stays
    check(payload, """
        CHECK:      scf.for %[[R:[a-z0-9_]+]] = %c0{{.*}} to %c5 step
        CHECK:      scf.for %{{.*}} = %c0{{.*}} to %c2 step
        CHECK:      %[[B:.*]] = arith.addi %c0{{.*}}, %[[R]] : index
        CHECK:      %[[LO:.*]] = arith.subi %c2{{.*}}, %[[B]] : index
        CHECK:      %[[FIRST:.*]] = arith.maxsi %c0{{.*}}, %[[LO]] : index
        CHECK:      %[[HI:.*]] = arith.subi %c5{{.*}}, %[[B]] : index
        CHECK:      %[[LAST:.*]] = arith.minsi %c3{{.*}}, %[[HI]] : index
        CHECK:      scf.for %{{.*}} = %[[FIRST]] to %[[LAST]] step
        CHECK-NEXT: scf.for %{{.*}} = %c0{{.*}} to %c3{{.*}} step
    """)
    x, w = _inputs()
    (after,) = run_module(payload, [x, w])
    ref = torch.nn.functional.conv2d(torch.nn.functional.pad(x, (1, 1, 2, 2)), w)
    torch.testing.assert_close(after, ref)


def test_an_unpadded_image_keeps_its_loops():
    text = PADDED.replace("low[0, 0, 2, 1] high[0, 0, 2, 1]", "low[0, 0, 0, 0] high[0, 0, 4, 2]")
    payload = parse(text)
    apply(payload, _tile_and_clamp)
    assert "arith.maxsi" in str(payload)  # the rows' high padding: [0, 3) of 7 rows
    payload = parse(PADDED.replace("low[0, 0, 2, 1] high[0, 0, 2, 1]", "low[0, 0, 0, 1] high[0, 0, 0, 1]")
                    .replace("tensor<1x2x7x8xf32>", "tensor<1x2x3x8xf32>")
                    .replace("1x3x5x6", "1x3x1x6"))
    apply(payload, _tile_and_clamp)
    assert "arith.maxsi" not in str(payload)
