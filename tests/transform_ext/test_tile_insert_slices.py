"""tile_insert_slices: IR (FileCheck), numerics of the generic schedule against torch on the
insert_slices its vectorizer used to get wrong (strides dropped, a rank-reducing insert
written along the wrong dim, whole-source vectors), and rejection of dynamic sizes."""

import re

import pytest
import torch

from schedules.common import match
from transform_ext.tile_insert_slices import dropped_dims, tile_insert_slices
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module


def insert_payload(src: list[int], dst: list[int], offsets, sizes, strides, dtype="f32") -> str:
    def t(shape):
        return f"tensor<{'x'.join(map(str, shape))}{'x' if shape else ''}{dtype}>"

    def ints(v):
        return ", ".join(map(str, v))

    return f"""
    func.func @main(%src: {t(src)}, %dst: {t(dst)}) -> {t(dst)} {{
      %r = tensor.insert_slice %src into %dst[{ints(offsets)}] [{ints(sizes)}] [{ints(strides)}]
          : {t(src)} into {t(dst)}
      return %r : {t(dst)}
    }}
    """


def torch_insert(src, dst, offsets, sizes, strides):
    """The insert_slice semantics, written with torch indexing."""
    out = dst.clone()
    index = tuple(slice(o, o + s * (n - 1) + 1, s) for o, n, s in zip(offsets, sizes, strides))
    out[index] = src.reshape(sizes)
    return out


CASES = {
    # the zero-stuffed input of a stride-2 transposed convolution (KernelBench 79)
    "inner_stride": ([4, 16], [1, 4, 35], [0, 0, 2], [1, 4, 16], [1, 1, 2]),
    "outer_stride": ([2, 4], [8, 4], [0, 0], [2, 4], [3, 1]),
    "both_strided": ([3, 5], [9, 17], [1, 2], [3, 5], [3, 3]),
    # a column: the dropped unit dim is the innermost one
    "trailing_drop": ([8], [8, 4], [0, 1], [8, 1], [1, 1]),
    "middle_drop": ([6, 5], [6, 3, 5], [0, 2, 0], [6, 1, 5], [1, 1, 1]),
    # larger than a vector tile, contiguous, prime innermost extent (a padded activation)
    "large_padding": ([3, 200, 67], [3, 204, 71], [0, 2, 2], [3, 200, 67], [1, 1, 1]),
    "scalar_source": ([], [4, 4], [2, 3], [1, 1], [1, 1]),
}


@pytest.mark.parametrize("name", CASES)
def test_generic_schedule_matches_torch(name):
    src_shape, dst_shape, offsets, sizes, strides = CASES[name]
    g = torch.Generator().manual_seed(0)
    src, dst = torch.randn(src_shape, generator=g), torch.randn(dst_shape, generator=g)
    got = run_module(parse(insert_payload(src_shape, dst_shape, offsets, sizes, strides)),
                     [src, dst])[0]
    torch.testing.assert_close(got, torch_insert(src, dst, offsets, sizes, strides), rtol=0, atol=0)


def test_integer_elements_keep_their_strides():
    src_shape, dst_shape, offsets, sizes, strides = CASES["both_strided"]
    src = torch.arange(15, dtype=torch.int32).reshape(src_shape)
    dst = torch.full(dst_shape, -1, dtype=torch.int32)
    got = run_module(parse(insert_payload(src_shape, dst_shape, offsets, sizes, strides, "i32")),
                     [src, dst])[0]
    assert torch.equal(got, torch_insert(src, dst, offsets, sizes, strides))


