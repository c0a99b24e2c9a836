"""fold_reshape_ops_by_expansion: IR (FileCheck), numerics before/after on the CPU, rejection,
and the SDPA import of examples/attention.py."""

import importlib.util

import torch

import transform_ext
from lighthouse.ingress import import_forward
from schedules.common import canonicalize, match, run_passes
from transform_ext.drop_unused_results import drop_unused_results
from transform_ext.fold_reshape_ops_by_expansion import fold_reshape_ops_by_expansion
from transform_ext.fold_scalar_or_splat_constant import fold_scalar_or_splat_constant
from tests.conftest import EXAMPLES
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

# A collapsed producer feeding an elementwise generic that reads linalg.index of the
# collapsed dim; the result is expanded back by its consumer.
ELEMENTWISE = """
#id = affine_map<(d0, d1) -> (d0, d1)>
func.func @main(%x: tensor<2x3x4xf32>, %y: tensor<6x4xf32>) -> tensor<6x4xf32> {
  %c = tensor.collapse_shape %x [[0, 1], [2]] : tensor<2x3x4xf32> into tensor<6x4xf32>
  %e = tensor.empty() : tensor<6x4xf32>
  %r = linalg.generic {indexing_maps = [#id, #id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%c, %y : tensor<6x4xf32>, tensor<6x4xf32>) outs(%e : tensor<6x4xf32>) {
  ^bb0(%a: f32, %b: f32, %out: f32):
    %i = linalg.index 0 : index
    %ii = arith.index_cast %i : index to i32
    %f = arith.sitofp %ii : i32 to f32
    %0 = arith.addf %a, %b : f32
    %1 = arith.mulf %0, %f : f32
    linalg.yield %1 : f32
  } -> tensor<6x4xf32>
  return %r : tensor<6x4xf32>
}
"""


def _fold(payload, names="func.func"):
    apply(payload, lambda root: canonicalize(fold_reshape_ops_by_expansion(match(root, names))))


def test_collapse_producer_expands_the_consumer():
    payload = parse(ELEMENTWISE)
    _fold(payload)
    check(payload, """
        CHECK-DAG: #[[ID3:.*]] = affine_map<(d0, d1, d2) -> (d0, d1, d2)>
        CHECK-LABEL: func.func @main
        CHECK-SAME: (%[[X:.*]]: tensor<2x3x4xf32>, %[[Y:.*]]: tensor<6x4xf32>)
        CHECK-DAG: %[[C3:.*]] = arith.constant 3 : index
        CHECK-DAG: %[[YE:.*]] = tensor.expand_shape %[[Y]] {{\\[}}[0, 1], [2]] output_shape [2, 3, 4]
        CHECK: %[[R:.*]] = linalg.generic {indexing_maps = [#[[ID3]], #[[ID3]], #[[ID3]]], iterator_types = ["parallel", "parallel", "parallel"]}
        CHECK-SAME: ins(%[[X]], %[[YE]] : tensor<2x3x4xf32>, tensor<2x3x4xf32>)
        CHECK: %[[I0:.*]] = linalg.index 0
        CHECK: %[[I1:.*]] = linalg.index 1
        CHECK: %[[M:.*]] = arith.muli %[[I0]], %[[C3]]
        CHECK: arith.addi %[[M]], %[[I1]]
        CHECK: } -> tensor<2x3x4xf32>
        CHECK: %[[OUT:.*]] = tensor.collapse_shape %[[R]] {{\\[}}[0, 1], [2]] : tensor<2x3x4xf32> into tensor<6x4xf32>
        CHECK: return %[[OUT]]
    """)


def test_elementwise_same_result_before_and_after():
    torch.manual_seed(0)
    x, y = torch.randn(2, 3, 4), torch.randn(6, 4)
    before = run_module(parse(ELEMENTWISE), [x, y])
    payload = parse(ELEMENTWISE)
    _fold(payload)
    after = run_module(payload, [x, y])
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    rows = torch.arange(6, dtype=torch.float32)[:, None]
    torch.testing.assert_close(after[0], (x.reshape(6, 4) + y) * rows)


