"""sliding_window_extrema: a stride-1 max (min) pooling becomes doubled windows on vector
chunks of each row (FileCheck on the rewritten IR; numerics against torch are in
tests/schedules/test_generic_pooling.py); other poolings stay."""

from schedules.common import match
from transform_ext.sliding_window_extrema import sliding_window_extrema
from tests.transform_ext.helpers import apply, check, parse

# 2 rows of 40 f16 inputs padded by 2 on both sides with -inf, a window of 4 taps at
# dilation 2: 38 outputs, in chunks of 8 lanes: 0 (at the left edge), 8 .. 24 (a loop
# inside the source), 32 (6 lanes, at the right edge); each chunk reads 8 + 6 inputs.
PADDED = """
func.func @main(%x: tensor<1x2x40xf16>, %win: tensor<4xf32>) -> tensor<1x2x38xf32> {
  %ninf = arith.constant 0xFC00 : f16
  %init = arith.constant 0xFF800000 : f32
  %padded = tensor.pad %x low[0, 0, 2] high[0, 0, 2] {
  ^bb0(%i: index, %j: index, %k: index):
    tensor.yield %ninf : f16
  } : tensor<1x2x40xf16> to tensor<1x2x44xf16>
  %e = tensor.empty() : tensor<1x2x38xf32>
  %f = linalg.fill ins(%init : f32) outs(%e : tensor<1x2x38xf32>) -> tensor<1x2x38xf32>
  %p = linalg.pooling_ncw_max {dilations = dense<2> : tensor<1xi64>, strides = dense<1> : tensor<1xi64>}
         ins(%padded, %win : tensor<1x2x44xf16>, tensor<4xf32>) outs(%f : tensor<1x2x38xf32>) -> tensor<1x2x38xf32>
  return %p : tensor<1x2x38xf32>
}
"""


def test_a_padded_pooling_reads_the_source_in_doubled_windows():
    payload = parse(PADDED)
    apply(payload, lambda root: sliding_window_extrema(match(root, "func.func"), 8))
    check(str(payload), """
        CHECK-LABEL: func.func @main
        CHECK: %[[NINF:.*]] = arith.constant 0xFC00 : f16
        CHECK: %[[E:.*]] = tensor.empty() : tensor<1x2x38xf32>
        CHECK: %[[PAD:.*]] = arith.extf %[[NINF]] : f16 to f32
        CHECK: scf.for %[[C:.*]] = %{{.*}} to %{{.*}} step %{{.*}} iter_args(%[[Y:.*]] = %[[E]])
        CHECK: %[[SPLAT:.*]] = vector.broadcast %[[PAD]] : f32 to vector<14xf32>
        CHECK: %[[H:.*]] = vector.transfer_read %arg0[%{{.*}}, %[[C]], %{{.*}}]{{.*}} : tensor<1x2x40xf16>, vector<1x1x12xf16>
        CHECK: %[[HW:.*]] = arith.extf %{{.*}} : vector<12xf16> to vector<12xf32>
        CHECK: %[[SPAN:.*]] = vector.insert_strided_slice %[[HW]], %[[SPLAT]] {offsets = [2], strides = [1]} : vector<12xf32> into vector<14xf32>
        CHECK: %[[A:.*]] = vector.extract_strided_slice %[[SPAN]] {offsets = [0], sizes = [12], strides = [1]}
        CHECK: %[[B:.*]] = vector.extract_strided_slice %[[SPAN]] {offsets = [2], sizes = [12], strides = [1]}
        CHECK: %[[M2:.*]] = arith.maximumf %[[A]], %[[B]] : vector<12xf32>
        CHECK: %[[A4:.*]] = vector.extract_strided_slice %[[M2]] {offsets = [0], sizes = [8], strides = [1]}
        CHECK: %[[B4:.*]] = vector.extract_strided_slice %[[M2]] {offsets = [4], sizes = [8], strides = [1]}
        CHECK: %[[M4:.*]] = arith.maximumf %[[A4]], %[[B4]] : vector<8xf32>
        CHECK: %[[ROW:.*]] = vector.shape_cast %[[M4]] : vector<8xf32> to vector<1x1x8xf32>
        CHECK: %[[Y0:.*]] = vector.transfer_write %[[ROW]], %[[Y]][%{{.*}}, %[[C]], %{{.*}}]
        CHECK: scf.for %[[W:.*]] = %{{.*}} to %{{.*}} step %{{.*}} iter_args(%[[Y1:.*]] = %[[Y0]])
        CHECK: %[[AT:.*]] = arith.addi %[[W]], %{{.*}} : index
        CHECK: vector.transfer_read %arg0[%{{.*}}, %[[C]], %[[AT]]]{{.*}} vector<1x1x14xf16>
        CHECK: arith.maximumf {{.*}} : vector<12xf32>
        CHECK: arith.maximumf {{.*}} : vector<8xf32>
        CHECK: vector.transfer_write %{{.*}}, %[[Y1]][%{{.*}}, %[[C]], %[[W]]]
        CHECK: vector.transfer_read %arg0{{.*}} : tensor<1x2x40xf16>, vector<1x1x10xf16>
        CHECK: vector.insert_strided_slice %{{.*}}, %{{.*}} {offsets = [0], strides = [1]} : vector<10xf32> into vector<12xf32>
        CHECK: arith.maximumf {{.*}} : vector<10xf32>
        CHECK: arith.maximumf {{.*}} : vector<6xf32>
        CHECK: vector.transfer_write {{.*}} : vector<1x1x6xf32>, tensor<1x2x38xf32>
        CHECK-NOT: linalg.pooling_ncw_max
    """)