def test_a_strided_insert_keeps_its_stride():
    payload = parse(insert_payload(*CASES["inner_stride"]))
    apply(payload, lambda root: tile_insert_slices(match(root, "func.func"), 64, 256))
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK-DAG: %[[SRC:.*]] = tensor.expand_shape %arg0 {{\\[}}[0, 1], [2]] output_shape [1, 4, 16]
        CHECK: scf.for %[[I:.*]] = %{{.*}} to %c4 step %c1
        CHECK: scf.for %[[J:.*]] = %{{.*}} to %c16 step %c1
        CHECK: %[[TILE:.*]] = tensor.extract_slice %[[SRC]][0, %[[I]], %[[J]]] [1, 1, 1] [1, 1, 1]
        CHECK: %[[TWICE:.*]] = arith.muli %[[J]], %c2
        CHECK: %[[AT:.*]] = arith.addi %c2{{.*}}, %[[TWICE]]
        CHECK: tensor.insert_slice %[[TILE]] into %{{.*}}[0, %[[I]], %[[AT]]] [1, 1, 1] [1, 1, 1]
        CHECK-NOT: tensor.insert_slice
    """)


def test_after_vectorization_the_write_is_strided():
    """Through the generic schedule's vectorize stage: each element is written at 2 j + 2,
    never as one contiguous vector<4x16xf32>."""
    from schedules.generic import GenericParams, vectorize_generic

    payload = parse(insert_payload(*CASES["inner_stride"]))
    with payload.context:
        vectorize_generic(payload, GenericParams())
    text = str(payload)
    check(text, """
        CHECK-LABEL: func.func @main
        CHECK: scf.for %[[J:.*]] = %{{.*}} to %c16 step %c1
        CHECK: %[[TWICE:.*]] = arith.muli %[[J]], %c2
        CHECK: %[[AT:.*]] = arith.addi %[[TWICE]], %c2
        CHECK: vector.transfer_write %{{.*}}, %{{.*}}[%c0, %{{.*}}, %[[AT]]] {{.*}} : vector<1x1x1xf32>, tensor<1x4x35xf32>
    """)
    assert "vector<4x16xf32>" not in text


def test_vectors_stay_tile_sized():
    """A large contiguous insert becomes 1 x 1 x W tiles (W divides the innermost extent),
    not one vector as large as the source."""
    from schedules.generic import GenericParams, vectorize_generic

    payload = parse(insert_payload([3, 200, 64], [3, 204, 68], [0, 2, 2], [3, 200, 64], [1, 1, 1]))
    with payload.context:
        vectorize_generic(payload, GenericParams(vector_tile=64))
    shapes = {tuple(map(int, m.split("x")[:-1]))
              for m in re.findall(r"vector<([0-9x]+x[a-z0-9]+)>", str(payload))}
    assert shapes == {(1, 1, 64)}, shapes


def test_tiles_and_small_unit_stride_inserts_are_left_alone():
    text = insert_payload([1, 1, 16], [4, 4, 16], [1, 2, 0], [1, 1, 16], [1, 1, 1])
    payload = parse(text)
    before = str(payload)
    apply(payload, lambda root: tile_insert_slices(match(root, "func.func"), 64, 256))
    assert str(payload) == before


def test_dropped_dims_match_from_the_innermost_dim():
    assert dropped_dims([1, 4, 16], [4, 16]) == [0]
    assert dropped_dims([8, 1], [8]) == [1]
    assert dropped_dims([6, 1, 5], [6, 5]) == [1]
    assert dropped_dims([1, 1], []) == [0, 1]


DYNAMIC = """
    func.func @main(%src: tensor<?xf32>, %dst: tensor<64xf32>, %n: index) -> tensor<64xf32> {
      %r = tensor.insert_slice %src into %dst[0] [%n] [2] : tensor<?xf32> into tensor<64xf32>
      return %r : tensor<64xf32>
    }