# SDPA's form: a 3-D batch matmul between 4-D -> 3-D collapses and a 3-D -> 4-D expand,
# followed by a max reduction whose result is expanded with a unit dim (that expand stays:
# folding it would put an expand on the scores, which the function also returns).
BATCH_MATMUL = """
#id = affine_map<(d0, d1, d2, d3) -> (d0, d1, d2, d3)>
#row = affine_map<(d0, d1, d2, d3) -> (d0, d1, d2)>
func.func @main(%q: tensor<2x3x8x4xf32>, %kt: tensor<2x3x4x5xf32>) -> (tensor<2x3x8x5xf32>, tensor<2x3x8x1xf32>) {
  %zero = arith.constant 0.0 : f32
  %ninf = arith.constant 0xFF800000 : f32
  %qc = tensor.collapse_shape %q [[0, 1], [2], [3]] : tensor<2x3x8x4xf32> into tensor<6x8x4xf32>
  %kc = tensor.collapse_shape %kt [[0, 1], [2], [3]] : tensor<2x3x4x5xf32> into tensor<6x4x5xf32>
  %e = tensor.empty() : tensor<6x8x5xf32>
  %f = linalg.fill ins(%zero : f32) outs(%e : tensor<6x8x5xf32>) -> tensor<6x8x5xf32>
  %s = linalg.batch_matmul ins(%qc, %kc : tensor<6x8x4xf32>, tensor<6x4x5xf32>) outs(%f : tensor<6x8x5xf32>) -> tensor<6x8x5xf32>
  %s4 = tensor.expand_shape %s [[0, 1], [2], [3]] output_shape [2, 3, 8, 5] : tensor<6x8x5xf32> into tensor<2x3x8x5xf32>
  %me = tensor.empty() : tensor<2x3x8xf32>
  %mi = linalg.fill ins(%ninf : f32) outs(%me : tensor<2x3x8xf32>) -> tensor<2x3x8xf32>
  %m = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "parallel", "parallel", "reduction"]}
      ins(%s4 : tensor<2x3x8x5xf32>) outs(%mi : tensor<2x3x8xf32>) {
  ^bb0(%in: f32, %acc: f32):
    %0 = arith.maximumf %in, %acc : f32
    linalg.yield %0 : f32
  } -> tensor<2x3x8xf32>
  %m4 = tensor.expand_shape %m [[0], [1], [2, 3]] output_shape [2, 3, 8, 1] : tensor<2x3x8xf32> into tensor<2x3x8x1xf32>
  return %s4, %m4 : tensor<2x3x8x5xf32>, tensor<2x3x8x1xf32>
}
"""


def test_batch_matmul_becomes_a_4d_contraction_without_reshapes():
    payload = parse(BATCH_MATMUL)
    _fold(payload)
    check(payload, """
        CHECK-DAG: #[[A:.*]] = affine_map<(d0, d1, d2, d3, d4) -> (d0, d1, d2, d4)>
        CHECK-DAG: #[[B:.*]] = affine_map<(d0, d1, d2, d3, d4) -> (d0, d1, d4, d3)>
        CHECK-DAG: #[[C:.*]] = affine_map<(d0, d1, d2, d3, d4) -> (d0, d1, d2, d3)>
        CHECK-LABEL: func.func @main
        CHECK-SAME: (%[[Q:.*]]: tensor<2x3x8x4xf32>, %[[K:.*]]: tensor<2x3x4x5xf32>)
        CHECK-NOT: tensor.collapse_shape
        CHECK: %[[F:.*]] = linalg.fill {{.*}} -> tensor<2x3x8x5xf32>
        CHECK: %[[S:.*]] = linalg.generic {indexing_maps = [#[[A]], #[[B]], #[[C]]], iterator_types = ["parallel", "parallel", "parallel", "parallel", "reduction"]}
        CHECK-SAME: ins(%[[Q]], %[[K]] : tensor<2x3x8x4xf32>, tensor<2x3x4x5xf32>) outs(%[[F]] : tensor<2x3x8x5xf32>)
        CHECK: arith.mulf
        CHECK: arith.addf
        CHECK: %[[M:.*]] = linalg.generic
        CHECK-SAME: iterator_types = ["parallel", "parallel", "parallel", "reduction"]
        CHECK-SAME: ins(%[[S]] : tensor<2x3x8x5xf32>)
        CHECK: %[[M4:.*]] = tensor.expand_shape %[[M]] {{\\[}}[0], [1], [2, 3]]
        CHECK: return %[[S]], %[[M4]]
        CHECK-NOT: tensor.collapse_shape
        CHECK-NOT: linalg.batch_matmul
    """)