# An i32 window of 3 taps (two halves: taps 0-1 and 1-2) into an accumulator that is read.
INTEGER = """
#in = affine_map<(d0, d1, d2) -> (d0, d1 + d2 * 5)>
#win = affine_map<(d0, d1, d2) -> (d2)>
#out = affine_map<(d0, d1, d2) -> (d0, d1)>
func.func @main(%x: tensor<3x30xi32>, %w: tensor<3xi32>, %acc: tensor<3x20xi32>) -> tensor<3x20xi32> {
  %g = linalg.generic {indexing_maps = [#in, #win, #out], iterator_types = ["parallel", "parallel", "reduction"]}
         ins(%x, %w : tensor<3x30xi32>, tensor<3xi32>) outs(%acc : tensor<3x20xi32>) {
  ^bb0(%in: i32, %unread: i32, %out: i32):
    %m = arith.maxsi %in, %out : i32
    linalg.yield %m : i32
  } -> tensor<3x20xi32>
  return %g : tensor<3x20xi32>
}
"""


def test_an_odd_window_combines_two_overlapping_halves_and_the_accumulator():
    payload = parse(INTEGER)
    apply(payload, lambda root: sliding_window_extrema(match(root, "func.func"), 32))
    check(str(payload), """
        CHECK-LABEL: func.func @main
        CHECK: scf.for %[[R:.*]] = %{{.*}} to %{{.*}} step %{{.*}} iter_args(%[[Y:.*]] = %arg2)
        CHECK: %[[X:.*]] = vector.transfer_read %arg0[%[[R]], %{{.*}}]{{.*}} : tensor<3x30xi32>, vector<1x30xi32>
        CHECK: %[[S:.*]] = vector.shape_cast %[[X]] : vector<1x30xi32> to vector<30xi32>
        CHECK: %[[A:.*]] = vector.extract_strided_slice %[[S]] {offsets = [0], sizes = [25], strides = [1]}
        CHECK: %[[B:.*]] = vector.extract_strided_slice %[[S]] {offsets = [5], sizes = [25], strides = [1]}
        CHECK: %[[M2:.*]] = arith.maxsi %[[A]], %[[B]] : vector<25xi32>
        CHECK: %[[LO:.*]] = vector.extract_strided_slice %[[M2]] {offsets = [0], sizes = [20], strides = [1]}
        CHECK: %[[HI:.*]] = vector.extract_strided_slice %[[M2]] {offsets = [5], sizes = [20], strides = [1]}
        CHECK: %[[M3:.*]] = arith.maxsi %[[LO]], %[[HI]] : vector<20xi32>
        CHECK: vector.transfer_read %[[Y]][%[[R]], %{{.*}}]{{.*}} : tensor<3x20xi32>, vector<1x20xi32>
        CHECK: %[[ACC:.*]] = vector.shape_cast %{{.*}} : vector<1x20xi32> to vector<20xi32>
        CHECK: arith.maxsi %[[M3]], %[[ACC]] : vector<20xi32>
        CHECK: vector.transfer_write %{{.*}}, %[[Y]][%[[R]], %{{.*}}]
    """)


STAYS = """
func.func @main(%x: tensor<1x2x40xf32>, %win: tensor<4xf32>, %acc: tensor<1x2x19xf32>,
                %acc1: tensor<1x2x37xf32>, %x2: tensor<1x2x9x40xf32>, %win2: tensor<3x4xf32>,
                %acc2: tensor<1x2x7x37xf32>)
    -> (tensor<1x2x19xf32>, tensor<1x2x37xf32>, tensor<1x2x7x37xf32>) {
  %strided = linalg.pooling_ncw_max {dilations = dense<1> : tensor<1xi64>, strides = dense<2> : tensor<1xi64>}
         ins(%x, %win : tensor<1x2x40xf32>, tensor<4xf32>) outs(%acc : tensor<1x2x19xf32>) -> tensor<1x2x19xf32>
  %sum = linalg.pooling_ncw_sum {dilations = dense<1> : tensor<1xi64>, strides = dense<1> : tensor<1xi64>}
         ins(%x, %win : tensor<1x2x40xf32>, tensor<4xf32>) outs(%acc1 : tensor<1x2x37xf32>) -> tensor<1x2x37xf32>
  %two = linalg.pooling_nchw_max {dilations = dense<1> : tensor<2xi64>, strides = dense<1> : tensor<2xi64>}
         ins(%x2, %win2 : tensor<1x2x9x40xf32>, tensor<3x4xf32>) outs(%acc2 : tensor<1x2x7x37xf32>) -> tensor<1x2x7x37xf32>
  return %strided, %sum, %two : tensor<1x2x19xf32>, tensor<1x2x37xf32>, tensor<1x2x7x37xf32>
}
"""


def test_strided_summing_and_two_window_dim_poolings_stay():
    payload = parse(STAYS)
    apply(payload, lambda root: sliding_window_extrema(match(root, "func.func"), 8))
    check(str(payload), """
        CHECK-LABEL: func.func @main
        CHECK: linalg.pooling_ncw_max
        CHECK: linalg.pooling_ncw_sum
        CHECK: linalg.pooling_nchw_max
        CHECK-NOT: vector.
    """)