"""


def test_rejects_a_targeted_insert_with_dynamic_sizes():
    payload = parse(DYNAMIC)
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: tile_insert_slices(match(root, "tensor.insert_slice"), 64, 256))
    assert "transform_ext.tile_insert_slices: tensor.insert_slice" in message
    assert "dynamic sizes, strides or source shape" in message
    assert str(payload) == before


def test_leaves_nested_dynamic_inserts_alone():
    """(vectorize_children leaves them unvectorized too)"""
    payload = parse(DYNAMIC)
    before = str(payload)
    apply(payload, lambda root: tile_insert_slices(match(root, "func.func"), 64, 256))
    assert str(payload) == before


def test_an_update_in_place_is_left_alone():
    """A large tile computed into a slice of the destination at the same offsets (a class
    tile of dW accumulated in a loop) is written in place by bufferization: no copy loop."""
    payload = parse("""
    func.func @main(%dst: tensor<256x64xf32>, %a: tensor<64x64xf32>, %i: index) -> tensor<256x64xf32> {
      %tile = tensor.extract_slice %dst[%i, 0] [64, 64] [1, 1] : tensor<256x64xf32> to tensor<64x64xf32>
      %sum = linalg.add ins(%tile, %a : tensor<64x64xf32>, tensor<64x64xf32>) outs(%tile : tensor<64x64xf32>) -> tensor<64x64xf32>
      %r = tensor.insert_slice %sum into %dst[%i, 0] [64, 64] [1, 1] : tensor<64x64xf32> into tensor<256x64xf32>
      %moved = tensor.insert_slice %sum into %dst[0, 0] [64, 64] [1, 1] : tensor<64x64xf32> into tensor<256x64xf32>
      %s = linalg.add ins(%r, %moved : tensor<256x64xf32>, tensor<256x64xf32>) outs(%dst : tensor<256x64xf32>) -> tensor<256x64xf32>
      return %s : tensor<256x64xf32>
    }
    """)
    apply(payload, lambda root: tile_insert_slices(match(root, "func.func"), 16, max_elements=256))
    check(str(payload), """
        CHECK: %[[SUM:.*]] = linalg.add
        CHECK: tensor.insert_slice %[[SUM]] into %{{.*}}[%{{.*}}, 0] [64, 64] [1, 1]
        CHECK: scf.for
        CHECK:   scf.for
        CHECK:     tensor.insert_slice {{.*}}[1, 16] [1, 1]
    """)


RESHAPED_UPDATE = """
func.func @main(%dst: tensor<256x64xf32>, %a: tensor<64x8x8xf32>) -> tensor<256x64xf32> {
  %tile = tensor.extract_slice %dst[64, 0] [64, 64] [1, 1] : tensor<256x64xf32> to tensor<64x64xf32>
  %split = tensor.expand_shape %tile [[0], [1, 2]] output_shape [64, 8, 8]
      : tensor<64x64xf32> into tensor<64x8x8xf32>
  %sum = linalg.add ins(%split, %a : tensor<64x8x8xf32>, tensor<64x8x8xf32>)
      outs(%split : tensor<64x8x8xf32>) -> tensor<64x8x8xf32>
  %merged = tensor.collapse_shape %sum [[0], [1, 2]] : tensor<64x8x8xf32> into tensor<64x64xf32>
  %r = tensor.insert_slice %merged into %dst[64, 0] [64, 64] [1, 1] : tensor<64x64xf32> into tensor<256x64xf32>
  return %r : tensor<256x64xf32>
}
"""


def test_an_update_in_place_through_reshapes_is_left_alone():
    """A row block of dh accumulated in [rows, D/32, 32] (expanded from the slice,
    collapsed back): the same elements in the same order, written in place by
    bufferization, not tiled into a copy loop out of and back into the destination."""
    payload = parse(RESHAPED_UPDATE)
    apply(payload, lambda root: tile_insert_slices(match(root, "func.func"), 16, max_elements=256))
    check(str(payload), """
        CHECK: %[[MERGED:.*]] = tensor.collapse_shape
        CHECK: tensor.insert_slice %[[MERGED]] into %{{.*}}[64, 0] [64, 64] [1, 1]
        CHECK-NOT: scf.for
    """)
    g = torch.Generator().manual_seed(0)
    dst, a = torch.randn(256, 64, generator=g), torch.randn(64, 8, 8, generator=g)
    expected = dst.clone()
    expected[64:128] += a.reshape(64, 64)
    got = run_module(parse(RESHAPED_UPDATE), [dst, a])[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