def test_batch_matmul_same_result_before_after_and_torch():
    torch.manual_seed(0)
    q, kt = torch.randn(2, 3, 8, 4), torch.randn(2, 3, 4, 5)
    before = run_module(parse(BATCH_MATMUL), [q, kt])
    payload = parse(BATCH_MATMUL)
    _fold(payload)
    after = run_module(payload, [q, kt])
    for a, b in zip(after, before):
        torch.testing.assert_close(a, b)
    s = q @ kt
    torch.testing.assert_close(after[0], s)
    torch.testing.assert_close(after[1], s.amax(dim=-1, keepdim=True))


def test_rejects_a_reshape_target_with_no_linalg_user():
    payload = parse("""
        func.func @main(%x: tensor<2x3xf32>) -> tensor<6xf32> {
          %c = tensor.collapse_shape %x [[0, 1]] : tensor<2x3xf32> into tensor<6xf32>
          return %c : tensor<6xf32>
        }
    """)
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: fold_reshape_ops_by_expansion(match(root, "tensor.collapse_shape")))
    assert "transform_ext.fold_reshape_ops_by_expansion: tensor.collapse_shape" in message
    assert "cannot fold: its user func.return is not a linalg op it can fold into" in message
    assert str(payload) == before


def test_rejects_a_consumer_with_a_composite_map():
    payload = parse("""
        #shift = affine_map<(d0) -> (d0 floordiv 2)>
        #id = affine_map<(d0) -> (d0)>
        func.func @main(%x: tensor<2x3xf32>) -> tensor<12xf32> {
          %c = tensor.collapse_shape %x [[0, 1]] : tensor<2x3xf32> into tensor<6xf32>
          %e = tensor.empty() : tensor<12xf32>
          %r = linalg.generic {indexing_maps = [#shift, #id], iterator_types = ["parallel"]}
              ins(%c : tensor<6xf32>) outs(%e : tensor<12xf32>) {
          ^bb0(%a: f32, %out: f32):
            linalg.yield %a : f32
          } -> tensor<12xf32>
          return %r : tensor<12xf32>
        }
    """)
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: fold_reshape_ops_by_expansion(match(root, "tensor.collapse_shape")))
    assert "tensor.collapse_shape" in message
    assert "cannot fold: linalg.generic has a composite indexing map" in message
    assert str(payload) == before
    apply(payload, lambda root: fold_reshape_ops_by_expansion(match(root, "func.func")))
    assert str(payload) == before


