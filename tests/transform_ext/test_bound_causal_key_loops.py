"""bound_causal_key_loops: the key loop of a query block stops at the causal diagonal and
its tiles below the diagonal run first without the mask (FileCheck), the row sums stay
torch's, and the rejection of a target that is not a query block (nothing rewritten)."""

import pytest
import torch

from schedules.common import match
from transform_ext.bound_causal_key_loops import bound_causal_key_loops
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

# Row sums of exp(S + M) over keys j <= i + DELTA (M = 0 there, -inf elsewhere), in query
# blocks of 16 rows with a key loop over tiles of 16: the shape the attention schedule gives.
CAUSAL_ROW_SUMS = """
#id = affine_map<(i, j) -> (i, j)>
#row = affine_map<(i, j) -> (i)>
func.func @main(%s: tensor<64x64xf32>) -> tensor<64xf32> {
  %c0 = arith.constant 0 : index
  %c16 = arith.constant 16 : index
  %c64 = arith.constant 64 : index
  %delta = arith.constant DELTA : index
  %ninf = arith.constant 0xFF800000 : f32
  %zero = arith.constant 0.0 : f32
  %init = tensor.empty() : tensor<64xf32>
  %r = scf.forall (%qb) in (4) shared_outs(%o = %init) -> (tensor<64xf32>) {
    %i0 = arith.muli %qb, %c16 : index
    %z = tensor.empty() : tensor<16xf32>
    %acc0 = linalg.fill ins(%zero : f32) outs(%z : tensor<16xf32>) -> tensor<16xf32>
    %sum = scf.for %j0 = %c0 to %c64 step %c16 iter_args(%acc = %acc0) -> (tensor<16xf32>) {
      %tile = tensor.extract_slice %s[%i0, %j0] [16, 16] [1, 1] : tensor<64x64xf32> to tensor<16x16xf32>
      %me = tensor.empty() : tensor<16x16xf32>
      %mask = linalg.generic {indexing_maps = [#id], iterator_types = ["parallel", "parallel"]}
          outs(%me : tensor<16x16xf32>) {
      ^bb0(%out: f32):
        %i = linalg.index 0 : index
        %j = linalg.index 1 : index
        %ii = arith.addi %i, %i0 : index
        %bound = arith.addi %ii, %delta : index
        %jj = arith.addi %j, %j0 : index
        %allowed = arith.cmpi sle, %jj, %bound : index
        %m = arith.select %allowed, %zero, %ninf : f32
        linalg.yield %m : f32
      } -> tensor<16x16xf32>
      %e = linalg.generic {indexing_maps = [#id, #id, #id], iterator_types = ["parallel", "parallel"]}
          ins(%tile, %mask : tensor<16x16xf32>, tensor<16x16xf32>) outs(%me : tensor<16x16xf32>) {
      ^bb0(%x: f32, %mk: f32, %out: f32):
        %0 = arith.addf %x, %mk : f32
        %1 = math.exp %0 : f32
        linalg.yield %1 : f32
      } -> tensor<16x16xf32>
      %red = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
          ins(%e : tensor<16x16xf32>) outs(%acc : tensor<16xf32>) {
      ^bb0(%x: f32, %a: f32):
        %0 = arith.addf %x, %a : f32
        linalg.yield %0 : f32
      } -> tensor<16xf32>
      scf.yield %red : tensor<16xf32>
    }
    scf.forall.in_parallel {
      tensor.parallel_insert_slice %sum into %o[%i0] [16] [1] : tensor<16xf32> into tensor<64xf32>
    }
  }
  return %r : tensor<64xf32>
}
"""


def _payload(delta: int):
    return parse(CAUSAL_ROW_SUMS.replace("DELTA", str(delta)))


def _bound(delta: int, split: bool = True):
    return lambda root: bound_causal_key_loops(match(root, "scf.forall"), delta=delta,
                                               query_tile=16, query_iv=0, split=split)


def test_the_key_loop_stops_at_the_diagonal_and_starts_unmasked():
    payload = _payload(0)
    apply(payload, _bound(0))
    check(payload, """
        CHECK: scf.forall (%[[QB:.*]]) in (4)
        CHECK: linalg.fill
        CHECK: %[[I0:.*]] = arith.muli %[[QB]], %c16{{.*}} : index
        CHECK: %[[END:.*]] = arith.addi %[[I0]], %c16{{.*}} : index
        CHECK: %[[UPPER:.*]] = arith.maxsi %[[END]], %c0{{.*}} : index
        CHECK: %[[UB:.*]] = arith.minsi %[[UPPER]], %c64 : index
        CHECK: %[[FROM:.*]] = arith.addi %[[I0]], %c-14{{.*}} : index
        CHECK: %[[POS:.*]] = arith.maxsi %[[FROM]], %c0{{.*}} : index
        CHECK: %[[TILES:.*]] = arith.ceildivsi %[[POS]], %c16 : index
        CHECK: %[[START:.*]] = arith.muli %[[TILES]], %c16 : index
        CHECK: %[[SPLIT:.*]] = arith.minsi %[[START]], %[[UB]] : index
        CHECK: %[[FIRST:.*]] = scf.for %{{.*}} = %c0 to %[[SPLIT]] step %c16 iter_args(%{{.*}} = %{{.*}})
        CHECK: linalg.generic {{.*}} ins(%{{.*}} : tensor<16x16xf32>) outs
        CHECK-NEXT: ^bb0
        CHECK-NEXT: math.exp
        CHECK: scf.yield
        CHECK: scf.for %{{.*}} = %[[SPLIT]] to %[[UB]] step %c16 iter_args(%{{.*}} = %[[FIRST]])
        CHECK: arith.cmpi sle
        CHECK: ins(%{{.*}}, %{{.*}} : tensor<16x16xf32>, tensor<16x16xf32>)
        CHECK: arith.addf
        CHECK-NEXT: math.exp
    """)


@pytest.mark.parametrize("delta", [0, 5, -3])
def test_bounded_row_sums_are_torchs(delta):
    s = torch.randn(64, 64, generator=torch.Generator().manual_seed(delta + 3))
    allowed = torch.arange(64)[None, :] <= torch.arange(64)[:, None] + delta
    want = torch.where(allowed, s.exp(), torch.zeros(())).sum(-1)
    payload = _payload(delta)
    apply(payload, _bound(delta))
    got = run_module(payload, [s])[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_rejects_a_target_that_is_not_a_query_block():
    payload = _payload(0)
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: bound_causal_key_loops(match(root, "func.func"), delta=0,
                                                     query_tile=16, query_iv=0, split=True))
    assert "transform_ext.bound_causal_key_loops: func.func" in message
    assert "not an scf.forall (a query block)" in message
    assert str(payload) == before


def test_a_query_tile_that_is_not_the_blocks_step_is_refused():
    """Blocks of 16 rows bounded as blocks of 32 would cut off allowed keys."""
    payload = _payload(0)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: bound_causal_key_loops(
        match(root, "scf.forall"), delta=0, query_tile=32, query_iv=0, split=True))
    assert "induction variable 0 does not index blocks of 32 query rows (its result offsets " \
           "step by 16)" in message
    assert str(payload) == before
