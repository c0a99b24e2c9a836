"""scattered_stores_in_lane_form: a scattered store of a [rows] vector writes its lane form,
lane 0 of each row (the value and offsets broadcast over 16 lanes and transposed, the mask
and-ed with lane == 0; FileCheck); a [rows, lanes] store is left alone; a store of one
chunk of 16 elements at one offset is refused, nothing rewritten."""

from schedules.common import match
from transform_ext.scattered_stores_in_lane_form import scattered_stores_in_lane_form
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

STORES = """
func.func @f(%v: vector<8xbf16>, %base: i64, %off: vector<8xindex>, %mask: vector<8xi1>,
             %w: vector<8x16xf32>, %off2: vector<8x16xindex>, %mask2: vector<8x16xi1>) {
  xegpu.store %v, %base[%off], %mask : vector<8xbf16>, i64, vector<8xindex>, vector<8xi1>
  xegpu.store %w, %base[%off2], %mask2 : vector<8x16xf32>, i64, vector<8x16xindex>, vector<8x16xi1>
  return
}
"""

CHUNKED = """
func.func @f(%v: vector<16xf32>, %base: i64, %off: vector<1xindex>, %mask: vector<1xi1>) {
  xegpu.store %v, %base[%off], %mask <{chunk_size = 16 : i64}> : vector<16xf32>, i64, vector<1xindex>, vector<1xi1>
  return
}
"""


def test_a_row_vector_store_writes_lane_zero_of_its_lane_form():
    payload = parse(STORES)
    apply(payload, lambda root: scattered_stores_in_lane_form(match(root, "func.func"), 16))
    check(str(payload), """
        CHECK: func.func @f(%[[V:.*]]: vector<8xbf16>, %[[BASE:.*]]: i64, %[[OFF:.*]]: vector<8xindex>, %[[MASK:.*]]: vector<8xi1>, %[[W:.*]]: vector<8x16xf32>, %[[OFF2:.*]]: vector<8x16xindex>, %[[MASK2:.*]]: vector<8x16xi1>)
        CHECK: %[[STEP:.*]] = vector.step : vector<16xindex>
        CHECK: %[[LANE:.*]] = vector.broadcast %[[STEP]] : vector<16xindex> to vector<8x16xindex>
        CHECK: %[[ZERO:.*]] = arith.constant dense<0> : vector<8x16xindex>
        CHECK: %[[FIRST:.*]] = arith.cmpi eq, %[[LANE]], %[[ZERO]] : vector<8x16xindex>
        CHECK: %[[MB:.*]] = vector.broadcast %[[MASK]] : vector<8xi1> to vector<16x8xi1>
        CHECK: %[[MT:.*]] = vector.transpose %[[MB]], [1, 0] : vector<16x8xi1> to vector<8x16xi1>
        CHECK: %[[M:.*]] = arith.andi %[[MT]], %[[FIRST]] : vector<8x16xi1>
        CHECK: %[[VB:.*]] = vector.broadcast %[[V]] : vector<8xbf16> to vector<16x8xbf16>
        CHECK: %[[VT:.*]] = vector.transpose %[[VB]], [1, 0] : vector<16x8xbf16> to vector<8x16xbf16>
        CHECK: %[[OB:.*]] = vector.broadcast %[[OFF]] : vector<8xindex> to vector<16x8xindex>
        CHECK: %[[OT:.*]] = vector.transpose %[[OB]], [1, 0] : vector<16x8xindex> to vector<8x16xindex>
        CHECK: xegpu.store %[[VT]], %[[BASE]][%[[OT]]], %[[M]] : vector<8x16xbf16>, i64, vector<8x16xindex>, vector<8x16xi1>
        CHECK: xegpu.store %[[W]], %[[BASE]][%[[OFF2]]], %[[MASK2]] : vector<8x16xf32>
        CHECK-NOT: xegpu.store
    """)


def test_a_chunked_store_is_refused():
    payload = parse(CHUNKED)
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: scattered_stores_in_lane_form(match(root, "func.func"), 16))
    assert "transform_ext.scattered_stores_in_lane_form: xegpu.store" in message
    assert "its offsets are not a [16] vector" in message
    assert str(payload) == before