def _import_attention(batch: int):
    spec = importlib.util.spec_from_file_location("attention_example", EXAMPLES / "attention.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(0)
    inputs = [torch.randn(batch, 2, 8, 4) for _ in range(3)]
    imported = import_forward(example.Model(), inputs, name="attention.py")
    transform_ext.load(imported.module.context)
    return imported


def _normalize(payload):
    def body(root):
        func = match(root, "func.func")
        func = fold_scalar_or_splat_constant(func)
        func = drop_unused_results(func)
        func = fold_reshape_ops_by_expansion(func)
        canonicalize(func)

    apply(payload, body)


def test_sdpa_import_ops_1_2_5_leave_3d_batch_matmuls_no_argmax_and_a_folded_scale():
    imported = _import_attention(batch=1)
    payload = imported.module
    _normalize(payload)
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK-NOT: tensor.collapse_shape
        CHECK-NOT: tensor.expand_shape
        CHECK: %[[SCALE:.*]] = arith.constant 0.707106769 : f32
        CHECK-NOT: f64 to f32
        CHECK: arith.mulf %{{.*}}, %[[SCALE]] : f32
        CHECK: arith.mulf %{{.*}}, %[[SCALE]] : f32
        CHECK: linalg.generic
        CHECK-SAME: iterator_types = ["parallel", "parallel", "parallel", "parallel", "reduction"]
        CHECK-SAME: tensor<1x2x8x4xf32>, tensor<1x2x4x8xf32>
        CHECK: arith.maximumf
        CHECK-NEXT: linalg.yield %{{.*}} : f32
        CHECK-NOT: i64
        CHECK: arith.select %{{.*}}, %cst{{.*}}, %{{.*}} : f32
        CHECK: linalg.generic
        CHECK-SAME: iterator_types = ["parallel", "parallel", "parallel", "parallel", "reduction"]
        CHECK-SAME: ins(%{{.*}}, %arg2 : tensor<1x2x8x8xf32>, tensor<1x2x8x4xf32>)
        CHECK-NOT: tensor.expand_shape
        CHECK: return
    """)
    run_passes(payload, "linalg-fold-unit-extent-dims, canonicalize, cse")
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK: linalg.generic {{.*}}iterator_types = ["parallel", "parallel", "parallel", "reduction"]{{.*}} ins(%{{.*}}, %{{.*}} : tensor<2x8x4xf32>, tensor<2x4x8xf32>) outs(%{{.*}} : tensor<2x8x8xf32>)
        CHECK-NOT: tensor.expand_shape
        CHECK: %[[V:.*]] = tensor.collapse_shape %arg2
        CHECK-NOT: tensor.expand_shape
        CHECK: linalg.generic {{.*}}iterator_types = ["parallel", "parallel", "parallel", "reduction"]{{.*}} ins(%{{.*}}, %[[V]] : tensor<2x8x8xf32>, tensor<2x8x4xf32>) outs(%{{.*}} : tensor<2x8x4xf32>)
        CHECK-NEXT: ^bb0
        CHECK-NEXT: arith.mulf
        CHECK-NEXT: arith.addf
        CHECK-NEXT: linalg.yield
        CHECK-NEXT: }
        CHECK-NEXT: tensor.expand_shape
        CHECK-NEXT: return
    """)
    got = run_module(payload, list(imported.args))
    torch.testing.assert_close(got[0], imported.reference()[0])


def test_sdpa_import_with_two_batches_has_no_reshape_left():
    imported = _import_attention(batch=2)
    payload = imported.module
    _normalize(payload)
    run_passes(payload, "linalg-fold-unit-extent-dims, canonicalize, cse")
    check(payload, """
        CHECK-NOT: tensor.collapse_shape
        CHECK-NOT: tensor.expand_shape
        CHECK: iterator_types = ["parallel", "parallel", "parallel", "parallel", "reduction"]
        CHECK-SAME: tensor<2x2x8x4xf32>, tensor<2x2x4x8xf32>
        CHECK: iterator_types = ["parallel", "parallel", "parallel", "parallel", "reduction"]
        CHECK-SAME: tensor<2x2x8x8xf32>, tensor<2x2x8x4xf32>
    """)
    got = run_module(payload, list(imported.args))
    torch.testing.assert_close(got[0], imported.reference()[0])


