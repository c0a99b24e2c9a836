"""fuse_reading_loops: the IR it produces (FileCheck) for a loop reading, step by step, what
an earlier loop wrote, and the pairs it leaves alone (each precondition broken once)."""

import pytest

from schedules.common import match
from transform_ext.fuse_reading_loops import fuse_reading_loops
from tests.transform_ext.helpers import apply, check, parse

# A writes row i of %e (exp of row i of %s); the row sum B reads row i of A's result; an op
# between the loops (the accumulator's start, %l0 * %c) is needed by B; another reader of
# A's result (the return) stays.
PAIR = """
func.func @main(%s: tensor<8x16xf32>, %l0: vector<16xf32>, %c: vector<16xf32>)
    -> (tensor<8x16xf32>, vector<16xf32>) {
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %c8 = arith.constant 8 : index
  %pad = ub.poison : f32
  %empty = tensor.empty() : tensor<8x16xf32>
  %e = scf.for %i = %c0 to %c8 step %c1 iter_args(%t = %empty) -> (tensor<8x16xf32>) {
    %row = vector.transfer_read %s[%i, %c0], %pad {in_bounds = [true]} : tensor<8x16xf32>, vector<16xf32>
    %x = math.exp %row : vector<16xf32>
    %w = vector.transfer_write %x, %t[%i, %c0] {in_bounds = [true]} : vector<16xf32>, tensor<8x16xf32>
    scf.yield %w : tensor<8x16xf32>
  }
  %start = arith.mulf %l0, %c : vector<16xf32>
  %l = scf.for %j = %c0 to %c8 step %c1 iter_args(%acc = %start) -> (vector<16xf32>) {
    %r = vector.transfer_read %e[%j, %c0], %pad {in_bounds = [true]} : tensor<8x16xf32>, vector<16xf32>
    %sum = arith.addf %acc, %r : vector<16xf32>
    scf.yield %sum : vector<16xf32>
  }
  return %e, %l : tensor<8x16xf32>, vector<16xf32>
}
"""


def _fused(text: str) -> str:
    payload = parse(text)
    apply(payload, lambda root: fuse_reading_loops(match(root, "func.func")))
    return str(payload)


def test_the_reading_loop_runs_inside_the_writing_one():
    check(_fused(PAIR), """
        CHECK: %[[START:.*]] = arith.mulf
        CHECK: %[[F:.*]]:2 = scf.for %[[I:.*]] = %{{.*}} to %{{.*}} step %{{.*}} iter_args(%[[T:.*]] = %{{.*}}, %[[ACC:.*]] = %[[START]]) -> (tensor<8x16xf32>, vector<16xf32>)
        CHECK:   %[[X:.*]] = math.exp
        CHECK:   %[[W:.*]] = vector.transfer_write %[[X]], %[[T]][%[[I]], %{{.*}}]
        CHECK-NOT: vector.transfer_read
        CHECK:   %[[SUM:.*]] = arith.addf %[[ACC]], %[[X]]
        CHECK:   scf.yield %[[W]], %[[SUM]]
        CHECK-NOT: scf.for
        CHECK: return %[[F]]#0, %[[F]]#1
    """)


@pytest.mark.parametrize("change, reason", [
    # B reads the next row, not the one written at its step
    (("%r = vector.transfer_read %e[%j, %c0]", "%j1 = arith.addi %j, %c1 : index\n    "
      "%r = vector.transfer_read %e[%j1, %c0]"), "another slice"),
    # B runs over fewer steps
    (("%l = scf.for %j = %c0 to %c8", "%l = scf.for %j = %c1 to %c8"), "other bounds"),
    # A's steps write overlapping slices (two rows per step of one)
    (("%w = vector.transfer_write %x, %t[%i, %c0] {in_bounds = [true]} : vector<16xf32>",
      "%x2 = vector.broadcast %x : vector<16xf32> to vector<2x16xf32>\n    "
      "%w = vector.transfer_write %x2, %t[%i, %c0] {in_bounds = [true, true]} : vector<2x16xf32>"),
     "overlapping slices"),
    # the op between the loops that B needs reads A's result
    (("%start = arith.mulf %l0, %c : vector<16xf32>",
      "%first = vector.transfer_read %e[%c0, %c0], %pad {in_bounds = [true]} : tensor<8x16xf32>, "
      "vector<16xf32>\n  %start = arith.mulf %first, %c : vector<16xf32>"), "a dependence on A"),
])
def test_pairs_that_break_a_precondition_are_left_alone(change, reason):
    old, new = change
    assert old in PAIR, reason
    text = PAIR.replace(old, new)
    if reason == "overlapping slices":
        text = text.replace("%c8 = arith.constant 8 : index",
                            "%c8 = arith.constant 7 : index")
    before = str(parse(text))
    assert _fused(text) == before, reason