# The reduction dim of a matmul is the collapsed one: it becomes two reduction loops.
SPLIT_K = """
func.func @main(%x: tensor<3x2x4xf32>, %y: tensor<2x4x5xf32>) -> tensor<3x5xf32> {
  %zero = arith.constant 0.0 : f32
  %a = tensor.collapse_shape %x [[0], [1, 2]] : tensor<3x2x4xf32> into tensor<3x8xf32>
  %b = tensor.collapse_shape %y [[0, 1], [2]] : tensor<2x4x5xf32> into tensor<8x5xf32>
  %e = tensor.empty() : tensor<3x5xf32>
  %f = linalg.fill ins(%zero : f32) outs(%e : tensor<3x5xf32>) -> tensor<3x5xf32>
  %r = linalg.matmul ins(%a, %b : tensor<3x8xf32>, tensor<8x5xf32>) outs(%f : tensor<3x5xf32>) -> tensor<3x5xf32>
  return %r : tensor<3x5xf32>
}
"""


def test_split_reduction_dim():
    payload = parse(SPLIT_K)
    _fold(payload)
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK-SAME: (%[[X:.*]]: tensor<3x2x4xf32>, %[[Y:.*]]: tensor<2x4x5xf32>)
        CHECK-NOT: tensor.collapse_shape
        CHECK: linalg.generic
        CHECK-SAME: iterator_types = ["parallel", "parallel", "reduction", "reduction"]
        CHECK-SAME: ins(%[[X]], %[[Y]] : tensor<3x2x4xf32>, tensor<2x4x5xf32>)
    """)
    torch.manual_seed(0)
    x, y = torch.randn(3, 2, 4), torch.randn(2, 4, 5)
    got = run_module(payload, [x, y])[0]
    torch.testing.assert_close(got, x.reshape(3, 8) @ y.reshape(8, 5))


def test_keep_reduction_loops_leaves_the_split_reduction_dim():
    """With keep_reduction_loops (the matmul family's normal form) neither collapse is folded
    into the matmul's reduction loop: both stay reshapes of its operands."""
    payload = parse(SPLIT_K)
    apply(payload, lambda root: fold_reshape_ops_by_expansion(match(root, "func.func"),
                                                              keep_reduction_loops=True))
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK: tensor.collapse_shape %arg0 {{\\[}}[0], [1, 2]] : tensor<3x2x4xf32> into tensor<3x8xf32>
        CHECK: tensor.collapse_shape %arg1 {{\\[}}[0, 1], [2]] : tensor<2x4x5xf32> into tensor<8x5xf32>
        CHECK: linalg.matmul
    """)
    torch.manual_seed(0)
    x, y = torch.randn(3, 2, 4), torch.randn(2, 4, 5)
    torch.testing.assert_close(run_module(payload, [x, y])[0], x.reshape(3, 8) @ y.reshape(8, 5))


RANK0 = """
#id = affine_map<(d0) -> (d0)>
#s = affine_map<(d0) -> ()>
func.func @main(%x: tensor<1xf32>, %y: tensor<5xf32>) -> tensor<5xf32> {
  %c = tensor.collapse_shape %x [] : tensor<1xf32> into tensor<f32>
  %e = tensor.empty() : tensor<5xf32>
  %r = linalg.generic {indexing_maps = [#s, #id, #id], iterator_types = ["parallel"]}
      ins(%c, %y : tensor<f32>, tensor<5xf32>) outs(%e : tensor<5xf32>) {
  ^bb0(%a: f32, %b: f32, %out: f32):
    %0 = arith.addf %a, %b : f32
    linalg.yield %0 : f32
  } -> tensor<5xf32>
  return %r : tensor<5xf32>
}
"""


def test_reshapes_to_or_from_rank_0_are_left_alone():
    # the unbatched cross-entropy loss has these; folding them once built invalid IR
    payload = parse(RANK0)
    _fold(payload)
    payload.operation.verify()
    check(payload, """
        CHECK: tensor.collapse_shape %{{.*}} [] : tensor<1xf32> into tensor<f32>
        CHECK: linalg.generic
    """)
    out = run_module(payload, [torch.tensor([2.0]), torch.arange(5.0)])
    out = out[0] if isinstance(out, (list, tuple)) else out
    torch.testing.assert_close(out, torch.arange(5.0) + 2)
